"""``python -m bench.serve [--presets codelab,gpt2] [--streams 1,8,64] [--slots 64]``: serving
throughput and time to first byte on this machine's first device.

For each preset (randomly initialised: speed does not depend on the weights), the
continuous-batching engine that ``bardflow serve`` runs (``serving/engine.py``, one server of
``--slots`` slots) is given 1, 8 and 64 concurrent sequences of ``--new-bytes`` each (after one
untimed round of the same): total bytes/s, and each one's time to its first byte; then, with 8
sequences decoding, a request with a 256-byte prompt, timed to its first byte. Beside them the
sampler alone (``generate_batch``) at batch 1, and on an accelerator with a known bandwidth the
HBM bound of one decode step (every weight and each slot's cache read once). The engine is measured
in-process, as the HTTP layer calls it: the TPU host opens no socket, and the HTTP layer's
own cost is the same on every device (``tests/test_serving.py`` drives it over loopback).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from bench.report import RESULTS, machine, write_report
from bench.sampler import SMOKE, bandwidth, step_bytes


def concurrent(engine, prompts: list[bytes], new_bytes: int, seed: int = 0) -> dict:
    """Every prompt as a sequence at once: total bytes/s and the times to first byte."""
    from bardflow.serving.engine import Sampling, Sequence

    left = threading.Semaphore(0)
    sequences = [
        Sequence(
            prompt,
            new_bytes,
            Sampling(temperature=0.8, seed=seed + i),
            (),
            lambda chunk: None,
            lambda r: left.release(),
        )
        for i, prompt in enumerate(prompts)
    ]
    started = time.perf_counter()
    engine.submit(sequences)
    for _ in sequences:
        left.acquire()
    seconds = time.perf_counter() - started
    firsts = [s.first_byte_s * 1000 for s in sequences if s.first_byte_s is not None]
    return {
        "streams": len(prompts),
        "bytes_per_s": round(len(prompts) * new_bytes / seconds, 1),
        "ttfb_ms_median": round(statistics.median(firsts), 1),
        "ttfb_ms_max": round(max(firsts), 1),
        "seconds": round(seconds, 3),
    }


def first_byte_beside(engine, running: int, prompt_bytes: int, new_bytes: int, rounds: int = 5) -> dict:
    """A request with a ``prompt_bytes`` prompt, timed to its first byte while ``running``
    other sequences decode (median of ``rounds``)."""
    from bardflow.serving.engine import Sampling, Sequence

    times = []
    for r in range(rounds):
        busy = threading.Semaphore(0)
        background = [
            Sequence(
                b"ROMEO:",
                new_bytes,
                Sampling(0.8, seed=r * 100 + i),
                (),
                lambda c: None,
                lambda x, busy=busy: busy.release(),
            )
            for i in range(running)
        ]
        engine.submit(background)
        time.sleep(0.2)  # they are decoding
        arrived = threading.Event()
        probe = Sequence(
            b"A" * prompt_bytes, 4, Sampling(0.0), (), lambda c: None, lambda x, arrived=arrived: arrived.set()
        )
        engine.submit([probe])
        arrived.wait(timeout=300)
        if probe.first_byte_s is not None:
            times.append(probe.first_byte_s * 1000)
        for sequence in background:
            sequence.cancel()
        for _ in background:
            busy.acquire(timeout=300)
    return {"running": running, "prompt_bytes": prompt_bytes, "ttfb_ms_median": round(statistics.median(times), 1)}


def first_answer(engine, preset: str, prompt: bytes, new_bytes: int, started: float, ready_s: float):
    """A first answer while the faster programs compile (what a user waits for after the
    start), then every program compiled: the answer's figures, and the seconds to each."""
    first = concurrent(engine, [prompt], new_bytes, seed=999)
    first_answer_s = time.perf_counter() - started
    print(f"{preset}: the engine ready in {ready_s:.1f} s, a first answer at {first_answer_s:.1f} s", flush=True)
    engine.wait_compiled()
    compile_s = time.perf_counter() - started
    print(f"{preset}: all {engine.programs()} programs compiled at {compile_s:.1f} s", flush=True)
    return first, first_answer_s, compile_s


