"""Model FLOPs utilization: the share of a device's peak that a training run's arithmetic
uses. The count is nanoGPT's (``estimate_mfu``): 6N + 12·L·d·T FLOPs a token, N the
parameters but a learned position table, L the blocks, d the width, T the context; the peak is
the device's dense rate in the run's compute dtype, from the table below. A device the table
does not know gets no figure rather than a wrong one. Plain Python: read before JAX loads."""

from __future__ import annotations

from ...config.settings import ModelConfig
from ..network.parameters import parameters
from .run_records import Utilization

FORMULA = "6N + 12*L*d*T FLOPs a token (nanoGPT); N: parameters but a learned position table"
# Dense peaks in FLOP/s by the device's kind (``jax.Device.device_kind``, matched by the first
# name it contains) and compute dtype, from the makers' data sheets (SXM parts; float32 is the
# non-tensor rate).
PEAKS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float32": 19.5e12},
    "L4": {"bfloat16": 121e12, "float32": 30.3e12},
    "TPU v5 lite": {"bfloat16": 197e12},
    "TPU v4": {"bfloat16": 275e12},
}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    counted = sum(p.size for p in parameters(cfg).values() if p.name != "pos_embed.embedding")
    return 6 * counted + 12 * cfg.num_layers * cfg.d_model * seq_len


def peak_flops(device_kind: str, precision: str) -> float | None:
    """A device's dense peak in ``precision``, or None when the table does not know it."""
    for name, peaks in PEAKS.items():
        if name.lower() in device_kind.lower():
            return peaks.get(precision)
    return None


def utilization(
    cfg: ModelConfig, seq_len: int, tokens_per_s: float, devices: int, device_kind: str, precision: str
) -> Utilization:
    """The manifest's figures: FLOPs a token, the peak used, and MFU (None, with the reason,
    where the peak is unknown)."""
    per_token = flops_per_token(cfg, seq_len)
    peak = peak_flops(device_kind, precision)
    if peak is None:
        return Utilization(
            flops_per_token=per_token,
            mfu=None,
            peak_tflops=None,
            mfu_formula=FORMULA,
            device_kind=device_kind,
            mfu_note=f"no {precision} peak known for {device_kind!r}",
        )
    return Utilization(
        flops_per_token=per_token,
        mfu=round(tokens_per_s * per_token / (peak * devices), 4),
        peak_tflops=peak / 1e12,
        mfu_formula=FORMULA,
        device_kind=device_kind,
    )
