import json
import time

import pytest

from bardflow.artifacts.manifest import version_key
from bardflow.artifacts.store import MANIFEST, Store, StoreError


def write(text):
    def work(out):
        out.path("a.txt").write_text(text)
        out.path("sub/b.bin").write_bytes(b"\x00\x01")
        out.metrics["n"] = len(text)

    return work


def test_version_key_changes_with_every_ingredient():
    base = version_key("encode", "1", {"seq_len": 256}, {"fetch": "abc"})
    assert base == version_key("encode", "1", {"seq_len": 256}, {"fetch": "abc"})
    assert (
        len(
            {
                base,
                version_key("encode", "2", {"seq_len": 256}, {"fetch": "abc"}),
                version_key("encode", "1", {"seq_len": 128}, {"fetch": "abc"}),
                version_key("encode", "1", {"seq_len": 256}, {"fetch": "abd"}),
                version_key("fetch", "1", {"seq_len": 256}, {"fetch": "abc"}),
            }
        )
        == 5
    )


def test_produce_publishes_a_checksummed_version_then_reuses_it(tmp_path):
    store = Store(tmp_path)
    key = version_key("demo", "1", {}, {})
    version, ran = store.produce("demo", key, {"p": 1}, {}, write("hello"))
    assert ran and version.path == tmp_path / "demo" / key
    manifest = json.loads((version.path / MANIFEST).read_text())
    assert set(manifest["files"]) == {"a.txt", "sub/b.bin"}
    assert manifest["params"] == {"p": 1} and manifest["metrics"] == {"n": 5}
    assert {"jax", "prefect", "pyarrow"} <= set(manifest["libraries"])
    again, ran = store.produce("demo", key, {"p": 1}, {}, write("other"))
    assert not ran and again.fingerprint == version.fingerprint
    assert (again.path / "a.txt").read_text() == "hello"


def test_a_failing_stage_leaves_nothing_and_keeps_the_earlier_version(tmp_path):
    store = Store(tmp_path)
    key = version_key("demo", "1", {}, {})
    store.produce("demo", key, {}, {}, write("first"))

    def crash(out):
        out.path("a.txt").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        store.produce("demo", key, {}, {}, crash, force=True)
    other = version_key("demo", "1", {"x": 1}, {})
    with pytest.raises(RuntimeError):
        store.produce("demo", other, {}, {}, crash)
    # No lock file, build folder or empty resume folder is left behind.
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == [key]
    assert (store.lookup("demo", key).path / "a.txt").read_text() == "first"

    def crash_after_a_checkpoint(out):
        (out.resume.path / "10").mkdir(parents=True)
        (out.resume.path / "10" / "state").write_text("resumable")
        raise RuntimeError("preempted")

    with pytest.raises(RuntimeError):
        store.produce("demo", other, {}, {}, crash_after_a_checkpoint)
    assert (tmp_path / "demo" / f".resume-{other}" / "10" / "state").exists()  # what a rerun resumes from stays


