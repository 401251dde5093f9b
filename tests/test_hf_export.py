"""The export's transformers folder (export/hf/) as transformers itself loads it: GPT-2 for
learned positions, GPT-NeoX for rotary ones, at the `tiny` and `cpu` shapes, each against
bardflow's logits and greedy text, in one fresh interpreter with torch and transformers and
without bardflow; one changed weight fails the check."""

import json
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from bardflow.config.settings import build_config
from bardflow.model.inference.export import flat_params
from bardflow.model.inference.hf import unmappable
from bardflow.model.network.transformer import build_model
from bardflow.tasks import export
from tests.helpers import REPO, require

require("torch", "transformers")


def _model(cfg, seed: int):
    """A model whose every parameter, biases and norms included, is off its initial value."""
    from flax import nnx

    model = build_model(cfg, seed)
    leaves, tree = jax.tree.flatten(nnx.state(model, nnx.Param))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    nnx.update(
        model,
        jax.tree.unflatten(
            tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
        ),
    )
    return model


def _trained_in_bfloat16(cfg):
    """A ``tiny`` model trained a few steps computing in bfloat16 (its state stays float32)."""
    from bardflow.model.data.splits import Batches, encode
    from bardflow.model.training.evaluation import val_batches
    from bardflow.model.training.loop import TrainingSetup, train
    from bardflow.model.training.placement import Placement
    from bardflow.model.training.step import init_state, model_from_state
    from tests.helpers import play_text

    split = encode(play_text(20_000), cfg.data.seq_len, 0.9, 0)
    graphdef, state = init_state(cfg.model, cfg.train)
    result = train(
        TrainingSetup(
            graphdef,
            state,
            Batches(split.train, 8),
            val_batches(split.val, 8),
            Placement.single(jax.devices()[0]),
            cfg.train,
        )
    )
    return model_from_state(graphdef, result.state)


def _written(folder, cfg, seed: int, model=None):
    model = model if model is not None else _model(cfg, seed)
    export.write_hf(folder, flat_params(model), cfg)
    return export.hf_reference(model, cfg)


@pytest.mark.slow  # torch and transformers in an interpreter of their own
def test_both_position_kinds_at_two_shapes_compute_in_transformers_what_they_do_in_bardflow(tmp_path):
    from safetensors.numpy import load_file, save_file

    checks = []
    for preset in ("tiny", "cpu"):
        for positions in ("learned", "rope"):
            cfg = build_config(preset, {"model.positions": positions}).model
            folder = tmp_path / f"{preset}-{positions}"
            checks.append((folder, _written(folder, cfg, seed=len(checks))))
    # Trained computing in bfloat16: the float32 weights it kept are what it exports.
    bf16 = build_config("tiny", {"train.precision": "bfloat16", "train.steps": 5, "train.log_every": 5})
    checks.append((tmp_path / "bfloat16", _written(tmp_path / "bfloat16", bf16.model, 0, _trained_in_bfloat16(bf16))))
    assert {str(t.dtype) for t in load_file(str(tmp_path / "bfloat16" / "model.safetensors")).values()} == {"float32"}
    # The same folder with one weight changed: the check must notice.
    bad = tmp_path / "changed"
    subprocess.run(["cp", "-r", str(checks[0][0]), str(bad)], check=True)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["lm_head.weight"][3, 5] += 0.05
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})

    results = export.run_hf_check([*checks, (bad, checks[0][1])])
    assert [r["architecture"] for r in results[:5]] == ["GPT2LMHeadModel", "GPTNeoXForCausalLM"] * 2 + [
        "GPT2LMHeadModel"
    ]
    for (folder, reference), result in zip(checks, results[:5], strict=True):
        export.hf_verdict(result)  # passes
        assert result["max_abs_diff"] <= export.HF_TOLERANCE and result["greedy_equal"], folder.name
        assert result["greedy_bytes"] == len(reference["greedy"]) > 0 and result["tokenizer_exact"]
        assert not result["bardflow_imported"]
        assert result["generate_warnings"] == [], result["generate_warnings"]  # e.g. max_length beside max_new_tokens
    # A learned-position model's window slides past its context (32 and 128 bytes) in both.
    assert results[0]["greedy_bytes"] == results[2]["greedy_bytes"] == export.GREEDY_BYTES
    assert results[5]["max_abs_diff"] > export.HF_TOLERANCE
    with pytest.raises(export.ExportError, match=r"differ from the checkpoint's by .* --refresh export"):
        export.hf_verdict(results[5])

    # Used as people use a Hub model: examples/generate_with_transformers.py, no bardflow, on
    # an export folder as the stage writes it (hf/ inside, checksums.json over every file),
    # and as the README runs it: no --bytes, so as many as a `tiny` model's 32-byte context
    # holds after the prompt.
    source = (REPO / "examples" / "generate_with_transformers.py").read_text()
    assert not [line for line in source.splitlines() if "bardflow" in line and "import" in line]
    exported = tmp_path / "export"
    shutil.copytree(checks[0][0], exported / "hf")
    export.write_checksums(exported)
    assert json.loads((exported / "checksums.json").read_text())["sha256"].keys() >= {
        "hf/config.json",
        "hf/model.safetensors",
        "hf/tokenizer.json",
        "hf/generation_config.json",
    }
    done = example(exported, "--prompt", "ROMEO:", "--temperature", "0")
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    greedy = checks[0][1]["greedy"][: 32 - len("ROMEO:")].astype(np.uint8).tobytes()
    assert done.stdout.rstrip(b"\n") == b"ROMEO:" + greedy.decode("utf-8", "replace").encode()


