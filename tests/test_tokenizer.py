"""data.tokenizer: a byte-level BPE trained as a stage, its ids in the Arrow shards, and the
refusals of what cannot serve. A bytes run keeps its stages and keys."""

import json

import numpy as np
import pytest

from bardflow.config.settings import ConfigError, build_config
from bardflow.model.data.splits import read_split, windows, write_split
from bardflow.model.data.tokenizer import (
    BpeTokenizer,
    TokenizerError,
    chunk_ends,
    encode_to_file,
    training_sample,
)
from tests.helpers import play_text


@pytest.fixture(scope="module")
def trained() -> BpeTokenizer:
    return BpeTokenizer.train(training_sample(np.frombuffer(play_text(200_000), np.uint8)), 300)


def test_every_byte_sequence_comes_back_as_it_went_in(trained):
    """A property over random byte strings (UTF-8 or not, play text or noise, empty too)."""
    rng = np.random.default_rng(0)
    text = play_text(20_000, seed=3)
    for _ in range(300):
        kind = rng.integers(3)
        if kind == 0:
            data = rng.integers(0, 256, int(rng.integers(0, 64)), dtype=np.uint8).tobytes()
        elif kind == 1:
            start = int(rng.integers(0, len(text) - 200))
            data = text[start : start + int(rng.integers(1, 200))]
        else:
            data = "".join(rng.choice(list("aé Ω\n\t€🙂,.")) for _ in range(int(rng.integers(1, 40)))).encode()
        ids = trained.encode(data)
        assert ids.dtype == np.uint16 and ids.max(initial=0) < trained.vocab_size
        assert trained.decode(ids) == data


def test_trained_merges_shorten_the_text_and_text_tools_agree(trained, tmp_path):
    """The trained vocabulary holds the play's words; Hugging Face's tokenizer (the one the
    export writes) gives a text the ids bardflow gives its bytes, and a saved tokenizer
    loads to the same ids."""
    text = play_text(30_000, seed=5)
    ids = trained.encode(text)
    assert trained.vocab_size == 300 and len(text) / len(ids) > 2.0
    line = "ROMEO: What, art thou hurt? ¿Qué? Ω\n  thy  lord\t1234567\n"
    assert trained.for_text().encode(line).ids == trained.encode(line.encode()).tolist()
    trained.save(tmp_path / "tokenizer.json")
    assert np.array_equal(BpeTokenizer.load(tmp_path / "tokenizer.json").encode(text), ids)


def test_a_corpus_encodes_in_chunks_to_the_ids_of_the_whole(trained, tmp_path):
    """Cut only where a piece ends, the chunks' ids are the whole text's, written to a file
    a few chunks at a time; windows of those ids go into uint16 shards and come back."""
    data = np.frombuffer(play_text(300_000, seed=7), np.uint8)
    ends = chunk_ends(data, 10_000)
    assert len(ends) > 20 and ends[-1] == len(data)
    heard: list[int] = []
    count = encode_to_file(trained, data, tmp_path / "ids", heard.append)
    ids = np.fromfile(tmp_path / "ids", np.uint16)
    assert count == len(ids) and heard[-1] == len(data)
    assert np.array_equal(ids, trained.encode(data.tobytes()))
    rows = windows(ids, 32, every_position=True)
    shards = write_split(tmp_path / "train", rows, {}, shard_bytes=4_000)
    read = read_split(tmp_path / "train", shards)
    assert len(shards) > 1 and read.dtype == np.uint16 and np.array_equal(np.asarray(read), rows)


def test_what_a_tokenizer_cannot_be_is_refused_in_one_line(tmp_path):
    """A vocabulary the corpus cannot fill, a tokenizer.json that is not a byte-level BPE,
    a vocabulary out of bounds, a missing file, a model vocabulary that disagrees."""
    with pytest.raises(TokenizerError, match=r"data.vocab_size=5000 is more than this corpus can fill.*at most"):
        BpeTokenizer.train([b"to be or not to be, that is the question\n" * 50], 5000)
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"to": 0, "be": 1, "[UNK]": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "words.json"))
    with pytest.raises(TokenizerError, match="not a byte-level BPE") as refused:
        BpeTokenizer.load(tmp_path / "words.json")
    assert "\n" not in str(refused.value)
    for overrides, words_said in (
        ({"data.tokenizer": "bpe", "data.vocab_size": 100}, ["data.vocab_size", "greater than or equal to 257"]),
        ({"data.tokenizer": str(tmp_path / "nope.json")}, ["nope.json", "No such file", "give bytes, bpe"]),
        ({"data.tokenizer": "bpe", "model.vocab_size": 300}, ["model.vocab_size=300", "leave model.vocab_size out"]),
    ):
        with pytest.raises(ConfigError) as refused:
            build_config("tiny", overrides)
        assert all(word in str(refused.value) for word in words_said), str(refused.value)


