"""The store on a real S3 server (SeaweedFS, started by the session): versions committed
manifest-last, verified on the way down, shared between machines (working folders), one
version when two build at once, damage noticed, checkpoints copied up and back."""

from __future__ import annotations

import json
import threading
import uuid

import pytest

from bardflow.artifacts.manifest import version_key
from bardflow.artifacts.objects import ObjectStore, ObjectStoreError, RemoteResumeFolder, open_store
from bardflow.artifacts.store import MANIFEST, Store, StoreError

KEY = version_key("demo", "1", {}, {})


@pytest.fixture
def s3(object_server, monkeypatch):
    """The S3 server's credentials in this process's environment, as a user would set them."""
    for name, value in object_server.env.items():
        monkeypatch.setenv(name, value)
    return object_server


@pytest.fixture
def bucket(s3) -> str:
    return s3.prefix("unit")


def write(text: str):
    def work(out):
        out.path("a.txt").write_text(text)
        out.path("sub/b.bin").write_bytes(text.encode() * 3)
        out.metrics["n"] = len(text)

    return work


def objects(s3, url: str) -> list[str]:
    path = url.removeprefix("s3://")
    found = s3.filesystem().find(path, detail=True)
    return sorted(name.removeprefix(path + "/") for name, info in found.items() if info["type"] == "file")


def test_a_version_is_committed_manifest_last_and_another_machine_reuses_it(s3, bucket, tmp_path):
    here = ObjectStore(bucket, tmp_path / "machine-a")
    version, built = here.produce("demo", KEY, {"p": 1}, {}, write("hello"))
    assert built and version.uri == f"{bucket}/demo/{KEY}" and version.store == bucket
    stored = objects(s3, bucket)
    build = json.loads(s3.filesystem().cat_file(f"{bucket[5:]}/demo/{KEY}/{MANIFEST}"))["objects"]
    assert stored == [f"demo/{KEY}/{build}/a.txt", f"demo/{KEY}/{build}/sub/b.bin", f"demo/{KEY}/{MANIFEST}"]
    assert (version.path / "a.txt").read_text() == "hello"  # the builder's mirror holds it too

    there = ObjectStore(bucket, tmp_path / "machine-b")  # another machine: an empty working folder
    found, built = there.produce("demo", KEY, {"p": 1}, {}, write("other"))
    assert not built and found.fingerprint == version.fingerprint
    assert found.path.is_relative_to(tmp_path / "machine-b") and (found.path / "sub/b.bin").read_bytes() == b"hello" * 3
    assert [(v.key, v.metrics) for v in there.versions()] == [(KEY, {"n": 5})]


def test_without_its_manifest_a_version_is_invisible_and_the_next_builder_clears_it(s3, bucket, tmp_path):
    fs = s3.filesystem()
    fs.pipe_file(f"{bucket[5:]}/demo/{KEY}/build-dead/a.txt", b"half of a crashed build")
    store = ObjectStore(bucket, tmp_path / "w")
    assert store.lookup("demo", KEY) is None and store.versions() == []
    store.produce("demo", KEY, {}, {}, write("whole"))
    assert not [name for name in objects(s3, bucket) if "build-dead" in name]


