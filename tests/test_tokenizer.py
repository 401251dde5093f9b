"""data.tokenizer: a byte-level BPE trained as a stage, its ids in the Arrow shards, and the
refusals of what cannot serve. A bytes run keeps its stages and keys."""

import json
from pathlib import Path

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
def test_a_tiny_bpe_run_tokenizes_trains_exports_and_samples_text(tmp_path, run_env):
    """The pipeline with data.tokenizer=bpe: the tokenizer trained as a stage, its ids in the
    shards, the model's vocabulary its, bits per byte from the loss per token, the export's
    transformers folder carrying it (transformers' greedy ids and its tokenizer's ids are
    bardflow's), samples decoded to text; a rerun takes every stage from the store, and
    the checkpoint serves text (``served``)."""
    import math

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
    table = json.loads(next((tmp_path / "store" / "compare").rglob("comparison.json")).read_text())
    rows = {row[0]: row[1:] for row in table["rows"]}
    assert float(rows["Validation bits per byte"][1]) == pytest.approx(trained["val_bpb"], abs=1e-4)
    assert float(rows["Bytes/s"][1].replace(",", "")) > float(rows["Tokens/s"][1].replace(",", ""))
    for sample in summary["samples"]:
        assert sample["text"].startswith(sample["prompt"]) and len(sample["text"]) > len(sample["prompt"])
    again = json.loads(call("run", *args, env=env).stdout)
    assert {name: s["state"] for name, s in again["stages"].items()} == {name: "cached" for name in stages}
    served(tmp_path / "store", stages["checkpoint"]["key"], stages["tokenize"]["key"])


def served(store: Path, key: str, tokenize_key: str) -> None:
    """``bardflow serve``'s model and tokenizer for a checkpoint of a bpe run, served over HTTP
    to the ``openai`` client: tokens drawn and counted as tokens (``max_tokens``, the usage,
    ``logprobs``), their bytes the text, the greedy text the sampler's, a stream the same text;
    a tokenizer changed after training refused in one line."""
    import httpx
    from openai import OpenAI

    from bardflow.cli.runs import RunsError
    from bardflow.cli.serve_command import served_model
    from bardflow.model.inference.sampling import generate
    from bardflow.serving.api import create_app
    from bardflow.serving.engine import Engine
    from bardflow.serving.tokens import Vocabulary
    from tests.test_serving import listening

    model, tokenizer, model_id = served_model(str(store), key[:12])
    assert tokenizer is not None and tokenizer.vocab_size == 300
    engine = Engine(model, slots=4, queue_limit=8, vocabulary=Vocabulary.of(tokenizer))
    engine.warm(every=True)
    engine.start()
    try:
        with listening(create_app(engine, model_id, max_tokens=200)) as url:
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            asked = {"model": model_id, "prompt": "ROMEO:", "max_tokens": 12, "temperature": 0.0}
            whole = client.completions.create(**asked, logprobs=2)
            choice, usage = whole.choices[0], whole.usage
            assert usage is not None and choice.logprobs is not None and choice.logprobs.tokens is not None
            assert (usage.prompt_tokens, usage.completion_tokens) == (len(tokenizer.encode(b"ROMEO:")), 12)
            assert len(choice.logprobs.tokens) == 12 and "".join(choice.logprobs.tokens) == choice.text
            greedy = generate(model, "ROMEO:", 12, 0.0, 0, model.max_seq_len, tokenizer)
            assert choice.text == greedy[len(b"ROMEO:") :].decode("utf-8", errors="replace")
            streamed = client.completions.create(**asked, stream=True)
            assert "".join(part.choices[0].text for part in streamed) == choice.text
            ids = httpx.post(f"{url}/tokenize", json={"prompt": "ROMEO:"}, timeout=30).json()["tokens"]
            assert ids == tokenizer.encode(b"ROMEO:").tolist()
    finally:
        engine.stop()
    tokenizer_file = next((store / "tokenize" / tokenize_key).rglob("tokenizer.json"))
    tokenizer_file.chmod(0o644)
    tokenizer_file.write_text(tokenizer_file.read_text().replace('"ROMEO"', '"JULIET"') + " ")
    with pytest.raises(RunsError) as refused:
        served_model(str(store), key[:12])
    assert "is gone or has changed since" in str(refused.value) and "\n" not in str(refused.value)


def test_the_comparison_shows_bits_per_byte_and_bytes_per_second_for_a_tokenizer_s_runs_only():
    import math

    from bardflow.tasks.compare import comparison

    def metrics(val_loss: float, bytes_per_token: float) -> dict:
        bpb = val_loss / math.log(2) / bytes_per_token
        figures = {"tokens_per_s": 1000.0, "ms_per_step": 10.0, "val_loss": val_loss, "val_bpb": bpb, "steps": 5}
        return {**figures, "devices": 2, "global_batch": 8, "per_device_batch": 4}

    for per_token, shown in ((1.0, False), (2.5, True)):
        one, many = metrics(2.0, per_token), metrics(1.9, per_token)
        rows = {row[0]: row[1:] for row in comparison(one, many)["rows"]}  # pyright: ignore[reportArgumentType]
        assert ("Validation bits per byte" in rows) == shown == ("Bytes/s" in rows)
        if shown:
            assert rows["Bytes/s"][:2] == ["2,500", "2,500"]
            assert rows["Validation bits per byte"][1] == f"{1.9 / math.log(2) / 2.5:.4f}"
