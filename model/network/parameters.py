"""Every parameter of the transformer, declared once: its name in the model's state and its
logical axes, whose sizes come from the configuration. The network builds its layers from these
shapes (``transformer.py``); placement and the step's sharding map the axes to a mesh
(``model/training/sharding.py``), the memory estimate counts them, the transformers mapping
names them. Plain Python: the memory estimate reads it before JAX is imported."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ...config.settings import ModelConfig

# The logical axes, each a size of the configuration.
VOCAB, EMBED, POSITION, QKV, HEADS, MLP = "vocab", "embed", "position", "qkv", "heads", "mlp"
LOGICAL_AXES = (VOCAB, EMBED, POSITION, QKV, HEADS, MLP)

# The parameters outside the blocks, by name; ``pos_embed`` with learned positions only.
TOP: dict[str, tuple[str, ...]] = {
    "token_embed.embedding": (VOCAB, EMBED),
    "pos_embed.embedding": (POSITION, EMBED),
    "final_norm.scale": (EMBED,),
    "final_norm.bias": (EMBED,),
    "lm_head.kernel": (EMBED, VOCAB),
}
# Each block's parameters, by their name inside the block (``blocks.N.`` before it in the state).
BLOCK: dict[str, tuple[str, ...]] = {
    "ln1.scale": (EMBED,),
    "ln1.bias": (EMBED,),
    "attn.qkv.kernel": (EMBED, QKV),  # queries, keys and values of every head in one product
    "attn.qkv.bias": (QKV,),
    "attn.out.kernel": (HEADS, EMBED),  # the heads' outputs side by side, back to the residual
    "attn.out.bias": (EMBED,),
    "ln2.scale": (EMBED,),
    "ln2.bias": (EMBED,),
    "mlp.up.kernel": (EMBED, MLP),
    "mlp.up.bias": (MLP,),
    "mlp.down.kernel": (MLP, EMBED),
    "mlp.down.bias": (EMBED,),
}
_IN_BLOCK = re.compile(r"blocks\.\d+\.(.+)")


@dataclass(frozen=True)
class Parameter:
    name: str  # its path in the model's state, e.g. blocks.3.attn.qkv.kernel
    axes: tuple[str, ...]
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def in_block(self) -> bool:
        return self.name.startswith("blocks.")


def axis_sizes(cfg: ModelConfig) -> dict[str, int]:
    return {
        VOCAB: cfg.vocab_size,
        EMBED: cfg.d_model,
        POSITION: cfg.max_seq_len,
        QKV: 3 * cfg.d_model,
        HEADS: cfg.d_model,
        MLP: cfg.ffn_dim,
    }


def shape_of(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """A parameter's shape by its name, outside the blocks or inside one (``attn.qkv.kernel``)."""
    sizes = axis_sizes(cfg)
    return tuple(sizes[axis] for axis in axes_of(name))


def axes_of(name: str) -> tuple[str, ...]:
    """A parameter's logical axes by its name in the state, the block's index in it or not;
    a ``KeyError`` for a name that is no parameter."""
    inside = _IN_BLOCK.fullmatch(name)
    return BLOCK[inside.group(1)] if inside else TOP.get(name) or BLOCK[name]


def parameters(cfg: ModelConfig) -> dict[str, Parameter]:
    """Every parameter of a model of ``cfg`` by its name in the state."""
    names = [name for name in TOP if name != "pos_embed.embedding" or cfg.positions == "learned"]
    names += [f"blocks.{layer}.{name}" for layer in range(cfg.num_layers) for name in BLOCK]
    return {name: Parameter(name, axes_of(name), shape_of(cfg, name)) for name in names}


def parameter_of(path: tuple[str, ...]) -> str | None:
    """The parameter a state leaf's key path ends with (its own, or an optimizer moment of
    it: ``…, mu, blocks, 0, attn, qkv, kernel``), or None (step counts, rates)."""
    for start in range(len(path)):
        name = ".".join(path[start:])
        try:
            axes_of(name)
        except KeyError:
            continue
        return name
    return None
