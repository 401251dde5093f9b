"""The decoder-only byte transformer of the codelab, in one screen; each parameter's shape
and logical axes are declared in ``parameters.py``.

One forward pass serves training and sampling: ``model(tokens, positions, cache)`` returns
the logits and the updated key/value cache, so the sampler drives these modules and never
repeats their arithmetic.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...config.settings import AttentionKernel, Kernel, ModelConfig
from .caches import Cache, LayerCache
from .kernels import FUSED_DTYPES, causal_attention, dense, pallas_attention
from .parameters import shape_of


def use_custom(setting: Kernel | AttentionKernel) -> bool:
    """Whether the hand-written gradient serves. A training run builds its model from
    resolved settings (``model/training/step_settings.py``: the hand-written kernels where they were
    measured faster); left to ``auto`` here, the model takes the plain JAX operations."""
    return setting == "custom"


Blocks = Literal["unrolled", "scanned", "recomputed"]  # how a training pass runs the blocks


class Linear(nnx.Linear):
    def __init__(self, *args, custom: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.custom = custom

    # One input, always: the model never asks a layer for an output sharding (nnx.Linear's
    # second parameter), which XLA's propagation decides.
    def __call__(self, x):  # pyright: ignore[reportIncompatibleMethodOverride]
        assert self.bias is not None  # every dense layer of the model has one
        if self.custom:
            return dense(x, self.kernel[...], self.bias[...])  # same result, a faster CPU gradient
        return x @ self.kernel[...] + self.bias[...]


def output_init(cfg: ModelConfig) -> dict:
    """A block's output projections start at zero (``zero_init``): each block begins as the
    identity and the first steps train the embeddings and the head."""
    return {"kernel_init": nnx.initializers.zeros_init()} if cfg.zero_init else {}


# XLA's generators, which a TPU runs: there a mask drawn a byte a value, not 32 bits, made the
# ``quality`` step faster (docs/tpu-check.md). Threefry keeps its masks.
BYTE_MASK_GENERATORS = frozenset({"rbg", "unsafe_rbg"})


def dropped(x, rate: float, key):
    """Dropout: each value zeroed with probability ``rate``, the rest scaled by 1 / (1 - rate);
    ``x`` itself without a key (evaluation, sampling) or at rate 0. From an XLA generator's key
    (``BYTE_MASK_GENERATORS``) a byte decides each value: the rate in 256ths (0.2: 51/256),
    the kept values scaled by the fraction kept, so the expectation stays ``x``."""
    if key is None or rate == 0.0:
        return x
    if str(jax.random.key_impl(key)) in BYTE_MASK_GENERATORS:
        dropped_of_256 = min(255, max(1, round(rate * 256)))
        kept = jax.random.bits(key, x.shape, jnp.uint8) >= dropped_of_256
        return jnp.where(kept, x * (256 / (256 - dropped_of_256)), 0.0).astype(x.dtype)
    kept = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(kept, x / (1.0 - rate), 0.0).astype(x.dtype)


def lookup(table: nnx.Embed, ids):
    """Rows of an embedding table, in the table's own dtype: ``nnx.Embed`` computes in the
    dtype it was built with (float32), which would lift a bfloat16 step's activations, and
    with them every matrix product after, back to float32."""
    return jnp.take(table.embedding[...], ids, axis=0)


def rms_norm(x):
    """Each vector over its last axis scaled to unit root mean square; no weights."""
    mean_square = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return (x * jax.lax.rsqrt(mean_square + 1e-6)).astype(x.dtype)


def rotate(x, positions, base: float = 10000.0):
    """Rotary position embedding of (rows, t, heads, head_dim) at ``positions`` (t,): feature
    pairs (i, i + head_dim/2) turn by ``position * base^(-i / (head_dim/2))``, so that a
    query-key product depends on their distance only."""
    half = x.shape[-1] // 2
    angles = positions.astype(jnp.float32)[:, None] * base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.num_heads, self.head_dim = cfg.num_heads, cfg.d_model // cfg.num_heads
        self.rotary = cfg.positions == "rope"
        custom = use_custom(cfg.dense)
        self.qkv = Linear(*shape_of(cfg, "attn.qkv.kernel"), custom=custom, rngs=rngs)  # query, key, value in one
        self.out = Linear(*shape_of(cfg, "attn.out.kernel"), custom=custom, rngs=rngs, **output_init(cfg))
        self.custom = use_custom(cfg.attention)
        self.fused = cfg.attention == "cudnn"
        self.pallas = cfg.attention if cfg.attention in ("splash", "flash") else None
        self.qk_norm = cfg.qk_norm

    def _heads_first(self, x):  # (rows, t, d_model) -> (rows * heads, t, head_dim)
        rows, length, _ = x.shape
        x = x.reshape(rows, length, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        return x.reshape(rows * self.num_heads, length, self.head_dim)

    def _heads_last(self, x):  # the inverse
        length = x.shape[1]
        x = x.reshape(-1, self.num_heads, length, self.head_dim).transpose(0, 2, 1, 3)
        return x.reshape(-1, length, self.num_heads * self.head_dim)

    def _causal(self, q, k, v, span: int | None):
        """Each position over those before it (within ``span`` of it), by the chosen kernel."""
        if span is not None and span < q.shape[1]:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(span - 1, 0))
        if self.custom:
            return causal_attention(q, k, v)
        if self.pallas:
            return pallas_attention(q, k, v, self.pallas)
        if self.fused and q.dtype in FUSED_DTYPES:  # a float32 evaluation takes XLA's path
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    def __call__(
        self,
        x,
        positions,
        cache: Cache | None = None,
        last_only: bool = False,
        span: int | None = None,
        filled: int | None = None,
    ):
        q, k, v = (t.reshape(*x.shape[:-1], self.num_heads, self.head_dim) for t in jnp.split(self.qkv(x), 3, axis=-1))
        if self.qk_norm:
            q, k = rms_norm(q), rms_norm(k)
        if self.rotary:
            q, k = rotate(q, positions), rotate(k, positions)
        if cache is None and not last_only:  # every position attends to those before it
            with jax.named_scope("attention"):  # a profile's kind (bench/profile.py)
                mixed = self._causal(q, k, v, span)
            return self.out(mixed.reshape(x.shape)), None
        q, k, v = (t.reshape(x.shape) for t in (q, k, v))
        new = LayerCache(self._heads_first(k), self._heads_first(v))
        at = positions[0]
        if last_only:
            q, positions = q[:, -1:], positions[-1:]
        query = self._heads_first(q)
        if cache is None:
            visible = jnp.arange(new.window)[None, :] <= positions[:, None]  # (queries, keys)
            return self.out(self._heads_last(new.attended(query, visible))), None
        # Only the cache's first ``filled`` slots hold keys yet: read no more.
        visible = jnp.arange(filled or cache.window)[None, :] <= positions[:, None]
        # These positions' keys and values join the cache. A ring: past the window, position
        # p overwrites the key of p - window, which has left the context (rotary positions;
        # learned ones end at the window).
        mixed, cache = cache.written_and_attended(new, at % cache.window, query, visible, filled)
        return self.out(self._heads_last(mixed)), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        custom = use_custom(cfg.dense)
        self.up = Linear(*shape_of(cfg, "mlp.up.kernel"), custom=custom, rngs=rngs)
        self.down = Linear(*shape_of(cfg, "mlp.down.kernel"), custom=custom, rngs=rngs, **output_init(cfg))
        self.relu2 = cfg.mlp == "relu2"

    def __call__(self, x):
        hidden = self.up(x)
        return self.down(jnp.square(jax.nn.relu(hidden)) if self.relu2 else jax.nn.gelu(hidden))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(*shape_of(cfg, "ln1.scale"), rngs=rngs)
        self.attn = CausalSelfAttention(cfg, rngs)
        self.ln2 = nnx.LayerNorm(*shape_of(cfg, "ln2.scale"), rngs=rngs)
        self.mlp = MLP(cfg, rngs)
        self.dropout = cfg.dropout

    def __call__(
        self,
        x,
        positions,
        cache: Cache | None = None,
        last_only: bool = False,
        span: int | None = None,
        keys=None,
        filled: int | None = None,
    ):
        # Pre-norm: normalise, attend (or feed forward), add back; ``keys`` (2,): dropout's
        # on what each adds (training only).
        mixed, cache = self.attn(self.ln1(x), positions, cache, last_only, span, filled)
        x = (x[:, -1:] if last_only else x) + dropped(mixed, self.dropout, None if keys is None else keys[0])
        return x + dropped(self.mlp(self.ln2(x)), self.dropout, None if keys is None else keys[1]), cache


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.token_embed = nnx.Embed(*shape_of(cfg, "token_embed.embedding"), rngs=rngs)
        self.max_seq_len = cfg.max_seq_len
        self.rotary = cfg.positions == "rope"  # positions enter in attention, not here
        self.pos_embed = None if self.rotary else nnx.Embed(*shape_of(cfg, "pos_embed.embedding"), rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = nnx.LayerNorm(*shape_of(cfg, "final_norm.scale"), rngs=rngs)
        self.lm_head = nnx.Linear(*shape_of(cfg, "lm_head.kernel"), use_bias=False, rngs=rngs)
        self.logit_cap = cfg.logit_cap
        self.dropout = cfg.dropout

    def __call__(
        self,
        tokens,
        positions=None,
        cache: tuple[Cache, ...] | None = None,
        last_only: bool = False,
        span: int | None = None,
        blocks: Blocks = "unrolled",
        dropout_key=None,
        filled: int | None = None,
    ):
        """(rows, t) token ids -> (logits, cache).

        ``positions`` (t,): where the tokens sit, by default 0..t-1. ``cache``: every layer's
        keys and values so far (``init_cache``); the tokens' own are written at ``positions``
        and the tokens attend to everything cached up to them (with rotary positions a
        single token may sit past the cache's window: its key replaces the oldest). ``span``:
        each position attends only to the last ``span`` positions up to it (what a wrapped
        cache computes: past the window, every layer sees its last ``window`` keys, and the
        lower layers' keys carry older context up, so for more than one layer that is not
        the window recomputed from scratch). ``last_only``: only the last
        position's logits are wanted, (rows, 1, vocab): every layer below the top one still
        runs over all positions (they make the top layer's keys and values), the top layer's
        query, MLP and the head only over the last. ``blocks`` (training, ``Blocks``): one
        after another, or as one loop over their stacked parameters (``_looped``), so that a
        compiler sees one block whatever the depth (``train.layers``), or that loop with each
        block's activations recomputed in the backward pass instead of kept (``train.remat``):
        the same function each way.
        ``dropout_key`` (training): dropout at ``model.dropout`` on the embeddings and on what
        each block's attention and MLP add, as nanoGPT's residual dropout (no key, or rate 0:
        none, and the program is the one without dropout). ``filled`` (with ``cache``): only
        the cache's first ``filled`` slots are read, the rest not being written yet (a static
        bound, so that a sampler's step reads the cache only as far as it is filled).
        """
        if positions is None:
            positions = jnp.arange(tokens.shape[1])
        x = lookup(self.token_embed, tokens)
        if self.pos_embed is not None:  # learned positions; rotary ones act in attention
            x = x + lookup(self.pos_embed, positions)
        keys = None
        if dropout_key is not None and self.dropout > 0:  # one for the embeddings, two a block
            keys = jax.random.split(dropout_key, 2 * len(self.blocks) + 1)
            x = dropped(x, self.dropout, keys[0])
            keys = keys[1:].reshape(len(self.blocks), 2)
        layers = cache if cache is not None else (None,) * len(self.blocks)
        updated = []
        if blocks != "unrolled" and cache is None and not last_only and span is None:
            x = _looped(self.blocks, x, positions, keys, recomputed=blocks == "recomputed")
        else:
            for depth, (block, layer) in enumerate(zip(self.blocks, layers, strict=True)):
                last = last_only and depth == len(self.blocks) - 1
                x, layer = block(x, positions, layer, last, span, None if keys is None else keys[depth], filled)
                updated.append(layer)
        logits = self.lm_head(self.final_norm(x))
        if self.logit_cap is not None:
            logits = self.logit_cap * jnp.tanh(logits / self.logit_cap)
        return logits, (tuple(updated) if cache is not None else None)

    def init_cache(self, rows: int, window: int, dtype=jnp.float32) -> tuple[LayerCache, ...]:
        attn = self.blocks[0].attn
        shape = (rows * attn.num_heads, window, attn.head_dim)
        # Distinct buffers, so that a compiled loop may update every one in place (donated).
        return tuple(LayerCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in self.blocks)


def _looped(blocks, x, positions, keys=None, recomputed: bool = False):
    """The blocks as one loop over their stacked parameters (the stored parameters stay one
    set a block: the stacking is part of the step, and its gradient the unstacking).
    ``recomputed``: the loop's body is recomputed from its input in the backward pass
    (``jax.checkpoint``), so only each block's input is kept; a loop, not the blocks one after
    another, since XLA:CPU schedules unrolled recomputations early and keeps their results as
    long as it would have kept the originals."""
    graphdef, _ = nnx.split(blocks[0])
    stacked = jax.tree.map(lambda *layers: jnp.stack(layers), *(nnx.split(block)[1] for block in blocks))

    def body(x, layer):
        state, block_keys = layer
        return nnx.merge(graphdef, state)(x, positions, keys=block_keys)[0], None

    return jax.lax.scan(jax.checkpoint(body) if recomputed else body, x, (stacked, keys))[0]


def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    """The model's parameters drawn in one compiled program: run one by one, each initialiser
    is a compilation of its own (a second or two of a training stage's start on a CPU)."""
    return _constructor(cfg)(np.uint32(seed))


@lru_cache(maxsize=16)
def _constructor(cfg: ModelConfig):
    """One compiled constructor per configuration, the seed its argument: the runs of one
    process (a sweep's, a stage that restores a model) trace it once."""
    return nnx.jit(lambda seed: Transformer(cfg, nnx.Rngs(jax.random.key(seed))))


def count_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
