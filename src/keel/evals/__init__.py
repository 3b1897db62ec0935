"""Downstream evaluation: task scores for an in-memory model, next to the loss (`resolve`, `prepare`, `score`;
usage: docs/internals.md#keelevals). The task names need no torch; `prepare` and `score` load it."""

from keel._lazy import lazy_names
from keel.evals.tasks import PROBES, HarnessTask, Probe, Task, resolve

__getattr__, __dir__, _LAZY = lazy_names(__name__, {"scoring": ("prepare", "score")})
__all__ = ["PROBES", "HarnessTask", "Probe", "Task", "resolve", *_LAZY]
