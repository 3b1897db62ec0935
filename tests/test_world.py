"""One answer to "which rank am I" (keel.scale.distributed.current): the process group's, else torchrun's
environment, else the single process; the scorer and the command line ask it."""

from keel.evals.scorer import world
from keel.scale.distributed import World, current


def test_outside_torchrun_this_is_the_single_main_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert current() == World(0, 1, 0) and current().main and world() == (0, 1)


def test_under_torchrun_before_the_group_starts_the_environment_says(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert current() == World(3, 4, 1) and not current().main and world() == (3, 4)
