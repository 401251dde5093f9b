"""Log-probabilities of given bytes under the served model: what the completions API returns
for ``logprobs`` and ``echo`` (and what evaluation tools such as lm-evaluation-harness read).

One float32 pass over a text of at most the model's context plus one byte, as a training
evaluation reads it (``model/training/step.py``: ``target_losses``): byte ``i`` scored from the
bytes before it. Texts are padded to a few lengths, so that a handful of programs serve any
text; the model is causal, so the padding changes nothing before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..model.inference.sampling import matmul_precision
from .limits import ServingError
from .shapes import buckets
from .tokens import as_ids

MOST_ALTERNATIVES = 5  # OpenAI's completions API: logprobs is at most 5


@dataclass(frozen=True)
class Scores:
    """For bytes 1 .. n - 1 of a text: each byte's log-probability given those before it, and
    the ``MOST_ALTERNATIVES`` likeliest bytes there with theirs (most likely first)."""

    logprobs: np.ndarray  # (n - 1,) float32
    top_bytes: np.ndarray  # (n - 1, MOST_ALTERNATIVES) int32
    top_logprobs: np.ndarray  # (n - 1, MOST_ALTERNATIVES) float32


class Scorer:
    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, window: int):
        self.graphdef, self.params, self.window = graphdef, params, window
        self._score = matmul_precision(jax.jit(self._pass), "highest")

    def longest(self) -> int:
        """The longest text it scores: the context, and one byte more that is only a target."""
        return self.window + 1

    def check(self, prompt: int, new: int) -> None:
        """Refuses, in one line, a prompt of ``prompt`` bytes and ``new`` more to score that do not fit."""
        if prompt + new > self.longest():
            raise ServingError(
                f"log-probabilities are computed over one context: prompt ({prompt} bytes) + max_tokens ({new}) "
                f"is over this model's {self.longest()}; shorten the prompt or lower max_tokens"
            )

    def score(self, data: bytes | list[int]) -> Scores:
        """The scores of a text's tokens: a byte model's bytes, or ids."""
        self.check(len(data), 0)
        length = next(size for size in buckets(self.window) if size >= min(len(data), self.window))
        padded = np.zeros((1, length + (len(data) > self.window)), np.int32)
        padded[0, : len(data)] = as_ids(data)
        logprobs, top_bytes, top_logprobs = jax.device_get(self._score(self.params, padded))
        n = len(data) - 1
        return Scores(logprobs[:n], top_bytes[:n], top_logprobs[:n])

    def _pass(self, params, tokens):
        model = nnx.merge(self.graphdef, params)
        inputs = tokens if tokens.shape[1] <= self.window else tokens[:, :-1]
        logits = model(inputs)[0][0, : tokens.shape[1] - 1].astype(jnp.float32)
        every = jax.nn.log_softmax(logits)
        chosen = jnp.take_along_axis(every, tokens[0, 1:, None], axis=-1)[:, 0]
        top_logprobs, top_bytes = jax.lax.top_k(every, MOST_ALTERNATIVES)
        return chosen, top_bytes, top_logprobs
