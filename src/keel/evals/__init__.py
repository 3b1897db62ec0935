"""Downstream evaluation: task scores for an in-memory model, next to the loss.

    tasks = keel.evals.resolve(["brackets", "identifiers", "lm_eval:path/to/task.yaml"])  # cheap: names only
    keel.evals.prepare(tasks, data_config, tokenizer)  # optional: generate the probes' items before training
    scores = keel.evals.score(model, tasks, data_config, tokenizer, max_items=200, device=device)
    # {"brackets": {"acc": 0.61, "acc_norm": 0.6, "n": 200, "chance": 0.25, "version": 1}, ...}

Built-in probes (`PROBES`: brackets, indent, identifiers, next_line) are multiple choice with 4 choices (chance
0.25), cut from the validation split only and cached per corpus (`tasks`, `probes`); `lm_eval:<task>` runs an
lm-evaluation-harness task on the same model object (`harness`); `scoring` holds the log-likelihood scorer.
"""

from keel.evals.scoring import prepare, score
from keel.evals.tasks import PROBES, HarnessTask, Probe, Task, resolve

__all__ = ["PROBES", "HarnessTask", "Probe", "Task", "prepare", "resolve", "score"]