def test_the_model_s_vocabulary_follows_the_tokenizer(trained, tmp_path):
    trained.save(tmp_path / "tokenizer.json")
    assert build_config("tiny", {"data.tokenizer": "bpe", "data.vocab_size": 512}).model.vocab_size == 512
    assert build_config("tiny", {"data.tokenizer": str(tmp_path / "tokenizer.json")}).model.vocab_size == 300
    assert build_config("tiny").model.vocab_size == 256


def test_a_bytes_run_has_no_tokenize_stage_and_keeps_its_keys():
    """The tokenizer's settings enter no key of a bytes run, which has the stages it had;
    a BPE run has tokenize, keyed by its vocabulary."""
    from bardflow.tasks.registry import BYTES_RUN, ENCODE, NAMES, STAGES, TOKENIZE
    from bardflow.tasks.stage import RunPlan

    plain = RunPlan(build_config("tiny"), devices=2, platform="cpu")
    ignored = RunPlan(build_config("tiny", {"data.vocab_size": 999}), devices=2, platform="cpu")
    assert [s.name for s in STAGES if s.wanted(plain)] == list(BYTES_RUN) == [n for n in NAMES if n != "tokenize"]
    assert (
        ENCODE.recipe(plain.config.data)
        == ENCODE.recipe(ignored.config.data)
        == {
            "seq_len": 32,
            "train_fraction": 0.9,
            "shuffle_seed": 0,
            "every_position": True,
        }
    )
    bpe = [RunPlan(build_config("tiny", {"data.tokenizer": "bpe", "data.vocab_size": v}), 2, "cpu") for v in (512, 600)]
    assert all(TOKENIZE.wanted(plan) for plan in bpe)
    recipes = [TOKENIZE.recipe(plan.config.data) for plan in bpe]
    assert recipes[0] != recipes[1] and json.dumps(recipes[0], sort_keys=True).count("512") == 1


@pytest.mark.flow
def test_a_tiny_bpe_run_tokenizes_trains_exports_and_samples_text(tmp_path, run_env, capsys):
    """The pipeline with data.tokenizer=bpe: the tokenizer trained as a stage, its ids in the
    shards, the model's vocabulary its, bits per byte from the loss per token, the export's
    transformers folder carrying it (transformers' greedy ids and its tokenizer's ids are
    bardflow's), samples decoded to text; a rerun takes every stage from the store, and
    serving refuses the model in one line."""
    import math
    import socket

    from bardflow.cli.main import main
    from bench.commands import tiny
    from tests.helpers import call, require

    require("torch", "transformers")
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(play_text(200_000, seed=11))
    args = tiny(corpus, tmp_path / "store", "--json", settings=["data.tokenizer=bpe", "data.vocab_size=300"])
    env = {**run_env, "BARDFLOW_HF_CHECK": "on"}  # the session turns the transformers check off
    summary = json.loads(call("run", *args, env=env).stdout)
    stages = summary["stages"]
    assert list(stages)[:3] == ["fetch", "tokenize", "encode"] and all(s["state"] == "ran" for s in stages.values())
    tokenize, encode = stages["tokenize"]["metrics"], stages["encode"]["metrics"]
    assert tokenize["vocab_size"] == encode["vocab_size"] == 300 and encode["val_bytes_per_token"] > 2
    trained = stages["train_parallel"]["metrics"]
    assert trained["val_bpb"] == pytest.approx(
        trained["val_loss"] / math.log(2) / encode["val_bytes_per_token"], rel=1e-3
    )
    assert stages["export"]["metrics"]["hf_checked"] and stages["verify"]["metrics"]["passed"]
    for sample in summary["samples"]:
        assert sample["text"].startswith(sample["prompt"]) and len(sample["text"]) > len(sample["prompt"])
    again = json.loads(call("run", *args, env=env).stdout)
    assert {name: s["state"] for name, s in again["stages"].items()} == {name: "cached" for name in stages}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    key = stages["checkpoint"]["key"][:12]
    capsys.readouterr()
    assert main(["serve", key, "--store", str(tmp_path / "store"), "--port", str(port)]) == 1
    line = capsys.readouterr().err.strip()
    assert "predicts the 300 ids of a tokenizer" in line and "\n" not in line
