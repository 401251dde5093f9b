"""``python -m bardflow.serving.eval_tasks --corpus FILE --out DIR``: two lm-evaluation-harness
tasks made from a corpus's held-out text (its last tenth, the validation split's bytes, from
the first line that starts there), written as JSON lines and YAML task files into ``DIR``, to
run against ``bardflow serve`` as a client does (docs/serving.md):

  next_line      log-likelihood: which of four lines follows a line of the play (the true
                 one and three others drawn from the held-out text); metric ``acc``
  continue_line  generation: a line, then the model's next line up to the line's end (at
                 most 64 bytes or half the context), greedy; metric ``exact_match``
                 against the true next line

Lines are kept where a line and its longest choice fit ``--context`` bytes (what the server's
``/tokenizer_info`` calls ``model_max_length``), so that no context is cut; ``--seed`` draws the
wrong choices; ``--count`` bounds the documents per task.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HELD_OUT_FROM = 0.9  # data.train_fraction's default: the last tenth validates
TASKS = ("next_line", "continue_line")


def held_out_lines(corpus: bytes, train_fraction: float = HELD_OUT_FROM) -> list[str]:
    """The non-empty lines of the corpus's held-out part, from the first line that starts in it."""
    start = corpus.find(b"\n", int(len(corpus) * train_fraction)) + 1
    text = corpus[start:].decode("utf-8", errors="replace")
    return [line for line in text.split("\n") if line.strip()]


def documents(lines: list[str], context: int, count: int, seed: int) -> list[dict]:
    """Pairs of following lines where the question and any answer fit ``context`` bytes; each
    with three wrong next lines (other lines of the held-out text that fit too) and the true
    one's place."""
    rng, distinct = random.Random(seed), sorted(set(lines))
    found = []
    for line, following in zip(lines, lines[1:], strict=False):
        question = line + "\n"
        room = context - len(question.encode()) - 1  # the byte a log-likelihood request draws
        others = [other for other in distinct if other != following and len(other.encode()) <= room]
        if len(following.encode()) > room or len(others) < 3:
            continue
        choices = [following, *rng.sample(others, 3)]
        rng.shuffle(choices)
        found.append({"context": question, "choices": choices, "answer": choices.index(following)})
        if len(found) == count:
            break
    if not found:
        raise ValueError(f"no pair of held-out lines fits a context of {context} bytes; pass a larger --context")
    return found


def task_files(data: Path, context: int) -> dict[str, dict]:
    """The two tasks' YAML, as lm-evaluation-harness reads a task over a local JSON file. The
    generation draws at most half the context: the harness cuts the question to what is left."""
    common = {
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "test_split": "test",
        "doc_to_text": "{{context}}",
    }
    return {
        "next_line": {
            **common,
            "task": "next_line",
            "output_type": "multiple_choice",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{answer}}",
            "target_delimiter": "",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        },
        "continue_line": {
            **common,
            "task": "continue_line",
            "output_type": "generate_until",
            "doc_to_target": "{{choices[answer]}}",
            "target_delimiter": "",
            "generation_kwargs": {
                "until": ["\n"],
                "max_gen_toks": min(64, context // 2),
                "do_sample": False,
                "temperature": 0.0,
            },
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        },
    }


def write_tasks(corpus: bytes, out: Path, context: int, count: int = 200, seed: int = 0) -> list[Path]:
    """Writes ``held_out.jsonl`` and a YAML file per task into ``out``; their paths."""
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    data = out / "held_out.jsonl"
    rows = documents(held_out_lines(corpus), context, count, seed)
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    written = [data]
    for name, task in task_files(data, context).items():
        path = out / f"{name}.yaml"
        path.write_text(yaml.safe_dump(task, sort_keys=False))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name if __spec__ else __name__}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--corpus", type=Path, required=True, help="the corpus the model was trained on")
    parser.add_argument("--out", type=Path, required=True, help="folder for the data and the task files")
    parser.add_argument(
        "--context",
        type=int,
        required=True,
        help="the longest text the server scores: /tokenizer_info's model_max_length (the context and one byte)",
    )
    parser.add_argument("--count", type=int, default=200, help="documents per task, at most")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        written = write_tasks(args.corpus.read_bytes(), args.out, args.context, args.count, args.seed)
    except (OSError, ValueError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(f"{len(written) - 1} tasks over {written[0]}; run them with: lm_eval --include_path {args.out} ...")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
