"""The decoder-only byte transformer of the codelab, in one screen."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig
from model.kernels import causal_attention, dense


class Linear(nnx.Linear):
    def __call__(self, x):
        return dense(x, self.kernel[...], self.bias[...])  # same result, a faster gradient


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.num_heads, self.head_dim = cfg.num_heads, cfg.d_model // cfg.num_heads
        self.qkv = Linear(cfg.d_model, 3 * cfg.d_model, rngs=rngs)  # query, key, value in one product
        self.out = Linear(cfg.d_model, cfg.d_model, rngs=rngs)

    def project(self, x):  # (..., d_model) -> query, key, value, each (..., d_model)
        return jnp.split(self.qkv(x), 3, axis=-1)

    def __call__(self, x):
        q, k, v = (part.reshape(*x.shape[:-1], self.num_heads, self.head_dim) for part in self.project(x))
        return self.out(causal_attention(q, k, v).reshape(x.shape))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.attn = CausalSelfAttention(cfg, rngs)
        self.ln2 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.fc_up = Linear(cfg.d_model, cfg.ffn_dim, rngs=rngs)
        self.fc_down = Linear(cfg.ffn_dim, cfg.d_model, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))  # pre-norm: normalise, attend, add back
        return x + self.fc_down(jax.nn.gelu(self.fc_up(self.ln2(x))))


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.token_embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.pos_embed = nnx.Embed(cfg.max_seq_len, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens):  # (B, T) int -> (B, T, vocab) logits
        x = self.token_embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x))


def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    return Transformer(cfg, nnx.Rngs(seed))


def count_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
