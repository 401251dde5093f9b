"""The export stage's check, run as a script in a fresh interpreter (``python -I``): it loads
an export folder with jax, numpy and safetensors alone (no bardflow), runs the serialized
forward pass on the probes and prints, as JSON, the largest difference from the logits the
stage computed with the restored model, and which modules it needed.

    python -I export_check.py EXPORT_FOLDER PROBES.npz
"""

import json
import sys
from pathlib import Path

import numpy as np
from jax import export
from safetensors.numpy import load_file


def main(folder: Path, probes: Path) -> dict:
    params = load_file(str(folder / "model.safetensors"))
    forward = export.deserialize(bytearray((folder / "forward.jax").read_bytes()))
    expected = np.load(probes)
    diffs = {}
    for name in sorted(k for k in expected.files if k.startswith("tokens")):
        logits = np.asarray(forward.call(params, expected[name]))
        reference = expected[name.replace("tokens", "logits")]
        diffs[name] = float(np.max(np.abs(logits - reference))) if logits.shape == reference.shape else float("inf")
    import jax

    return {
        "max_abs_diff": max(diffs.values()),
        "by_probe": diffs,
        "platform": jax.default_backend(),
        "exported_for": list(forward.platforms),
        "bardflow_imported": any(m == "bardflow" or m.startswith("bardflow.") for m in sys.modules),
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]))))
