"""keel.evals under torch.distributed: two gloo processes split the items and give the score one process gives."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from keel import evals
from keel.data import DataConfig
from keel.data.tokenizer import ByteTokenizer

pytestmark = pytest.mark.distributed

MAX_ITEMS = 31  # odd: the ranks get 16 and 15, and rank 1 runs one uncounted pass


def names(task_yaml: str | None) -> list[str]:
    return ["brackets", "next_line", "identifiers"] + ([f"lm_eval:{task_yaml}"] if task_yaml else [])


def _worker(rank: int, port: int, data: dict, task_yaml: str | None, out: str) -> None:
    from test_evals import tiny

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        scores = evals.score(tiny(), evals.resolve(names(task_yaml)), DataConfig(**data), ByteTokenizer(),
                             max_items=MAX_ITEMS, device="cpu")
        Path(out, f"rank{rank}.json").write_text(json.dumps(scores))
        dist.barrier()  # every rank done before any tears its group down
    finally:
        dist.destroy_process_group()


def test_two_processes_give_the_score_of_one(tmp_path, spawn):
    from mc_task import write_local_task
    from test_evals import tiny, write_corpus

    task_yaml = None
    try:
        import lm_eval  # noqa: F401

        task_yaml = write_local_task(tmp_path / "tasks")
    except ImportError:
        pass
    data = DataConfig(source=str(write_corpus(tmp_path / "corpus")), val_fraction=0.25,
                      cache_dir=str(tmp_path / "cache"))
    tasks = evals.resolve(names(task_yaml))
    one = evals.score(tiny(), tasks, data, ByteTokenizer(), max_items=MAX_ITEMS, device="cpu")
    spawn(_worker, vars(data), task_yaml, str(tmp_path), forkserver=True)
    two = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    print(f"one process {one}\ntwo processes {two[0]}")
    assert two[0] == two[1] == json.loads(json.dumps(one))
    assert all(s["n"] == (8 if name.startswith("lm_eval:") else MAX_ITEMS) for name, s in one.items())
    # the score is not trivially equal: an untrained model is wrong on some items and right on others
    assert all(0 < s["acc"] < 1 for name, s in one.items() if not name.startswith("lm_eval:"))
