"""lm-evaluation-harness tasks scored on the in-memory model, without exporting it, tokenised as the harness's own
`HFLM` does (docs/internals.md#keelevalsin_memory_lm)."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist

from keel.errors import ConfigError, optional
from keel.evals.scorer import Scorer, world
from keel.evals.tasks import HarnessTask


def find_tasks(tasks: list[str], include_path: str | None):
    """(a harness TaskManager that knows `tasks`, the names it does not know). With an include path the
    harness's own thousands of task files are indexed (~20 s) only when the path does not hold every task."""
    from lm_eval.tasks import TaskManager

    manager = None
    if include_path:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if not all(manager.match_tasks([t]) for t in tasks):
            manager = None
    manager = manager or TaskManager(include_path=include_path)
    return manager, [t for t in tasks if not manager.match_tasks([t])]


def fetch_failure(err: BaseException) -> str | None:
    """Why a task's data could not be fetched (offline, no network, not on the Hub), or None when `err` is
    something else: the harness downloads a task's data set on first use and fails deep inside `datasets`."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        names = {t.__name__ for t in type(err).__mro__}
        if isinstance(err, ConnectionError) or names & {"OfflineModeIsEnabled", "LocalEntryNotFoundError",
                                                        "DatasetNotFoundError", "ConnectionError"}:
            return str(err).splitlines()[0] if str(err) else type(err).__name__
        err = err.__cause__ or err.__context__
    return None


def fetch_message(field: str, tasks, reason: str) -> str:
    return (f"{field}: cannot fetch the data of {', '.join(map(repr, tasks))} from the Hugging Face Hub: "
            f"{reason}; run once with a network connection to cache it, or write a task YAML over local "
            "files and pass its directory with --include-path DIR "
            "(docs/ecosystem.md#hugging-face-transformers-and-lm-evaluation-harness)")


def score_harness(scorer: Scorer, task: HarnessTask, max_items: int) -> dict:
    """The harness's accuracy on `task` (at most `max_items` documents); `chance` is the mean of 1 / (number
    of choices) over its documents when every document is multiple choice, else None."""
    LM = optional("lm_eval.api.model", "eval", "run.eval_tasks (lm_eval tasks)").LM
    from lm_eval import simple_evaluate

    class InMemoryLM(LM):
        """Requests grouped by document (all of a document's choices in one forward pass, the grouping the
        probes use too), the groups split over ranks and the results summed, so every rank sees all of them."""

        def __init__(self):
            super().__init__()
            self.choices = defaultdict(list)  # harness task name -> choices per document

        def loglikelihood(self, requests):
            groups = defaultdict(list)
            for i, req in enumerate(requests):
                groups[(req.task_name, req.doc_id)].append(i)
            for (name, _), members in groups.items():
                self.choices[name].append(len(members))
            groups = list(groups.values())
            pairs = [_encode_like_hflm(scorer, *req.args) for req in requests]
            results = torch.zeros(len(requests), 2, dtype=torch.float64)
            rank, size = world()
            mine = groups[rank::size]
            for j in range(math.ceil(len(groups) / size)):
                members = mine[j] if j < len(mine) else groups[0]  # an uncounted pass keeps ranks in step
                scored = scorer.loglikelihoods([pairs[i] for i in members])
                if j < len(mine):
                    results[members] = torch.tensor(scored, dtype=torch.float64)
            if size > 1:
                results = results.to(scorer.device)
                dist.all_reduce(results)
            return [(ll, bool(greedy)) for ll, greedy in results.cpu().tolist()]

        def loglikelihood_rolling(self, requests):
            raise ConfigError(f"{task.name}: perplexity (loglikelihood_rolling) tasks are not supported in training; "
                              "use keel lm-eval")

        def generate_until(self, requests):
            raise ConfigError(f"{task.name}: generation tasks are not supported in training; use keel lm-eval")

    manager, unknown = find_tasks([task.task], task.include_path)
    if unknown:
        where = f" (looked in {task.include_path})" if task.include_path else ""
        raise ConfigError(f"run.eval_tasks: unknown lm-evaluation-harness task {task.task!r}{where}")
    lm = InMemoryLM()
    # bootstrap_iters=0: no resampling for standard errors (it would cost time, and acc needs none)
    try:
        results = simple_evaluate(model=lm, tasks=[task.task], task_manager=manager, limit=max_items,
                                  log_samples=False, bootstrap_iters=0)
    except Exception as err:
        reason = fetch_failure(err)
        if reason is None:
            raise
        raise ConfigError(fetch_message("run.eval_tasks", [task.task], reason)) from None
    per_task = results["results"]
    name = task.task if task.task in per_task else next(iter(per_task))
    metrics = {k.split(",")[0]: v for k, v in per_task[name].items() if isinstance(v, (int, float))
               and not k.split(",")[0].endswith("_stderr")}
    counts = lm.choices.get(name, [])
    chance = sum(1 / k for k in counts) / len(counts) if counts and min(counts) > 1 else None
    n = results.get("n-samples", {}).get(name, {}).get("effective", len(counts))
    return {"acc": metrics.get("acc"), "n": n, "chance": chance, "metrics": metrics}


def _encode_like_hflm(scorer: Scorer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """HFLM's `_encode_pair`: trailing spaces of the context move into the continuation, the continuation's
    tokens are the whole text's after the context's, and an empty context is the prefix token."""
    if not context:
        return [scorer.prefix], list(scorer.tokenizer.encode(continuation))
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = list(scorer.tokenizer.encode(context + continuation)), list(scorer.tokenizer.encode(context))
    return ctx, whole[len(ctx):]