def example(folder, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-I", str(REPO / "examples" / "generate_with_transformers.py"), str(folder), *args],
        capture_output=True,
        timeout=300,
        check=False,
    )


def test_the_transformers_example_refuses_a_folder_its_checksums_do_not_vouch_for_or_that_asks_for_code(tmp_path):
    """Swapped weights, an added file, a config that asks for remote code (even with its
    checksum made to match), a folder without the export's checksums: each one line, exit 1,
    before transformers reads anything."""
    cfg = build_config("tiny").model
    for name, seed in (("good", 0), ("other", 1)):
        export.write_hf(tmp_path / name / "hf", flat_params(_model(cfg, seed)), cfg)
        export.write_checksums(tmp_path / name)
    hf = tmp_path / "good" / "hf"

    def refused(folder, match: str) -> None:
        done = example(folder, "--temperature", "0")
        lines = done.stderr.decode().strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1 and done.stdout == b"", done.stderr.decode()[-2000:]
        assert re.search(match, lines[0]), lines[0]

    original = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes((tmp_path / "other" / "hf" / "model.safetensors").read_bytes())
    refused(
        tmp_path / "good",
        r"hf/model.safetensors does not match its checksum \(damaged, edited or from another "
        r"export\); export it again",
    )
    (hf / "model.safetensors").write_bytes(original)

    (hf / "modeling_gpt2.py").write_text("import os\n")
    refused(tmp_path / "good", r"hf/modeling_gpt2.py is not part of the export")
    (hf / "modeling_gpt2.py").unlink()

    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(
        json.dumps(
            {
                **config,
                "auto_map": {"AutoModelForCausalLM": "modeling_gpt2.X"},
                "trust_remote_code": True,
                "layer_norm_epsilon": 0.5,
            }
        )
    )
    refused(tmp_path / "good", r"hf/config.json does not match its checksum")
    export.write_checksums(tmp_path / "good")  # the checksums rewritten to match: still refused
    refused(tmp_path / "good", r"hf/config.json asks for code from elsewhere \(auto_map, trust_remote_code\)")
    sums = tmp_path / "good" / "checksums.json"
    for damage, error in ((sums.read_bytes()[:40], "JSONDecodeError"), (b"[]", "TypeError")):
        sums.write_bytes(damage)  # each used to end in a traceback
        refused(tmp_path / "good", rf"good/checksums.json is damaged \({error}: not the export's checksums\)")
    (tmp_path / "bare").mkdir()
    shutil.copytree(tmp_path / "other" / "hf", tmp_path / "bare" / "hf")
    refused(tmp_path / "bare" / "hf", r"bare/hf has no checksums.json beside it, so its files cannot be checked")


def test_a_model_transformers_cannot_compute_gets_no_folder_and_one_line_why(tmp_path, monkeypatch):
    cfg = build_config("tiny", {"model.qk_norm": True}).model
    assert "model.qk_norm" in unmappable(cfg)
    found = export._hf(tmp_path / "hf", build_model(cfg, 0), cfg, {}, "off")
    assert found == {"status": f"not written: {unmappable(cfg)}", "checked": False}
    assert not (tmp_path / "hf").exists()

    # A mappable model where transformers is missing: written, and said to be unchecked.
    cfg = build_config("tiny").model
    import importlib.metadata

    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "transformers":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.delenv(export.HF_CHECKING, raising=False)
    assert export.hf_check_tools() == "not installed"
    model = build_model(cfg, 0)
    found = export._hf(tmp_path / "hf", model, cfg, flat_params(model), "not installed")
    # The install hint fits where bardflow is: this clone's editable install takes its extra from here.
    from bardflow.config.machine import install_hint

    assert install_hint("hf").startswith("pip install -e '") and install_hint("hf").endswith("[hf]'")
    assert found["checked"] is False and f"({install_hint('hf')}, then rerun)" in found["status"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "gpt2"


WRITE_EXPORT = (
    "import sys; from pathlib import Path\n"
    "from bardflow.config.settings import build_config\n"
    "from bardflow.model.inference.export import flat_params\n"
    "from bardflow.model.network.transformer import build_model\n"
    "from bardflow.tasks import export\n"
    "cfg = build_config('tiny').model; model = build_model(cfg, 0); folder = Path(sys.argv[1])\n"
    "export.write_export(folder, model, cfg)\n"
    "export.write_hf(folder / 'hf', flat_params(model), cfg)\n"
)


def test_the_export_is_the_same_bytes_in_any_process(tmp_path):
    """safetensors writes its metadata map in an order of the process's own: the same model
    gave two files, so a refresh was never "unchanged" and replaced the version each time."""
    folders = [tmp_path / name for name in ("a", "b")]
    other = subprocess.run(
        [sys.executable, "-c", WRITE_EXPORT, str(folders[1])], cwd=REPO, capture_output=True, timeout=300
    )
    assert other.returncode == 0, other.stderr.decode()[-2000:]
    cfg = build_config("tiny").model  # and here, in this process, from another place in the code
    model = build_model(cfg, 0)
    export.write_export(folders[0], model, cfg)
    export.write_hf(folders[0] / "hf", flat_params(model), cfg)
    files = [{p.relative_to(f).as_posix(): p.read_bytes() for p in f.rglob("*") if p.is_file()} for f in folders]
    assert files[0].keys() == files[1].keys() and "hf/model.safetensors" in files[0]
    assert [name for name in files[0] if files[0][name] != files[1][name]] == []
    from safetensors import safe_open

    with safe_open(folders[0] / "model.safetensors", "np") as weights:
        assert weights.metadata() == {"format": "bardflow", "vocab": "bytes"}
