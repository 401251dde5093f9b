"""Serving (``serving/``): the continuous-batching engine gives each request the bytes the
sampler gives it alone, with every program compiled before the first request; the HTTP API
answers the official ``openai`` client, whole and streamed, refuses what it cannot take with
OpenAI's error object and status, and keeps answering through 64 concurrent streams of which
some hang up midway."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time

import httpx
import jax
import numpy as np
import pytest
from flax import nnx

from bardflow.config.settings import build_config
from bardflow.model.inference.sampling import generate
from bardflow.model.network import decode_kernels
from bardflow.model.network.transformer import build_model
from bardflow.serving.api import MAX_BODY, create_app
from bardflow.serving.engine import Engine, Sampling, Sequence, ServerFull
from bardflow.serving.layouts import SharedRows
from bardflow.serving.limits import ServingError
from bardflow.serving.shapes import SHORTEST_FILL, buckets, decode_sizes, fills

MODEL_ID = "bardflow-test"
ROPE = build_config("tiny", {"model.positions": "rope"}).model  # a 32-byte context whose cache is a ring
LEARNED = build_config("tiny").model
# A bfloat16 cache's decode kernels store tiles of 16 positions: parts of 16, 32 and 64.
ROPE_64 = build_config("tiny", {"model.positions": "rope", "model.max_seq_len": 64}).model
# Six requests for three or more slots: some wait, join and leave; one runs past the context.
SIX_REQUESTS = [
    (b"ROMEO:", 70, Sampling(temperature=0.8, seed=7)),  # past the 32-byte context: the ring
    (b"To be", 40, Sampling(temperature=0.0)),
    (b"A" * 30, 25, Sampling(temperature=1.2, seed=3)),
    (b"KING", 50, Sampling(temperature=0.5, seed=11)),
    (b"x", 10, Sampling(temperature=0.9, seed=5)),
    (b"JULIET:\nO", 33, Sampling(temperature=1.0, seed=2)),
]


@pytest.fixture(scope="module")
def rope_model():
    return build_model(ROPE, 0)


def alone(model, prompt: bytes, count: int, temperature: float, seed: int) -> bytes:
    """What the compiled sampler gives this prompt and seed by itself."""
    return generate(model, prompt.decode(), count, temperature, seed, model.max_seq_len)[len(prompt) :]


@contextlib.contextmanager
def xla_compiles():
    """The programs XLA is asked for within the block, each compiled or read from the
    persistent cache (a program found compiled in the process asks for nothing)."""
    asked: list[str] = []

    def heard(event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            asked.append(kwargs.get("fun_name", event))

    jax.monitoring.register_event_duration_secs_listener(heard)
    try:
        yield asked
    finally:
        jax.monitoring.unregister_event_duration_listener(heard)


def served(engine: Engine, requests: list[tuple[bytes, int, Sampling]], stop=()) -> list[tuple[bytes, str]]:
    """Submits every request at once and waits for all: (bytes, finish reason) each."""
    results: list[list] = [[bytearray(), None] for _ in requests]
    left = threading.Semaphore(0)

    def finisher(result):
        def finish(reason):
            result[1] = reason
            left.release()

        return finish

    engine.submit(
        [
            Sequence(prompt, count, sampling, stop, result[0].extend, finisher(result))
            for (prompt, count, sampling), result in zip(requests, results, strict=True)
        ]
    )
    for _ in requests:
        assert left.acquire(timeout=120)
    return [(bytes(data), reason) for data, reason in results]


def test_a_call_reads_the_shortest_part_of_the_cache_that_holds_its_positions():
    # Every context is read whole or in halvings; a quarter always; shorter parts only where
    # they stay at least SHORTEST_FILL positions long (each is a program per decode size).
    for window in (24, 32, 128, 256, 1024, 4096):
        parts = fills(window)
        assert parts == sorted(parts) and parts[-1] == window
        assert all(b == 2 * a for a, b in zip(parts, parts[1:], strict=False))
        assert parts[0] == window // 4 or SHORTEST_FILL <= parts[0] < 2 * SHORTEST_FILL
    assert fills(1024) == [128, 256, 512, 1024]  # gpt2: 200 bytes of a new request read 128, then 256
    assert fills(100) == [25, 50, 100] and fills(30) == [30]
    assert fills(1056) == [264, 528, 1056]  # 264 halves into 132: not whole 16-position tiles
    assert fills(1088) == [272, 544, 1088]  # nor 136


@pytest.mark.parametrize("select_writes", [False, True], ids=["scatter", "select"])
def test_each_request_gets_the_bytes_it_gets_alone_and_nothing_compiles_after_warming(rope_model, select_writes):
    # Weights on a device of their own, as a restored checkpoint's are: every program's output
    # then is too, and a program compiled for the engine's first arrays must still fit them.
    graphdef, weights = nnx.split(rope_model)
    engine = Engine(
        nnx.merge(graphdef, jax.device_put(weights, jax.devices()[0])),
        slots=3,
        queue_limit=32,
        select_writes=select_writes,
    )
    requests = SIX_REQUESTS
    with xla_compiles() as asked:
        engine.warm()  # the programs that serve any request; the faster ones compile meanwhile
        engine.start()
        try:
            early = served(engine, requests)  # six requests over three slots: some wait, join, leave
            assert engine.wait_compiled(timeout=120)
        except BaseException:
            engine.stop()
            raise
    try:
        # The decode call for 2 and 3 slots over 8, 16 or all 32 positions; a prefill for 16
        # and 32 bytes; the move of a slot into another's place: each traced and compiled once,
        # those after warming from the shapes of the engine's arrays then, yet fitting them now.
        compiled = engine.compilations
        assert (compiled, decode_sizes(3), fills(32), buckets(32)) == (9, [2, 3], [8, 16, 32], [16, 32])
        assert engine.programs() == compiled == len(asked), asked
        with xla_compiles() as asked:
            results = served(engine, requests)
        assert not asked
        for (prompt, count, sampling), (data, reason) in zip(requests, results, strict=True):
            assert data == alone(rope_model, prompt, count, sampling.temperature, sampling.seed), prompt
            assert reason == "length"
        assert early == results  # served by the programs ready first, or by the faster ones
        assert engine.compilations == compiled  # no request compiled anything
        assert engine.load() == {"slots": 3, "busy": 0, "waiting": 0, "queue_limit": 32}
    finally:
        engine.stop()


def test_a_warm_up_stopped_midway_compiles_no_more_than_is_under_way(rope_model):
    """Ctrl-C while the programs compile (here: the progress callback raising) waits only for
    the compiles under way, not for the ones still queued."""
    engine = Engine(rope_model, slots=3)

    def stopped(done: int) -> None:
        raise KeyboardInterrupt

    with xla_compiles() as asked, pytest.raises(KeyboardInterrupt):
        engine.warm(stopped)
    workers = 1 if jax.default_backend() == "cpu" else engine.programs()
    assert 1 <= len(asked) <= 1 + workers < engine.programs(), asked


@pytest.mark.parametrize(("kernels", "cache"), [(True, None), (True, "bfloat16"), (False, "bfloat16")])
def test_with_the_decode_kernels_or_a_bfloat16_cache_a_request_gets_the_same_bytes_in_a_crowd_as_alone(
    rope_model, kernels, cache
):
    """The Pallas decode kernels (Pallas's interpreter here) sum in another order than the
    sampler, and a bfloat16 cache rounds the keys it keeps, so the bytes they give are the
    engine's own: the same for a request served alone as among others joining and leaving, and
    nothing compiles after warming. One engine of eight slots serves each request alone, then
    all six at once (one kernel step for all)."""
    model = build_model(ROPE_64, 0) if kernels and cache == "bfloat16" else rope_model
    engine = Engine(model, slots=8, queue_limit=8, kernels=kernels, cache_dtype=cache)
    assert engine.caches[0].keys.dtype == (cache or "float32")
    engine.warm(every=True)
    compiled = engine.compilations
    engine.start()
    try:
        with xla_compiles() as asked:
            alone = [served(engine, [request])[0] for request in SIX_REQUESTS]
            together = served(engine, SIX_REQUESTS)
        assert not asked and engine.compilations == compiled == engine.programs()
    finally:
        engine.stop()
    assert together == alone
    assert all(
        reason == "length" and len(data) == count
        for (data, reason), (_, count, _) in zip(together, SIX_REQUESTS, strict=True)
    )


def test_the_decode_kernels_refuse_a_context_that_is_not_read_in_whole_tiles(rope_model):
    odd = build_model(build_config("tiny", {"model.positions": "rope", "model.max_seq_len": 36}).model, 0)
    with pytest.raises(ServingError) as refused:
        Engine(odd, slots=2, kernels=True)
    assert str(refused.value) == (
        "the decode kernels read and store the cache in tiles of 8 positions, and this model's context of 36 bytes "
        "is read in parts of [9, 18, 36]: serve it without the kernels, or train a context that is a multiple of 32"
    )
    Engine(odd, slots=2)  # XLA's path reads any part
    for window in range(32, 4097, 32):  # any context of four tiles or more is read in whole tiles
        SharedRows(window, "float32")
        if window % 64 == 0:
            SharedRows(window, "bfloat16")
    with pytest.raises(
        ServingError,
        match=r"tiles of 16 positions, and this model's context of 32 bytes is read in parts of \[8, 16, 32\]",
    ):
        Engine(rope_model, slots=2, kernels=True, cache_dtype="bfloat16")


@pytest.mark.parametrize("cache", ["float32", "bfloat16"])
def test_with_the_decode_kernels_every_decode_program_lowers_for_a_tpu(rope_model, monkeypatch, cache):
    """Pallas's TPU lowering (Mosaic's) runs on a CPU too: every decode program of the engine
    with the kernels, exported for a TPU, holds one kernel a layer (its two stores and its
    attention), so a kernel that Mosaic cannot lower fails here, without a chip (its compile
    is the chip's)."""
    monkeypatch.setattr(decode_kernels, "_interpret", lambda: False)  # the kernels as a TPU runs them
    model = build_model(ROPE_64, 0) if cache == "bfloat16" else rope_model
    engine = Engine(model, slots=8, kernels=True, cache_dtype=cache)
    inputs = engine._call_inputs({})
    for size in decode_sizes(engine.slots):
        for fill in fills(engine.window):
            with jax.default_matmul_precision(engine.precision):  # as the engine lowers them
                exported = jax.export.export(engine._decode_jit, platforms=["tpu"])(
                    engine.params, engine.caches, size, fill, engine.tokens, engine.keys, *inputs
                )
            assert exported.mlir_module().count("tpu_custom_call") == len(engine.caches), (size, fill)


def test_the_engine_sends_a_call_ahead_but_none_past_the_last_byte_a_length_needs(rope_model):
    """Calls go out before the last one's bytes are read, yet a sequence that ends at its
    length costs no call after its last byte. A prompt over 8 bytes is prefilled, which draws
    its first byte, then 8 a call; a shorter one is fed to its first call as its first steps'
    input, which keeps the bytes drawn from its last byte on: 9 less its length."""
    engine = Engine(rope_model, slots=2, queue_limit=4)
    engine.warm(every=True)
    calls, decode = [], engine._decode

    def counted(*args):
        calls.append(args[2])  # the slot count
        return decode(*args)

    engine._decode = counted
    engine.start()
    try:
        for prompt, count, expected in (
            (b"KING RICHARD:", 17, 2),
            (b"KING RICHARD:", 18, 3),
            (b"KING RICHARD:", 1, 0),
            (b"KING", 5, 1),
            (b"KING", 13, 2),
            (b"KING", 14, 3),
            (b"x", 8, 1),
        ):
            calls.clear()
            ((data, reason),) = served(engine, [(prompt, count, Sampling(temperature=0.7, seed=count))])
            assert (len(data), reason, len(calls)) == (count, "length", expected), (prompt, count)
            assert data == alone(rope_model, prompt, count, 0.7, count)
    finally:
        engine.stop()


def test_top_k_one_is_greedy_and_a_stop_sequence_ends_its_sequence_before_it(rope_model):
    engine = Engine(rope_model, slots=3, queue_limit=4).start()
    try:
        greedy = alone(rope_model, b"ROMEO:", 40, 0.0, 0)
        (top1, _), (nucleus, _), (whole, _) = served(
            engine,
            [
                (b"ROMEO:", 40, Sampling(temperature=1.5, top_k=1, seed=9)),
                (b"ROMEO:", 40, Sampling(1.5, 0, 1e-6, 9)),
                (b"KING", 40, Sampling(temperature=0.8, seed=4)),
            ],
        )
        assert top1 == greedy and nucleus == greedy  # one byte kept: the likeliest, whatever the draw
        # Its calls sorted for the others' cuts; its own distribution, whole, drew the same.
        assert whole == alone(rope_model, b"KING", 40, 0.8, 4)
        stop = greedy[10:12]
        ((data, reason),) = served(engine, [(b"ROMEO:", 40, Sampling(temperature=0.0))], stop=(stop,))
        assert reason == "stop" and data == greedy[: greedy.find(stop)]
    finally:
        engine.stop()


def test_stop_sequences_end_where_the_first_completes_and_no_byte_past_it_is_handed_on(rope_model):
    """Bytes are handed on as they come, held back only while they may be a stop's start: what
    was handed on is never past where the sequence ends, for stops of several lengths, sharing
    starts, or never met."""
    greedy = alone(rope_model, b"KING", 120, 0.0, 0)
    stop_sets = [
        (greedy[30:37], greedy[50:52]),  # a long one that completes first
        (greedy[60:61], greedy[20:29]),  # a one-byte stop after a long one completes
        (greedy[40:44], greedy[40:46], b"\x00\x01never"),  # two sharing their start, one never met
        (b"\x00never", b"\x01not either"),  # neither is met: the whole length
    ]
    engine = Engine(rope_model, slots=2, queue_limit=8).start()
    try:
        for stops in stop_sets:
            ends = sorted((greedy.find(stop) + len(stop), i) for i, stop in enumerate(stops) if stop in greedy)
            expected = greedy[: greedy.find(stops[ends[0][1]])] if ends else greedy
            ((data, reason),) = served(engine, [(b"KING", 120, Sampling(temperature=0.0))], stop=stops)
            assert (data, reason) == (expected, "stop" if ends else "length"), stops
    finally:
        engine.stop()


def test_learned_positions_serve_to_the_context_s_end_and_the_slot_serves_again():
    """A call runs 8 steps: one that ends a sequence at the last position goes past the
    context (its bytes dropped); the slot's next sequence gets its own bytes all the same."""
    model = build_model(LEARNED, 0)
    engine = Engine(model, slots=2, queue_limit=8).start()
    try:
        requests = [
            (b"ROMEO:", 26, Sampling(temperature=0.9, seed=1)),  # 6 + 26: the whole 32-byte context
            (b"To be, or not", 19, Sampling(temperature=0.0)),  # 13 + 19: the same
            (b"KING", 28, Sampling(temperature=0.7, seed=4)),  # joins a slot that ran past the end
            (b"x", 5, Sampling(temperature=1.1, seed=9)),
        ]
        for (prompt, count, sampling), (data, reason) in zip(requests, served(engine, requests), strict=True):
            assert data == alone(model, prompt, count, sampling.temperature, sampling.seed), prompt
            assert reason == "length"
    finally:
        engine.stop()


def test_the_engine_refuses_what_it_cannot_serve_and_a_full_queue():
    engine = Engine(build_model(LEARNED, 0), slots=1, queue_limit=1)  # not started: nothing leaves the queue
    with pytest.raises(ServingError, match="over this model's context of 32; shorten it"):
        engine.check(b"x" * 33, 1)
    with pytest.raises(ServingError, match=r"learned positions end there\); lower max_tokens to 22"):
        engine.check(b"x" * 10, 23)
    with pytest.raises(ServingError, match="the prompt fills this model's context of 32 bytes.*shorten the prompt"):
        engine.check(b"x" * 32, 1)
    with pytest.raises(ServingError, match="the prompt is empty"):
        engine.check(b"", 1)
    with pytest.raises(ServingError, match=r"seed 2147483648 is outside 0 .. 2\*\*31 - 1"):
        Sampling(seed=2**31)

    def one(prompt: bytes, ended=lambda reason: None) -> Sequence:
        return Sequence(prompt, 2, Sampling(), (), lambda chunk: None, ended)

    # Room for one in the free slot and one in the queue; a third waits for nothing.
    engine.submit([one(b"a")])
    engine.submit([one(b"b")])
    with pytest.raises(ServerFull, match=r"0 of 1 slots busy and 2 sequences waiting \(a queue of 1\)"):
        engine.submit([one(b"c")])
    # More than the server ever holds is no "retry later": it is refused for good.
    with pytest.raises(ServingError, match=r"3 sequences in one request .* \(1 slots and a queue of 1\)"):
        engine.submit([one(b"d"), one(b"e"), one(b"f")])
    # A waiting sequence whose client went away leaves the queue (ended as cancelled) for a new one.
    ended: list[str] = []
    engine.waiting[-1] = gone = one(b"g", ended.append)
    gone.cancel()
    engine.submit([one(b"h")])
    assert ended == ["cancelled"] and [s.prompt for s in engine.waiting] == [b"a", b"h"]


@contextlib.contextmanager
def listening(app):
    """``app`` on uvicorn at a loopback port, as ``bardflow serve`` runs it: its URL."""
    import uvicorn

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    running = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=running.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not running.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        running.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(rope_model):
    """The API over an engine of 8 slots, on a loopback port."""
    engine = Engine(rope_model, slots=8, queue_limit=96)
    engine.warm(every=True)
    engine.start()
    try:
        with listening(create_app(engine, MODEL_ID, max_tokens=2000)) as url:
            yield url, engine
    finally:
        engine.stop()


def test_the_openai_client_completes_whole_and_streamed(server, rope_model):
    from openai import OpenAI

    url, _ = server
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    whole = client.completions.create(model=MODEL_ID, prompt="ROMEO:", max_tokens=60, temperature=0.7, seed=4)
    expected = alone(rope_model, b"ROMEO:", 60, 0.7, 4)
    assert whole.choices[0].text == expected.decode("utf-8", errors="replace")
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (6, 60)
    chunks = list(
        client.completions.create(
            model=MODEL_ID,
            prompt=["ROMEO:", "To be"],
            max_tokens=50,
            temperature=0.7,
            seed=4,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    # Choice i * n + j: prompt i, seed + j; each the bytes that seed gives it alone.
    for index, (prompt, seed) in enumerate([(b"ROMEO:", 4), (b"ROMEO:", 5), (b"To be", 4), (b"To be", 5)]):
        assert texts[index] == alone(rope_model, prompt, 50, 0.7, seed).decode("utf-8", errors="replace")
        assert reasons[index] == "length"
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (22, 200)


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens is 0, which only echo takes"),
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature: Input should be a valid number"),
        ({"prompt": "x", "colour": "red"}, 400, "colour: unknown field"),
        ({"prompt": "x", "logprobs": 6}, 400, "logprobs: Input should be less than or equal to 5"),
        ({"prompt": "x", "logprobs": 1, "stream": True}, 400, "echo and logprobs are answered whole here"),
        ({"prompt": "x" * 30, "logprobs": 1, "max_tokens": 9}, 400, "prompt (30 bytes) + max_tokens (9) is over"),
        ({"prompt": [7, 300]}, 400, "token 300 is not a byte"),
        ({"prompt": "x" * 33}, 400, "the prompt is 33 bytes, over this model's context of 32; shorten it"),
        ({"prompt": "x", "max_tokens": 2001}, 400, "max_tokens is 2001, over this server's 2000"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop: Value error, give at most 4 stop sequences"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "the model 'gpt-4' is not served here"),
        ({"prompt": "x" * (MAX_BODY + 1)}, 413, f"the request body is over {MAX_BODY} bytes"),
        ({"prompt": "x", "max_tokens": "8"}, 400, "max_tokens: Input should be a valid integer"),
        ({"prompt": "x", "max_tokens": True}, 400, "max_tokens: Input should be a valid integer"),
    ],
    ids=[
        "max_tokens",
        "type",
        "unknown",
        "logprobs",
        "streamed-logprobs",
        "scored-context",
        "token",
        "context",
        "limit",
        "stops",
        "model",
        "size",
        "text",
        "bool",
    ],
)
def test_a_bad_request_is_openai_s_error_object_with_its_status(server, body, status, words):
    url, _ = server
    answer = httpx.post(f"{url}/v1/completions", json={"model": MODEL_ID, **body}, timeout=30)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert words in error["message"] and "Traceback" not in answer.text
    assert set(error) == {"message", "type", "param", "code"}


def test_a_stream_event_is_one_line_whatever_its_text():
    from bardflow.serving.api import _event

    text = "a\u2028b\u2029c\u0085d\x0be\x1cf\r\ng"  # every line break str.splitlines knows
    event = _event({"text": text})
    assert event.splitlines() == [event.removesuffix("\n\n"), ""]  # the data line, then the blank one
    assert json.loads(event.removeprefix("data: ")) == {"text": text}


def test_echo_and_logprobs_are_the_model_s_own_evaluation_of_the_bytes(server, rope_model):
    """``echo`` with ``max_tokens`` 0 (what lm-evaluation-harness asks for a log-likelihood):
    the prompt's bytes with their log-probabilities, which sum to the training evaluation's
    loss of those bytes; with ``logprobs`` the drawn bytes' too, in OpenAI's shape."""
    from bardflow.model.training.step import next_byte_loss

    url, _ = server
    text = "JULIET:\nAy, m\u00ea Romeo, no"  # 27 bytes, one character of two
    data = text.encode()
    body = {"model": MODEL_ID, "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 2}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    scored = choice["logprobs"]
    assert scored["tokens"][:3] == ["J", "U", "L"] and "bytes:\\xc3" in scored["tokens"]
    assert len(scored["tokens"]) == len(scored["token_logprobs"]) == len(scored["text_offset"]) == len(data)
    assert scored["token_logprobs"][0] is None and scored["top_logprobs"][0] is None
    own = float(nnx.jit(next_byte_loss)(rope_model, jax.numpy.asarray([list(data)])))
    assert abs(sum(scored["token_logprobs"][1:]) + own * (len(data) - 1)) < 1e-4
    # Each byte's character's place in the text: the two bytes of "\u00ea" share one.
    at = data.index("\u00ea".encode())
    assert scored["text_offset"][at] == scored["text_offset"][at + 1] == text.index("\u00ea")
    assert scored["text_offset"][at + 2] == text.index("\u00ea") + 1
    rows = zip(scored["token_logprobs"][1:], scored["tokens"][1:], scored["top_logprobs"][1:], strict=True)
    for chosen, token, top in rows:
        assert len(top) <= 3 and top[token] == chosen and chosen <= max(top.values())
    # Drawn bytes, greedy, asked as the bytes' values: each the likeliest there, the text the
    # text's own, and their log-probabilities those of the echoed whole.
    prompt = list(b"ROMEO:")
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1}
    drawn = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert drawn["text"] == alone(rope_model, b"ROMEO:", 12, 0.0, 0).decode("utf-8", errors="replace")
    assert len(drawn["logprobs"]["tokens"]) == 12
    for chosen, top in zip(drawn["logprobs"]["token_logprobs"], drawn["logprobs"]["top_logprobs"], strict=True):
        assert chosen >= max(top.values()) - 1e-4
    # A token names its byte: the character, or "bytes:\\xNN".
    generated = [ord(t) if len(t) == 1 else int(t.removeprefix("bytes:\\x"), 16) for t in drawn["logprobs"]["tokens"]]
    assert bytes(generated) == alone(rope_model, b"ROMEO:", 12, 0.0, 0)
    whole = {"model": MODEL_ID, "prompt": prompt + generated, "max_tokens": 0, "echo": True, "logprobs": 0}
    echoed = httpx.post(f"{url}/v1/completions", json=whole, timeout=60).json()["choices"][0]["logprobs"]
    np.testing.assert_allclose(echoed["token_logprobs"][6:], drawn["logprobs"]["token_logprobs"], atol=1e-5)


def test_the_tokenizer_endpoints_evaluation_tools_ask_for(server):
    """vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``: a byte model's tokens are
    the text's bytes, and it has no special tokens."""
    url, _ = server
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "R\u00f4", "add_special_tokens": False}, timeout=30).json()
    assert tokens == {"tokens": [82, 0xC3, 0xB4], "count": 3, "max_model_len": 33}
    assert httpx.post(f"{url}/detokenize", json={"tokens": [82, 0xC3, 0xB4]}, timeout=30).json() == {
        "prompt": "R\u00f4"
    }
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [256]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens.0"
    info = httpx.get(f"{url}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] is None and info["model_max_length"] == 33 and info["vocab_size"] == 256


def test_lm_evaluation_harness_runs_against_the_server_as_a_client(server, rope_model, tmp_path):
    """``lm_eval --model local-completions`` over the repository's own tasks (``serving/
    eval_tasks.py``): its log-likelihood task's accuracy is the one the model's own scores
    give each document, and its generation task runs to the end."""
    import subprocess
    import sys

    from bardflow.serving.eval_tasks import write_tasks
    from bardflow.serving.scoring import Scorer
    from tests.helpers import play_text

    url, engine = server
    data = write_tasks(play_text(200_000, seed=5), tmp_path / "tasks", context=33, count=12)[0]
    args = f"model={MODEL_ID},base_url={url}/v1/completions,tokenizer_backend=remote,max_length=33,num_concurrent=2"
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args]
    command += ["--tasks", "next_line,continue_line", "--include_path", str(tmp_path / "tasks")]
    command += ["--output_path", str(tmp_path / "results"), "--seed", "0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(next((tmp_path / "results").rglob("results_*.json")).read_text())["results"]
    scorer = Scorer(engine.graphdef, engine.params, engine.window)
    right, rows = 0, [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == 12
    for row in rows:
        context = row["context"].encode()
        sums = [float(scorer.score(context + c.encode()).logprobs[len(context) - 1 :].sum()) for c in row["choices"]]
        right += int(np.argmax(sums)) == row["answer"]
    assert results["next_line"]["acc,none"] == pytest.approx(right / len(rows))
    assert 0.0 <= results["continue_line"]["exact_match,none"] <= 1.0


def test_raw_http_errors_not_json_and_no_such_endpoint(server):
    url, _ = server
    as_json = {"Content-Type": "application/json"}
    answer = httpx.post(f"{url}/v1/completions", content=b"{not json", headers=as_json, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["message"] == "the request body is not JSON"
    # JSON, but not to be read: a field twice (which would take the last silently), a number
    # longer than any field takes (Python refuses to read one of over 4,300 digits).
    for raw, words in (
        (f'{{"model": "{MODEL_ID}", "prompt": "x", "max_tokens": 2, "max_tokens": 9}}', "max_tokens is given twice"),
        (f'{{"model": "{MODEL_ID}", "prompt": "x", "max_tokens": {"9" * 5000}}}', "has 5000 digits"),
    ):
        answer = httpx.post(f"{url}/v1/completions", content=raw.encode(), headers=as_json, timeout=30)
        assert answer.status_code == 400 and words in answer.json()["error"]["message"], answer.text
    # Half of a surrogate pair, which JSON can escape and UTF-8 cannot hold: a 400 naming it.
    for field in ('"prompt": "RO\\ud800MEO"', '"prompt": "x", "stop": ["\\udc00"]'):
        body = f'{{"model": "{MODEL_ID}", {field}, "max_tokens": 8}}'.encode()
        answer = httpx.post(f"{url}/v1/completions", content=body, headers=as_json, timeout=30)
        assert answer.status_code == 400 and "lone surrogate" in answer.json()["error"]["message"], answer.text
    assert httpx.get(f"{url}/v1/chat", timeout=30).status_code == 404
    assert httpx.get(f"{url}/v1/completions", timeout=30).json()["error"]["message"].startswith("GET is not allowed")


def test_a_key_a_host_and_json_are_asked_of_every_request_but_the_health_probe(server):
    """``--api-key``: no key, or another, is a 401; a Host this server does not answer for (a
    rebound name) a 421; a body not sent as JSON (a page's form or text/plain post) a 415; no
    CORS header lets another site read an answer. Each OpenAI's error object."""
    _, engine = server
    key = "k" * 24
    with listening(create_app(engine, MODEL_ID, max_tokens=2000, api_key=key, hosts=("bard.example",))) as url:
        port = url.rsplit(":", 1)[1]
        keyed = {"Authorization": f"Bearer {key}"}
        body = {"model": MODEL_ID, "prompt": "ROMEO:", "max_tokens": 4}

        def error(answer, status):
            assert answer.status_code == status, answer.text
            assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
            assert not any(name.lower().startswith("access-control") for name in answer.headers)
            return answer.json()["error"]["message"]

        assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # a probe needs no key
        assert "Authorization: Bearer KEY" in error(httpx.get(f"{url}/v1/models", timeout=30), 401)
        wrong = {"Authorization": "Bearer " + "x" * 24}
        error(httpx.post(f"{url}/v1/completions", json=body, headers=wrong, timeout=30), 401)
        whole = httpx.post(f"{url}/v1/completions", json=body, headers=keyed, timeout=30)
        assert whole.status_code == 200 and len(whole.json()["choices"][0]["text"].encode()) <= 4 * 3
        rebound = {**keyed, "Host": "attacker.example", "Origin": "http://attacker.example"}
        assert "--allow-host" in error(httpx.post(f"{url}/v1/completions", json=body, headers=rebound, timeout=30), 421)
        allowed = {**keyed, "Host": f"bard.example:{port}"}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=allowed, timeout=30).status_code == 200
        form = {**keyed, "Content-Type": "text/plain"}
        text = error(httpx.post(f"{url}/v1/completions", content=json.dumps(body), headers=form, timeout=30), 415)
        assert "'text/plain'" in text


@contextlib.contextmanager
def timed_server(app, protocol, **config):
    """``app`` on uvicorn at a loopback port with the connection class ``protocol`` (a
    ``TimedH11Protocol`` with shorter limits); the port."""
    import uvicorn

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    running = uvicorn.Server(
        uvicorn.Config(app, log_config=None, log_level="warning", http=protocol, timeout_graceful_shutdown=1, **config)
    )
    thread = threading.Thread(target=running.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        while not running.started:
            assert thread.is_alive()
            time.sleep(0.02)
        yield listener.getsockname()[1]
    finally:
        running.should_exit = True
        thread.join(timeout=10)


def test_1100_slow_clients_cannot_keep_a_real_request_out(server):
    """1,100 connections that send nothing, or a byte of a header now and then, against the cap
    of open connections ``bardflow serve`` sets: past it each new one closes the one waiting
    longest, the rest are closed at the request deadline (1 s here, 10 in ``bardflow serve``),
    and a real request is answered within 2 s all the while."""
    from bardflow.serving.server import MAX_CONNECTIONS, TimedH11Protocol

    class Quick(TimedH11Protocol):
        request_timeout_s = 1.0

    _, engine = server
    assert Quick.max_connections == MAX_CONNECTIONS
    with timed_server(create_app(engine, MODEL_ID), Quick) as port:
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(880)]
        trickling = [socket.create_connection(("127.0.0.1", port)) for _ in range(220)]
        opened = time.monotonic()
        body = {"model": MODEL_ID, "prompt": "ROMEO:", "max_tokens": 4}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200 and time.monotonic() - opened < 2
        header = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10\r\n\r\n"
        for at in range(12):  # a byte every 0.25 s: the deadline is the request's, not the last byte's
            for sock in trickling:
                with contextlib.suppress(OSError):
                    sock.sendall(header[at : at + 1])
            time.sleep(0.25)
        closed = 0
        for sock in silent + trickling:
            sock.settimeout(5)
            try:
                closed += sock.recv(1024) == b""  # the server closed it
            except ConnectionResetError:
                closed += 1  # or reset it: it had sent bytes the server never read
            sock.close()
        assert closed == 1100 and time.monotonic() - opened < 15


def test_past_the_cap_of_connections_all_answering_a_new_one_gets_503(server):
    from bardflow.serving.server import TimedH11Protocol

    class Two(TimedH11Protocol):
        max_connections = 2

    _, engine = server
    with timed_server(create_app(engine, MODEL_ID, max_tokens=10**6), Two) as port:
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": MODEL_ID, "prompt": "ROMEO:", "max_tokens": 10**6, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=30) as one, httpx.stream("POST", url, json=body) as two:
            assert one.status_code == two.status_code == 200
            third = httpx.post(url, json={**body, "stream": False, "max_tokens": 2}, timeout=30)
            assert third.status_code == 503 and third.headers["retry-after"] == "1"
            assert "as many connections open" in third.json()["error"]["message"]
        deadline = time.monotonic() + 10
        while engine.load()["busy"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.post(url, json={**body, "stream": False, "max_tokens": 2}, timeout=30).status_code == 200


def small_buffers(**limits):
    """A ``TimedH11Protocol`` (with ``limits`` for its class attributes) whose sockets send a
    few KiB before their buffers are full: a client that reads nothing stalls it at once."""
    from bardflow.serving.server import TimedH11Protocol

    class SmallBuffers(TimedH11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            transport.set_write_buffer_limits(high=4096)
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    for name, value in limits.items():
        setattr(SmallBuffers, name, value)
    return SmallBuffers


def unread_stream(address, engine: Engine) -> socket.socket:
    """A client that asks for a stream of a million bytes and reads nothing, once it is served."""
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(address)
    body = json.dumps({"model": MODEL_ID, "prompt": "ROMEO:", "max_tokens": 10**6, "stream": True}).encode()
    client.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    deadline = time.monotonic() + 30
    while not engine.load()["busy"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return client


def test_a_client_that_reads_nothing_is_cut_and_its_slot_freed(server):
    """A stream whose client reads nothing (its socket's buffers full) is cut after the stall
    limit (1 s here, 30 in ``bardflow serve``), and its slot is free again."""
    _, engine = server
    with timed_server(create_app(engine, MODEL_ID, max_tokens=10**6), small_buffers(write_stall_s=1.0)) as port:
        client = unread_stream(("127.0.0.1", port), engine)
        deadline = time.monotonic() + 30
        while engine.load()["busy"]:  # a million bytes would take minutes: only the cut frees it
            assert time.monotonic() < deadline, engine.load()
            time.sleep(0.05)
        client.settimeout(5)
        read = bytearray()
        with contextlib.suppress(ConnectionResetError):
            while chunk := client.recv(1 << 16):  # what was sent before the cut, then the end
                read += chunk
        client.close()
        assert read.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in read


def test_a_request_that_fails_unforeseen_is_a_500_error_object_and_one_log_line(caplog):
    from bardflow.serving.guard import Guard

    async def failing(scope, receive, send):
        raise RuntimeError("something no one foresaw")

    async def ask():
        transport = httpx.ASGITransport(app=Guard(failing))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.get("/v1/models")

    answer = asyncio.run(ask())
    assert answer.status_code == 500 and answer.json()["error"]["type"] == "server_error"
    assert "Traceback" not in answer.text and "Traceback" not in caplog.text
    assert "GET /v1/models failed: RuntimeError: something no one foresaw" in caplog.text


def test_64_concurrent_streams_some_hanging_up_and_the_server_keeps_answering(server, rope_model):
    """64 streaming clients at once over 8 slots: every eighth hangs up after its first chunk;
    every other stream is the bytes its seed gives alone; then no slot or queue entry is left."""
    url, engine = server
    count, length = 64, 48

    async def client(http: httpx.AsyncClient, i: int) -> tuple[int, str | None]:
        body = {"model": MODEL_ID, "prompt": f"ROMEO {i}:", "max_tokens": length, "temperature": 0.9}
        body |= {"seed": i, "stream": True}
        text, reason = "", None
        async with http.stream("POST", f"{url}/v1/completions", json=body) as answer:
            assert answer.status_code == 200
            async for line in answer.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reason = choice["finish_reason"] or reason
                if i % 8 == 0:
                    return i, None  # hangs up midway
        return i, text if reason == "length" else f"ended {reason}"

    async def everyone():
        limits = httpx.Limits(max_connections=count)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(client(http, i) for i in range(count)))

    started = time.monotonic()
    results = asyncio.run(everyone())
    assert time.monotonic() - started < 120
    for i, text in results:
        if i % 8:
            prompt = f"ROMEO {i}:".encode()
            assert text == alone(rope_model, prompt, length, 0.9, i).decode("utf-8", errors="replace"), i
    deadline = time.monotonic() + 10
    while engine.load()["busy"] or engine.load()["waiting"]:  # the hung-up ones leave at their next step
        assert time.monotonic() < deadline, engine.load()
        time.sleep(0.05)
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"


def test_a_client_that_gives_up_on_a_whole_response_frees_its_slot_at_once(server):
    url, engine = server
    body = {"model": MODEL_ID, "prompt": ["ROMEO:"] * 8, "max_tokens": 2000, "n": 8, "temperature": 1.0}
    # 64 sequences of 2,000 bytes: about 9 s of work on a 2-core CPU.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.3)
    gave_up = time.monotonic()
    while engine.load()["busy"] or engine.load()["waiting"]:
        assert time.monotonic() - gave_up < 3.0, engine.load()
        time.sleep(0.02)


def test_a_full_server_answers_503_with_retry_after(rope_model):
    """``--queue 0``: a request is served while a slot is free, 503 while none is; one that no
    slot and queue could ever hold is a 400, not a 503 a client would retry for ever."""
    engine = Engine(rope_model, slots=1, queue_limit=0).start()
    body = {"model": MODEL_ID, "prompt": "x", "max_tokens": 2}
    try:
        with listening(create_app(engine, MODEL_ID)) as url:
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200  # idle: served
            # A long stream holds the one slot.
            with httpx.stream(
                "POST", f"{url}/v1/completions", json={**body, "max_tokens": 2000, "stream": True}
            ) as busy:
                next(busy.iter_lines())
                full = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert full.status_code == 503 and full.headers["Retry-After"] == "1"
            assert full.json()["error"]["message"].startswith("the server is full: 1 of 1 slots busy")
            never = httpx.post(f"{url}/v1/completions", json={**body, "n": 2}, timeout=30)
            assert never.status_code == 400 and "more than this server ever holds" in never.json()["error"]["message"]
            engine.stop()  # while the server's loop still hears the stream's end
    finally:
        engine.stop()


def stopping_server(rope_model, grace_s: float, **config):
    """``bardflow serve``'s server (``StoppingServer``, whose stop is what Ctrl-C or SIGTERM
    calls) over an engine of 2 slots at a loopback port, once it says it listens: requests
    answer from then on. (The server, its thread, its address, the engine.)"""
    import uvicorn

    from bardflow.serving.server import StoppingServer

    engine = Engine(rope_model, slots=2, queue_limit=4)
    engine.warm(every=True)
    engine.start()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    app = create_app(engine, MODEL_ID, max_tokens=10**6)
    listening = threading.Event()
    running = StoppingServer(
        uvicorn.Config(app, log_config=None, log_level="warning", **config), engine, listening.set, grace_s=grace_s
    )
    thread = threading.Thread(target=running.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    assert listening.wait(timeout=30)
    return running, thread, listener.getsockname(), engine


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_ctrl_c_while_compiling_stops_serve_even_where_python_drops_the_signal_s_exception(rope_model, capsys):
    """Ctrl-C while the server's programs compile ends ``bardflow serve`` with its line and 130,
    serving nothing, also when the signal lands in a garbage-collection callback (JAX has one),
    where Python prints the exception and drops it: the command then stops after the program
    under way, where it used to serve on and ignore the Ctrl-C."""
    import gc
    import signal

    from bardflow.serving.limits import ServeSettings
    from bardflow.serving.server import serve

    def signal_in_a_collection(phase: str, info: dict) -> None:
        gc.callbacks.remove(signal_in_a_collection)
        os.kill(os.getpid(), signal.SIGINT)  # its handler runs at the next instruction: in here
        for _ in range(1000):
            pass

    told: list[int] = []

    @contextlib.contextmanager
    def compiling(total: int):
        def compiled(done: int) -> None:
            told.append(done)
            if done == 1:
                gc.callbacks.append(signal_in_a_collection)
                gc.collect()
                assert signal_in_a_collection not in gc.callbacks  # it ran, and its exception was dropped

        yield compiled

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    settings = ServeSettings(port=listener.getsockname()[1], slots=2, queue=4)
    before = signal.getsignal(signal.SIGINT)
    assert serve(rope_model, MODEL_ID, settings, compiling, listener) == 128 + signal.SIGINT
    assert told == [1]  # no program after the one under way
    said = capsys.readouterr()
    assert "bardflow: stopped by SIGINT while compiling the server's programs" in said.err
    assert "serving" not in said.out
    assert signal.getsignal(signal.SIGINT) is before  # the handler before is back


def test_a_stop_just_before_uvicorn_takes_the_signals_stops_the_server(rope_model, capsys, monkeypatch):
    """SIGTERM after the programs compiled and before uvicorn has put in its own handlers (the
    moment its event loop starts) stops the server as one during serving does: the command ends
    with its closing line, where the signal used to be ignored and the server served on."""
    import signal

    from bardflow.serving import server as serving_server
    from bardflow.serving.limits import ServeSettings

    uvicorn_run = serving_server.StoppingServer.run

    def signalled_then_run(self, sockets=None):
        os.kill(os.getpid(), signal.SIGTERM)
        return uvicorn_run(self, sockets)

    monkeypatch.setattr(serving_server.StoppingServer, "run", signalled_then_run)
    # Were it ignored, this would stop the server, later than the assertion below allows.
    watchdog = threading.Timer(30, os.kill, (os.getpid(), signal.SIGINT))
    watchdog.start()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    settings = ServeSettings(port=listener.getsockname()[1], slots=2, queue=4)
    before = signal.getsignal(signal.SIGTERM)
    started = time.monotonic()
    try:
        assert serving_server.serve(rope_model, MODEL_ID, settings, listener=listener) == 0
    finally:
        watchdog.cancel()
        # The faster programs compile on after the server stopped (`bardflow serve` exits past
        # them; an interpreter that ends while XLA compiles on a daemon thread aborts): here
        # they end before the test does.
        for thread in threading.enumerate():
            if thread.name in ("bardflow-lower", "bardflow-compile"):
                thread.join(timeout=120)
    assert time.monotonic() - started < 30
    assert capsys.readouterr().err.rstrip().endswith("bardflow: the server stopped")
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("second", [False, True], ids=["one stop", "a second stop"])
def test_a_stop_lets_streams_run_their_grace_then_ends_them_with_abort_and_done(rope_model, second, capsys):
    """What Ctrl-C or SIGTERM does to ``bardflow serve`` (``handle_exit`` is what uvicorn's
    signal handler calls), on a server asked at once when it says it listens: the stream in
    flight goes on for the grace, then ends with the finish reason ``abort`` and ``[DONE]``,
    and the server stops well before uvicorn would cancel it. A second stop (Ctrl-C again)
    ends it at once, the same way, where uvicorn's forced exit cut it mid-chunk."""
    import signal

    running, thread, address, _ = stopping_server(rope_model, 60 if second else 0.5, timeout_graceful_shutdown=60)
    body = {"model": MODEL_ID, "prompt": "ROMEO:", "max_tokens": 10**6, "stream": True}
    lines: list[str] = []
    url = f"http://127.0.0.1:{address[1]}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=30) as answer:
        for line in answer.iter_lines():
            lines.append(line)
            if len(lines) == 10:  # streaming: now stop the server
                stopped = time.monotonic()
                running.handle_exit(signal.SIGINT if second else signal.SIGTERM, None)
            if second and len(lines) == 20:
                running.handle_exit(signal.SIGINT, None)
    thread.join(timeout=30)
    assert not thread.is_alive() and time.monotonic() - stopped < 10 and not running.force_exit
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert (
        events[-1]["choices"][0]["finish_reason"] == "abort" and [line for line in lines if line][-1] == "data: [DONE]"
    )
    assert all(event["choices"][0]["finish_reason"] is None for event in events[:-1])
    grace = "60" if second else "0.5"  # said at once, where the wait was silent
    assert f"bardflow: stopping: 1 sequence in flight gets up to {grace} s to finish" in capsys.readouterr().err


def test_a_stop_with_a_client_that_reads_nothing_ends_at_the_grace_not_uvicorn_s_limit(rope_model):
    """SIGTERM while a stream's client reads nothing: the stream is ended at the grace and its
    connection cut a second later, so the server stops long before uvicorn's limit would
    cancel the task (its "timeout graceful shutdown exceeded" and a traceback)."""
    import signal

    config = {"http": small_buffers(shutdown_stall_s=1.0), "timeout_graceful_shutdown": 20}
    running, thread, address, engine = stopping_server(rope_model, 0.5, **config)
    client = unread_stream(address, engine)
    time.sleep(1.0)  # the buffers fill: the server's writes wait on a client that reads nothing
    stopped = time.monotonic()
    running.handle_exit(signal.SIGTERM, None)
    thread.join(timeout=30)
    took = time.monotonic() - stopped
    client.close()
    assert not thread.is_alive() and took < 5 and not running.force_exit, took


def test_serve_refuses_in_one_line_before_loading_anything(tmp_path, capsys):
    from bardflow.cli.main import main

    store = tmp_path / "store"
    store.mkdir()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    assert main(["serve", "zzz", "--store", str(store), "--port", str(free)]) == 1
    line = capsys.readouterr().err.strip()
    assert line == (
        f"bardflow: error: no checkpoint or trained version in {store} has a key starting 'zzz'; "
        "`bardflow artifacts checkpoint` lists them (checkpoints: none)"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", "zzz", "--store", str(store), "--port", str(port)]) == 1
        assert capsys.readouterr().err.strip().startswith(f"bardflow: error: cannot listen on 127.0.0.1:{port} (")
    assert main(["serve", "zzz", "--slots", "0"]) == 2
    assert capsys.readouterr().err.strip() == "bardflow: error: --slots must be 1 to 1024"
    # Reachable from other machines: a key, or a word that says anyone may call it.
    assert main(["serve", "zzz", "--store", str(store), "--host", "0.0.0.0", "--port", str(free)]) == 2
    assert capsys.readouterr().err.strip() == (
        "bardflow: error: --host 0.0.0.0 is reachable from other machines: give an API key (--api-key-file "
        "FILE, BARDFLOW_API_KEY or --api-key KEY), or --insecure-no-key to let anyone call it"
    )
    assert main(["serve", "", "--store", str(store)]) == 2
    assert capsys.readouterr().err.strip().startswith("bardflow: error: KEY is empty; give a checkpoint")
    assert main(["serve", "zzz", "--store", str(store), "--host", "256.1.1.1", "--insecure-no-key"]) == 1
    assert "--host 256.1.1.1 is not an address or a name this machine resolves" in capsys.readouterr().err
    assert main(["serve", "zzz", "--api-key", "short"]) == 2
    assert "the API key must be at least 16 printable characters" in capsys.readouterr().err
    assert main(["serve", "zzz", "--api-key-file", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.strip().startswith(f"bardflow: error: --api-key-file {tmp_path / 'none'}: ")
    assert main(["serve", "zzz", "--store", str(store), "--kernels"]) == 2
    assert capsys.readouterr().err.strip() == (
        "bardflow: error: --kernels runs Pallas TPU kernels, and JAX here runs on cpu (they would run in an "
        "interpreter, slowly); drop --kernels"
    )


def test_a_sequence_counts_the_tokens_its_text_shows_where_a_stop_cuts_one():
    """The usage counts tokens: those whose bytes the text holds, one a stop cuts into among
    them, none it cuts off whole."""
    sequence = Sequence(b"R", 8, Sampling(), (b"X",), lambda chunk: None, lambda reason: None)
    sequence.generated, sequence.drawn_ids, sequence.token_ends = bytearray(b"abcdeXghi"), [7, 8, 9], [3, 5, 9]
    assert (sequence.drawn, sequence.tokens(), sequence.shown_ids()) == (3, 3, [7, 8, 9])
    for cut, count in ((5, 2), (4, 2), (3, 1), (1, 1), (0, 0)):
        del sequence.generated[cut:]
        assert sequence.tokens() == count, cut