def measure(
    preset: str,
    streams: list[int],
    slots: int,
    new_bytes: int,
    smoke: bool,
    kernels: bool = False,
    cache: str | None = None,
) -> dict:
    import jax

    from bardflow.config.settings import build_config
    from bardflow.model.inference.sampling import generate_batch
    from bardflow.model.network.transformer import build_model
    from bardflow.serving.engine import Engine

    cfg = build_config(preset, SMOKE if smoke else {})
    model = build_model(cfg.model, 0)
    window = cfg.model.max_seq_len
    # Learned positions end at the context: prompt and bytes must fit it.
    new_bytes = new_bytes if model.rotary else min(new_bytes, window - 16)
    prompts = [f"ROMEO {i}:".encode()[:8] for i in range(max(streams))]
    generate_batch(model, "ROMEO:", new_bytes, 0.8, [0], window)  # compiled once
    started = time.perf_counter()
    generate_batch(model, "ROMEO:", new_bytes, 0.8, [1], window)
    alone = new_bytes / (time.perf_counter() - started)
    print(f"{preset}: the sampler alone at batch 1: {alone:,.1f} bytes/s; compiling the engine", flush=True)
    engine = Engine(model, slots=slots, queue_limit=4 * max(streams) + slots, kernels=kernels, cache_dtype=cache)
    started = time.perf_counter()
    ready_s = engine.warm()
    engine.start()
    try:
        first, first_answer_s, compile_s = first_answer(engine, preset, prompts[0], new_bytes, started, ready_s)
        rows = []
        for count in streams:  # each once untimed first: a program's first runs after compiling are slower
            concurrent(engine, prompts[:count], new_bytes, seed=1000)
            rows.append(concurrent(engine, prompts[:count], new_bytes))
        prompt = min(256, window - 8)
        beside = first_byte_beside(engine, min(8, slots - 1), prompt, new_bytes)
    finally:
        engine.stop()
    one = next((row["bytes_per_s"] for row in rows if row["streams"] == 1), None)
    for row in rows:
        row["over_one_stream"] = round(row["bytes_per_s"] / one, 2) if one else None
        row["over_sampler_alone"] = round(row["bytes_per_s"] / alone, 2)
    found = {
        "preset": preset,
        "slots": slots,
        "new_bytes": new_bytes,
        "ready_s": round(ready_s, 1),  # the programs that serve any request compiled
        "first_answer_s": round(first_answer_s, 1),  # and one request of new_bytes answered
        "first_answer_bytes_per_s": first["bytes_per_s"],  # while the faster ones compiled
        "compile_s": round(compile_s, 1),  # every program compiled
        "sampler_alone_batch_1_bytes_per_s": round(alone, 1),
        "streams": rows,
        "first_byte_beside_running": beside,
    }
    cache_type = engine.caches[0].keys.dtype
    found["engine"] = {"kernels": engine.kernels, "cache": str(cache_type), "precision": engine.precision}
    rate = bandwidth(jax.devices()[0].device_kind)
    if rate:  # one decode step reads every weight once and each slot's cache as far as it is filled
        found["decode_step_bound_bytes_per_s"] = round(
            slots * rate / step_bytes(model, slots, 8, new_bytes, window, 4, cache_type.itemsize), 1
        )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="codelab,gpt2")
    parser.add_argument("--streams", default="1,8,64")
    parser.add_argument("--slots", type=int, default=64, help="the server's slots (default 64)")
    parser.add_argument("--new-bytes", type=int, default=200)
    parser.add_argument("--kernels", action="store_true", help="the engine's Pallas decode kernels (RowsCache)")
    parser.add_argument("--cache", choices=["float32", "bfloat16"], help="the cache's type (default: the weights')")
    parser.add_argument("--smoke", action="store_true", help="one small layer: every part runs, on a CPU too")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    presets = {}
    for preset in args.presets.split(","):
        presets[preset] = measure(preset, streams, args.slots, args.new_bytes, args.smoke, args.kernels, args.cache)
        for row in presets[preset]["streams"]:
            print(
                f"{preset} {row['streams']:>3} streams: {row['bytes_per_s']:>10,.0f} bytes/s "
                f"({row['over_one_stream']}x one stream, {row['over_sampler_alone']}x the sampler alone), "
                f"first byte {row['ttfb_ms_median']} ms median",
                flush=True,
            )
        beside = presets[preset]["first_byte_beside_running"]
        print(
            f"{preset} a {beside['prompt_bytes']}-byte prompt beside {beside['running']} streams: "
            f"first byte in {beside['ttfb_ms_median']} ms",
            flush=True,
        )
    flat = {}
    for preset, found in presets.items():
        flat[f"{preset}.ready_s"] = found["ready_s"]  # the programs that serve any request
        flat[f"{preset}.compile_s"] = found["compile_s"]  # every program
        flat[f"{preset}.sampler_alone_bytes_per_s"] = found["sampler_alone_batch_1_bytes_per_s"]
        for row in found["streams"]:
            flat[f"{preset}.streams_{row['streams']}.bytes_per_s"] = row["bytes_per_s"]
        beside = found["first_byte_beside_running"]
        flat[f"{preset}.ttfb_ms_beside_{beside['running']}"] = beside["ttfb_ms_median"]
    report = {"machine": machine(), "presets": presets}
    write_report(report, flat, args.out, "serve")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
