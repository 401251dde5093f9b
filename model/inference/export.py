"""The trained model in formats that leave bardflow: every parameter in a safetensors file
by its path name (``blocks.0.attn.qkv.kernel``), and the forward pass serialized with
``jax.export``, a function of those parameters and a (batch, length) array of byte ids, for
any batch and any length up to ``max_seq_len``. Reading either needs jax, numpy and
safetensors only; the files themselves are written by the export stage (``tasks/export.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...config.settings import ModelConfig
from ..network.transformer import Transformer

PLATFORMS = ("cpu", "cuda")  # lowered for both from any host (docs/architecture.md, "Export")


def _flat(node: Any, prefix: str = "") -> dict[str, jax.Array]:
    """A nested dict's leaves (the parameters' arrays) by their dotted path names."""
    if not isinstance(node, dict):
        return {prefix: node}
    flat: dict[str, jax.Array] = {}
    for key, value in node.items():
        flat.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def flat_params(model: Transformer) -> dict[str, np.ndarray]:
    """Every parameter by its dotted path name, as numpy arrays."""
    flat = _flat(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return {name: np.asarray(value) for name, value in jax.device_get(flat).items()}


def _nested(flat: Mapping[str, jax.Array | np.ndarray], template: Any, prefix: str = "") -> Any:
    """``flat`` in the shape of ``template`` (a pure dict of the model's parameters)."""
    if isinstance(template, dict):
        return {key: _nested(flat, value, f"{prefix}.{key}" if prefix else str(key)) for key, value in template.items()}
    return flat[prefix]


def forward_of(model: Transformer):
    """``forward(params, tokens) -> logits``: the model's forward as a pure function of its
    flat parameters."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    template = nnx.to_pure_dict(params)

    def forward(flat: dict[str, jax.Array], tokens: jax.Array) -> jax.Array:
        state = jax.tree.map(lambda x: x, params)  # a copy to fill: the template stays as it is
        nnx.replace_by_pure_dict(state, _nested(flat, template))
        return nnx.merge(graphdef, state, rest)(tokens)[0]

    return forward


def export_forward(model: Transformer, cfg: ModelConfig, platforms: tuple[str, ...] = PLATFORMS) -> bytes:
    """The forward pass for a symbolic batch and length (1 .. ``max_seq_len``), serialized."""
    from jax import export

    batch, length = export.symbolic_shape("batch, length", constraints=(f"length <= {cfg.max_seq_len}",))
    params = {
        name: jax.ShapeDtypeStruct(value.shape, value.dtype)
        for name, value in _flat(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()
    }
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    # Without the Python frames in its locations: they name the caller, and the same model
    # exported from two places gave two files.
    frames = jax.config.values["jax_traceback_in_locations_limit"]
    jax.config.update("jax_traceback_in_locations_limit", 0)
    try:
        exported = export.export(jax.jit(forward_of(model)), platforms=platforms)(params, tokens)
    finally:
        jax.config.update("jax_traceback_in_locations_limit", frames)
    return bytes(exported.serialize())


def portable_config(cfg: ModelConfig) -> ModelConfig:
    """The config an export holds: the plain XLA ops, which every platform lowers."""
    return cfg.model_copy(update={"attention": "xla", "dense": "xla"})
