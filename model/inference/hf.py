"""The model in Hugging Face ``transformers``' own architectures, as plain data: the
``config.json`` and every tensor under the architecture's names, made with numpy alone (the
export stage writes them; ``tasks/export.py``).

The map is exact, not approximate:
- learned positions are GPT-2 (``GPT2LMHeadModel``): the fused ``qkv`` kernel (d, 3d) is
  GPT-2's ``c_attn`` Conv1D layout as it is (so are ``out``, the MLP's up and down); the head is
  transposed into an ``nn.Linear``; ``gelu_new`` is ``jax.nn.gelu``'s tanh form, and the layer
  norms' epsilon is Flax's 1e-6 (GPT-2's 1e-5 would move the logits by about 5e-3).
- rotary positions are GPT-NeoX (``GPTNeoXForCausalLM``) with rotary over every feature, one
  residual after the other, biased attention; its ``query_key_value`` holds each head's query,
  key and value together, so the fused kernel's columns are regrouped by head.
- the ids are the bytes: a byte-level BPE tokenizer with no merges (``tokenizer.json``).

Settings that neither architecture computes (``qk_norm``, ``logit_cap``) have no export:
``unmappable`` says which, in words."""

from __future__ import annotations

import numpy as np

from ...config.settings import ModelConfig
from ..network.parameters import parameters

LAYER_NORM_EPS = 1e-6  # nnx.LayerNorm's default
ROPE_BASE = 10000.0  # model/network/transformer.py, rotate


def unmappable(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` has no transformers architecture that computes it, or None."""
    reasons = [
        why
        for why, found in (
            ("model.qk_norm (RMS-normalised queries and keys)", cfg.qk_norm),
            ("model.logit_cap (soft-capped logits)", cfg.logit_cap is not None),
        )
        if found
    ]
    return f"no transformers architecture computes {' and '.join(reasons)}" if reasons else None


def hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` for ``cfg``: GPT-2 for learned positions, GPT-NeoX for rotary ones."""
    activation = "relu2" if cfg.mlp == "relu2" else None
    common = {
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
    }
    if cfg.positions == "learned":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            **common,
            "n_positions": cfg.max_seq_len,
            "n_ctx": cfg.max_seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads,
            "n_inner": cfg.ffn_dim,
            "activation_function": activation or "gelu_new",
            "layer_norm_epsilon": LAYER_NORM_EPS,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
        }
    rope = {"rope_type": "default", "rope_theta": ROPE_BASE, "partial_rotary_factor": 1.0}
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        **common,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.ffn_dim,
        "hidden_act": activation or "gelu_pytorch_tanh",
        "max_position_embeddings": cfg.max_seq_len,
        "layer_norm_eps": LAYER_NORM_EPS,
        "use_parallel_residual": False,
        "attention_bias": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        # Both spellings: transformers 5 reads rope_parameters, 4 the two before it.
        "rotary_pct": 1.0,
        "rotary_emb_base": ROPE_BASE,
        "rope_parameters": rope,
    }


def _by_head(cfg: ModelConfig) -> np.ndarray:
    """The fused projection's columns regrouped from (queries | keys | values) to each head's
    (query, key, value), GPT-NeoX's ``query_key_value`` layout."""
    d, head = cfg.d_model, cfg.d_model // cfg.num_heads
    return np.concatenate([part * d + h * head + np.arange(head) for h in range(cfg.num_heads) for part in range(3)])


def hf_tensors(params: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Every parameter (``model/inference/export.py``'s ``flat_params``, by the names
    ``model/network/parameters.py`` declares) under the architecture's names, float32, contiguous."""
    declared = parameters(cfg)
    assert set(params) == set(declared), f"not declared or missing: {sorted(set(params) ^ set(declared))}"
    taken: set[str] = set()

    def p(name: str) -> np.ndarray:
        taken.add(name)
        return np.asarray(params[name], np.float32)

    out: dict[str, np.ndarray] = {}
    if cfg.positions == "learned":
        out["transformer.wte.weight"] = p("token_embed.embedding")
        out["transformer.wpe.weight"] = p("pos_embed.embedding")
        for i in range(cfg.num_layers):
            ours, theirs = f"blocks.{i}", f"transformer.h.{i}"
            for norm, name in (("ln1", "ln_1"), ("ln2", "ln_2")):
                out[f"{theirs}.{name}.weight"] = p(f"{ours}.{norm}.scale")
                out[f"{theirs}.{name}.bias"] = p(f"{ours}.{norm}.bias")
            for layer, name in (
                ("attn.qkv", "attn.c_attn"),
                ("attn.out", "attn.c_proj"),
                ("mlp.up", "mlp.c_fc"),
                ("mlp.down", "mlp.c_proj"),
            ):  # Conv1D: (in, out), Flax's own layout
                out[f"{theirs}.{name}.weight"] = p(f"{ours}.{layer}.kernel")
                out[f"{theirs}.{name}.bias"] = p(f"{ours}.{layer}.bias")
        out["transformer.ln_f.weight"] = p("final_norm.scale")
        out["transformer.ln_f.bias"] = p("final_norm.bias")
    else:
        out["gpt_neox.embed_in.weight"] = p("token_embed.embedding")
        order = _by_head(cfg)
        for i in range(cfg.num_layers):
            ours, theirs = f"blocks.{i}", f"gpt_neox.layers.{i}"
            for norm, name in (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm")):
                out[f"{theirs}.{name}.weight"] = p(f"{ours}.{norm}.scale")
                out[f"{theirs}.{name}.bias"] = p(f"{ours}.{norm}.bias")
            out[f"{theirs}.attention.query_key_value.weight"] = p(f"{ours}.attn.qkv.kernel")[:, order].T
            out[f"{theirs}.attention.query_key_value.bias"] = p(f"{ours}.attn.qkv.bias")[order]
            for layer, name in (
                ("attn.out", "attention.dense"),
                ("mlp.up", "mlp.dense_h_to_4h"),
                ("mlp.down", "mlp.dense_4h_to_h"),
            ):  # nn.Linear: (out, in)
                out[f"{theirs}.{name}.weight"] = p(f"{ours}.{layer}.kernel").T
                out[f"{theirs}.{name}.bias"] = p(f"{ours}.{layer}.bias")
        out["gpt_neox.final_layer_norm.weight"] = p("final_norm.scale")
        out["gpt_neox.final_layer_norm.bias"] = p("final_norm.bias")
    head = "lm_head.weight" if cfg.positions == "learned" else "embed_out.weight"
    out[head] = p("lm_head.kernel").T
    assert taken == set(declared), f"not mapped: {sorted(set(declared) - taken)}"  # parameters.py and this map in step
    return {name: np.ascontiguousarray(value) for name, value in out.items()}
