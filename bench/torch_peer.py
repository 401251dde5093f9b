"""A PyTorch peer of the codelab model for the benchmark only (``pip install torch``):
same shapes and parameter count, ``scaled_dot_product_attention``, AdamW, eager mode, on the
GPU when JAX runs on one (so both sides of the comparison share the hardware), else on the CPU."""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (proj(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for proj in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(att)
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.num_heads, cfg.ffn_dim) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def runner(cfg, steps: int, on_gpu: bool = False):
    """A callable that runs ``steps`` training steps and returns their tokens/s; the model
    and optimizer persist across calls, like the JAX steps' state in the benchmark."""
    torch.manual_seed(0)
    device = torch.device("cuda" if on_gpu and torch.cuda.is_available() else "cpu")
    model = Transformer(cfg.model).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.learning_rate, weight_decay=cfg.train.weight_decay)
    batch, seq_len = cfg.train.per_device_batch, cfg.data.seq_len
    stream = torch.randint(0, 256, (steps, batch, seq_len)).to(device)

    def finished():  # a GPU's steps run asynchronously: the clock stops when they are done
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(tokens):
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    step(stream[0])  # warm-up, as for the JAX steps' compilation
    finished()

    def run() -> float:
        started = time.perf_counter()
        for tokens in stream:
            step(tokens)
        finished()
        return steps * batch * (seq_len - 1) / (time.perf_counter() - started)

    return run