def test_a_hand_edited_manifest_is_noticed_and_the_version_rebuilt(tmp_path):
    store = Store(tmp_path)
    key = version_key("demo", "1", {}, {})
    version, _ = store.produce("demo", key, {}, {}, write("hello"))
    manifest = json.loads((version.path / MANIFEST).read_text())
    assert store.lookup("demo", key) is not None and manifest["digest"]
    manifest["metrics"]["n"] = 999  # a figure changed by hand; every file is untouched
    (version.path / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    assert store.lookup("demo", key) is None and not store.versions("demo")  # nor listed with the edited figure
    notices = []
    rebuilt, ran = store.produce("demo", key, {}, {}, write("hello"), notice=notices.append)
    assert ran and rebuilt.metrics["n"] == 5 and "damaged or incomplete" in notices[0]


def test_damaged_or_missing_files_make_a_version_invisible(tmp_path):
    store = Store(tmp_path)
    key = version_key("demo", "1", {}, {})
    version, _ = store.produce("demo", key, {}, {}, write("hello"))
    (version.path / "sub" / "b.bin").write_bytes(b"\x00\x02")  # same size, flipped bit
    assert store.lookup("demo", key) is None
    with pytest.raises(StoreError, match="--refresh demo"):
        store.require(version)
    rebuilt, ran = store.produce("demo", key, {}, {}, write("hello"))
    assert ran and store.lookup("demo", key) is not None
    (rebuilt.path / "a.txt").unlink()
    assert store.lookup("demo", key) is None


def test_a_lookup_reads_again_only_what_changed_since_this_process_read_it(tmp_path, monkeypatch):
    from bardflow.artifacts import store as store_module

    read = []
    real = store_module.file_digest
    monkeypatch.setattr(store_module, "file_digest", lambda path, *a: read.append(path.name) or real(path, *a))
    store = Store(tmp_path)
    key = version_key("demo", "1", {}, {})
    version, _ = store.produce("demo", key, {}, {}, write("hello"))
    read.clear()
    assert store.lookup("demo", key) and store.lookup("demo", key)
    assert sorted(read) == ["a.txt", "a.txt", "b.bin", "b.bin"]  # just written: not yet settled, read each time
    monkeypatch.setattr(store_module, "SETTLED_NS", 0)
    read.clear()
    assert store.lookup("demo", key) and store.lookup("demo", key) and store.require(version)
    assert sorted(read) == ["a.txt", "b.bin"]  # once, then remembered
    time.sleep(0.05)  # past the file clock's tick
    (version.path / "sub" / "b.bin").write_bytes(b"\x00\x02")  # same size, flipped bit
    assert store.lookup("demo", key) is None and read[-1] == "b.bin"


def test_a_file_hashed_as_it_was_written_is_not_read_again_until_it_changes(tmp_path, monkeypatch):
    import hashlib

    from bardflow.artifacts import store as store_module

    read = []
    real = store_module.file_digest
    monkeypatch.setattr(store_module, "file_digest", lambda path, *a: read.append(path.name) or real(path, *a))
    data = b"hashed as it was written"

    def work(out):
        out.path("a.txt").write_bytes(data)
        out.digests["a.txt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        out.path("sub/b.bin").write_bytes(b"\x00\x01")

    store = Store(tmp_path)
    key = version_key("demo", "1", {}, {})
    version, _ = store.produce("demo", key, {}, {}, work)
    assert read == ["b.bin", "b.bin"]  # sealed and then checked; a.txt neither time
    assert store.lookup("demo", key) and store.require(version) and "a.txt" not in read
    time.sleep(0.05)  # past the file clock's tick
    (version.path / "a.txt").write_bytes(data.upper())  # same size
    read.clear()
    assert store.lookup("demo", key) is None and "a.txt" in read


def test_refresh_with_the_same_output_keeps_the_version_and_new_output_replaces_it(tmp_path):
    store = Store(tmp_path)
    key = version_key("demo", "1", {}, {})
    first, _ = store.produce("demo", key, {}, {}, write("same"))
    created = first.manifest["created"]
    kept, ran = store.produce("demo", key, {}, {}, write("same"), force=True)
    assert ran and kept.manifest["created"] == created and not (tmp_path / "demo" / ".replaced").exists()
    changed, _ = store.produce("demo", key, {}, {}, write("new"), force=True)
    assert changed.fingerprint != first.fingerprint
    assert len(list((tmp_path / "demo" / ".replaced").iterdir())) == 1  # the old one is set aside


@pytest.mark.parametrize("stage, key", [("../etc", "0" * 20), ("demo", "../../x"), ("Demo", "0" * 20)])
def test_names_cannot_leave_the_store(tmp_path, stage, key):
    with pytest.raises(StoreError):
        Store(tmp_path).path(stage, key)


def test_an_unwritable_store_is_a_clear_error(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # a file where the store's folder would go: writes fail, even as root
    with pytest.raises(StoreError, match="cannot write to the store .* --store"):
        Store(blocker / "store").produce("demo", "0" * 20, {}, {}, write("x"))


def test_versions_lists_newest_first(tmp_path):
    store = Store(tmp_path)
    for text in ("a", "bb"):
        store.produce("demo", version_key("demo", "1", {"t": text}, {}), {}, {}, write(text))
    listed = store.versions()
    assert [v.metrics["n"] for v in listed] in ([2, 1], [1, 2])  # same second: any order
    assert all(v.stage == "demo" for v in listed) and len(listed) == 2


def test_runs_tell_versions_apart_by_their_corpus(tmp_path):
    """`bardflow runs` compared two trainings on different text by a 64-digit encode hash;
    it names each corpus by its source, size and md5."""
    from bardflow.cli.runs import describe, listing, manifests_of
    from bardflow.config.settings import DataConfig
    from bardflow.tasks.corpus_identity import pin
    from bardflow.tasks.registry import ENCODE, FETCH
    from bardflow.tasks.stage import produce
    from tests.helpers import play_text

    store = Store(tmp_path / "store")
    trained = []
    for name, seed in (("plays.txt", 1), ("sonnets.txt", 2)):
        (tmp_path / name).write_bytes(play_text(20_000, seed=seed))
        data = pin(DataConfig(corpus=str(tmp_path / name), seq_len=32))
        fetched, _ = produce(FETCH, data, {}, store)
        encoded, _ = produce(ENCODE, data, {"fetch": fetched}, store)

        def work(out):
            out.path("history.json").write_text("[]")
            out.metrics["val_loss"] = 2.0

        version, _ = store.produce("train_parallel", f"{seed:020x}", {"train": {"steps": 3}}, {"encode": encoded}, work)
        trained.append(version)
    manifests = manifests_of(store)
    assert describe(trained[0], manifests)["data.corpus"].startswith("plays.txt (20,000 bytes, md5 ")
    rows = listing(trained, manifests)
    assert [row["differs"]["corpus"].split(" ")[0] for row in rows] == ["plays.txt", "sonnets.txt"]


def test_runs_lists_trained_versions_newest_first_whatever_their_stage(tmp_path):
    """It listed every single-device version before any data-parallel one."""
    import time

    from bardflow.cli.runs import trained_versions

    store = Store(tmp_path / "store")
    made = []
    for stage in ("train_single", "train_parallel"):
        version, _ = store.produce(stage, "0" * 19 + str(len(made)), {}, {}, lambda out: None)
        made.append(version.key)
        time.sleep(1.1)  # a manifest's time is to the second
    found, _ = trained_versions(str(tmp_path / "store"))
    assert [v.key for v in found] == made[::-1]
