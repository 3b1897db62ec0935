"""run.eval_tasks scored during training (keel.evals), logged as one record and one line per evaluation, training
going on as if nothing had been scored (docs/internals.md#keeltraintask_eval)."""

from __future__ import annotations

import time

from keel import evals
from keel.reporting.tables import flat_scores, task_line


def score_tasks(trainer, bar) -> tuple[dict[str, dict], float]:
    """Score `trainer`'s tasks on every rank (keel.evals splits the items), log the scores (rank 0 prints a
    line); returns (scores, seconds)."""
    c = trainer.config
    start = time.time()
    scores = evals.score(trainer.model, trainer.eval_tasks, c.data, trainer.data.tokenizer,
                         max_items=c.run.eval_tasks_items, device=trainer.device, autocast=trainer.autocast)
    seconds = time.time() - start
    trainer.log({"step": trainer.step, **flat_scores(scores), "eval_tasks_seconds": seconds})
    if trainer.world.main:
        bar.write(task_line(trainer.step, scores, seconds))
    return scores, seconds
