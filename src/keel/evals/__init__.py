"""Downstream evaluation: task scores for an in-memory model, next to the loss.

    tasks = keel.evals.resolve(["brackets", "identifiers", "lm_eval:path/to/task.yaml"])  # cheap: names only
    keel.evals.prepare(tasks, data_config, tokenizer)  # optional: generate the probes' items before training
    scores = keel.evals.score(model, tasks, data_config, tokenizer, max_items=200, device=device)
    # {"brackets": {"acc": 0.61, "acc_norm": 0.6, "n": 200, "chance": 0.25, "version": 1}, ...}

Built-in probes (`PROBES`: brackets, indent, identifiers, next_line) are multiple choice with 4 choices (chance
0.25), cut from the validation split only and cached per corpus (`tasks`, `probes`); `lm_eval:<task>` runs an
lm-evaluation-harness task on the same model object (`in_memory_lm`); `scorer` holds the log-likelihood scorer.
The task names need no torch (`tasks`), so a config naming an unknown task is refused without its import;
`prepare` and `score` load `scoring` (and torch) on first use.
"""

from keel._lazy import lazy_names
from keel.evals.tasks import PROBES, HarnessTask, Probe, Task, resolve

__getattr__, __dir__, _LAZY = lazy_names(__name__, {"scoring": ("prepare", "score")})
__all__ = ["PROBES", "HarnessTask", "Probe", "Task", "resolve", *_LAZY]
