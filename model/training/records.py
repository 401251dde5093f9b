"""The records a training run hands on, typed: what crosses the process boundary and lands
in manifests, history files and trackers. Plain Python (no JAX): the stages, flows and
command line read them without loading the ML stack."""

from __future__ import annotations

from typing import TypedDict


class HistoryEntry(TypedDict):
    """One logged step of the loss record (``history.json``, the trackers, the plots)."""

    step: int
    loss: float
    perplexity: float
    tokens: int  # trained on so far
    val_loss: float | None  # the whole validation split, at an evaluation step
    val_bpb: float | None  # bits per byte
    seconds: float  # trained so far, evaluations left out