def test_two_builders_on_two_machines_make_one_version(s3, bucket, tmp_path):
    """Both build (different bytes, as on different hardware); the first manifest written
    wins, the other drops its objects and takes the committed version."""
    results, barrier = {}, threading.Barrier(2)

    def builder(name: str):
        def work(out):
            barrier.wait(timeout=30)  # both are building now
            write(name)(out)

        results[name] = ObjectStore(bucket, tmp_path / name).produce("demo", KEY, {}, {}, work)

    threads = [threading.Thread(target=builder, args=(name,)) for name in ("one", "two")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    (a, built_a), (b, built_b) = results["one"], results["two"]
    assert a.fingerprint == b.fingerprint and (a.path / "a.txt").read_text() == (b.path / "a.txt").read_text()
    assert {built_a, built_b} == {True}  # both built; only one was committed
    assert len({name.split("/")[2] for name in objects(s3, bucket) if "/build-" in name}) == 1


def test_a_damaged_object_is_noticed_and_rebuilt(s3, bucket, tmp_path):
    store = ObjectStore(bucket, tmp_path / "w")
    first, _ = store.produce("demo", KEY, {}, {}, write("good"))
    fs = s3.filesystem()
    fs.pipe_file(f"{bucket[5:]}/demo/{KEY}/{first.manifest['objects']}/a.txt", b"evil")  # same size, other bytes
    # This machine's mirror is intact, but the object's ETag changed: it is not trusted.
    assert store.lookup("demo", KEY) is None
    assert ObjectStore(bucket, tmp_path / "fresh").lookup("demo", KEY) is None  # nor downloaded
    heard = []
    rebuilt, built = store.produce("demo", KEY, {}, {}, write("good"), notice=heard.append)
    assert built and heard and "damaged" in heard[0]
    assert (ObjectStore(bucket, tmp_path / "third").lookup("demo", KEY).path / "a.txt").read_text() == "good"
    assert len({name.split("/")[2] for name in objects(s3, bucket) if "/build-" in name}) == 1


def test_a_damaged_mirror_copy_is_fetched_again(s3, bucket, tmp_path):
    store = ObjectStore(bucket, tmp_path / "w")
    version, _ = store.produce("demo", KEY, {}, {}, write("kept"))
    (version.path / "a.txt").write_text("rot!")
    again = store.lookup("demo", KEY)
    assert again is not None and (again.path / "a.txt").read_text() == "kept"


def test_on_demand_files_come_down_one_by_one_as_they_are_read_and_verified(s3, bucket, tmp_path):
    """A split's shards: a worker's mirror holds the version without them, and fetches each
    (checked against the manifest) when a reader first opens it."""

    def shards(out):
        write("meta")(out)
        for name in ("train/00000.arrow", "train/00001.arrow", "val/00000.arrow"):
            out.path(name).write_bytes(name.encode() * 100)
        out.on_demand = ["train", "val"]

    built, _ = ObjectStore(bucket, tmp_path / "builder").produce("demo", KEY, {}, {}, shards)
    assert built.fetch is not None and built.manifest["on_demand"] == ["train", "val"]
    worker = ObjectStore(bucket, tmp_path / "worker")
    version = worker.lookup("demo", KEY)
    assert version is not None and (version.path / "a.txt").read_text() == "meta"
    assert sorted(p.name for p in version.path.rglob("*.arrow")) == []  # the folders, empty
    version.bring(version.file("train/00001.arrow"))
    assert sorted(p.relative_to(version.path).as_posix() for p in version.path.rglob("*.arrow")) == [
        "train/00001.arrow"
    ]
    assert version.file("train/00001.arrow").read_bytes() == b"train/00001.arrow" * 100
    again = worker.lookup("demo", KEY)  # a fetched shard is verified like the rest; absent ones are fine
    assert again is not None and again.path == version.path
    version.file("train/00001.arrow").write_bytes(b"rot" * 100)
    assert worker.lookup("demo", KEY).file("train/00001.arrow").exists() is False  # damaged: mirrored again
    with pytest.raises(StoreError, match="not a file this version fetches on demand"):
        version.fetch(["a.txt"])
    fs = s3.filesystem()
    fs.pipe_file(f"{bucket[5:]}/demo/{KEY}/{built.manifest['objects']}/val/00000.arrow", b"x" * 1500)
    with pytest.raises(ObjectStoreError, match="differs from its manifest or is gone; rerun with --refresh"):
        version.bring(version.file("val/00000.arrow"))  # a handle taken before the change: caught on reading
    assert not version.file("val/00000.arrow").exists()  # nothing half-trusted is left in place
    # A lookup, on this machine or a fresh one, tells the changed shard by its ETag against the
    # commit record's, before anything reads it: the version is damaged and rebuilt, as a
    # changed local shard is.
    assert worker.lookup("demo", KEY) is None
    assert ObjectStore(bucket, tmp_path / "fresh").lookup("demo", KEY) is None
    heard = []
    rebuilt, again_built = worker.produce("demo", KEY, {}, {}, shards, notice=heard.append)
    assert again_built and "damaged" in heard[0]
    assert ObjectStore(bucket, tmp_path / "third").lookup("demo", KEY) is not None


def test_a_failed_build_leaves_nothing_in_the_bucket(s3, bucket, tmp_path):
    def crash(out):
        out.path("a.txt").write_text("half")
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        ObjectStore(bucket, tmp_path / "w").produce("demo", KEY, {}, {}, crash)
    assert objects(s3, bucket) == []


def test_checkpoints_go_up_once_complete_and_come_down_on_another_machine(s3, bucket, tmp_path):
    url = f"{bucket}/train/.resume-{KEY}"
    here = RemoteResumeFolder(tmp_path / "a", url)
    for step in (100, 200):
        (here.path / str(step) / "state").mkdir(parents=True)
        (here.path / str(step) / "state" / "data").write_bytes(bytes([step % 256]) * 1000)
    (here.path / "300.orbax-checkpoint-tmp-1").mkdir()  # an incomplete save: not a step
    here.push()
    assert sorted(n for n in objects(s3, url) if n.endswith(".json")) == ["100.json", "200.json"]
    there = RemoteResumeFolder(tmp_path / "b", url)
    assert there.pull() == 200 and (there.path / "200/state/data").read_bytes() == bytes([200]) * 1000
    import shutil

    shutil.rmtree(here.path / "100")  # Orbax kept the newest only: the bucket follows
    (here.path / "300" / "state").mkdir(parents=True)
    (here.path / "300" / "state" / "data").write_bytes(b"x")
    here.push()
    assert sorted(n for n in objects(s3, url) if n.endswith(".json")) == ["200.json", "300.json"]

    # A third machine lists step 300, and the run training there moves on to 400 (removing 300)
    # before this one has read it: not damage; the newest step still committed comes down.
    late = RemoteResumeFolder(tmp_path / "c", url)
    listing = late.committed

    def listed_then_the_other_run_moves_on(bucket):
        found = listing(bucket)
        if 400 not in found:
            shutil.rmtree(here.path / "300")
            (here.path / "400" / "state").mkdir(parents=True)
            (here.path / "400" / "state" / "data").write_bytes(b"y")
            here.push()
        return found

    late.committed = listed_then_the_other_run_moves_on
    assert late.pull() == 400 and (late.path / "400/state/data").read_bytes() == b"y"
    there.clear()
    assert objects(s3, url) == [] and not there.path.exists()


@pytest.mark.parametrize("case", ["missing bucket", "wrong credentials", "unreachable endpoint"])
def test_a_store_that_cannot_be_used_gets_one_clear_error(case, s3, monkeypatch, tmp_path):
    url = f"s3://bardflow-missing-{uuid.uuid4().hex[:6]}" if case == "missing bucket" else s3.prefix("errors")
    if case == "wrong credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    if case == "unreachable endpoint":
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    expected = {
        "missing bucket": ["does not exist", "aws s3 mb", "--store"],
        "wrong credentials": ["refused access", "AWS_SECRET_ACCESS_KEY"],
        "unreachable endpoint": ["cannot reach", "AWS_ENDPOINT_URL"],
    }[case]
    store = open_store(url, tmp_path / "w")
    with pytest.raises(ObjectStoreError) as error:
        store.check()
    assert all(part in str(error.value) for part in expected), str(error.value)
    assert "\n" not in str(error.value)
    if case != "unreachable endpoint":  # there, each call waits out the client's retries again
        with pytest.raises(ObjectStoreError):
            store.produce("demo", KEY, {}, {}, write("x"))
    assert not list((tmp_path / "w").rglob("*.txt"))


def test_a_bucket_named_like_one_holds_a_new_store_and_its_deletion_names_the_path(s3, tmp_path):
    """A missing bucket is told from an empty prefix by asking for the bucket itself: a name
    with "bucket" in it (whose "no such key" text says "bucket") is a bucket like any other."""
    name = f"ml-bucket-{uuid.uuid4().hex[:6]}"
    s3.filesystem().mkdir(name)
    store = open_store(f"s3://{name}/store", tmp_path / "w")
    store.check()  # an empty prefix of an existing bucket: a new store
    version, built = store.produce("demo", KEY, {}, {}, write("x"))
    assert built and store.lookup("demo", KEY) is not None
    s3.filesystem().rm(name, recursive=True)  # the bucket goes away mid-run
    with pytest.raises(ObjectStoreError) as error:
        store.produce("demo", version_key("demo", "2", {}, {}), {}, {}, write("y"))
    message = str(error.value)
    assert f"the bucket '{name}' does not exist" in message and "\n" not in message
    assert f"s3://{name}/store" in message  # where it was, never an empty path


def test_locations_pick_the_store(tmp_path):
    assert isinstance(open_store(tmp_path / "s"), Store)
    assert isinstance(open_store("s3://bucket/prefix", tmp_path), ObjectStore)
    with pytest.raises(StoreError, match="unsupported store"):
        open_store("ftp://host/x")
