"""Threads on a shared machine: the default is the physical cores within the affinity mask, `run.threads` is
applied before a command's work, printed and recorded, a busy machine gets a note (timings live in
benchmarks/cpu/threads, never here)."""

import json
import os

import pytest
import torch

from keel import runtime
from keel.cli import main


def test_default_threads_are_physical_cores_within_the_affinity_mask(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    usable = len(os.sched_getaffinity(0))
    assert 1 <= runtime.physical_cores() <= usable
    assert runtime.default_threads() == runtime.physical_cores()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # e.g. taskset -c 0, or a 1-CPU container
    assert runtime.default_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "64")  # the user's setting wins, within the usable CPUs
    assert runtime.default_threads() == 1


def test_physical_cores_count_hyper_threads_of_one_core_once(tmp_path, monkeypatch):
    """On a made-up /sys topology: 4 CPUs, two hyper-threads on each of 2 cores -> 2; the same core id on two
    packages is two cores; a CPU outside the affinity mask does not count; no topology -> one per usable CPU."""
    def topology(cpus: dict[int, tuple[int, int]]) -> None:
        for cpu, (package, core) in cpus.items():
            where = tmp_path / f"sys/devices/system/cpu/cpu{cpu}/topology"
            where.mkdir(parents=True, exist_ok=True)
            (where / "physical_package_id").write_text(f"{package}\n")
            (where / "core_id").write_text(f"{core}\n")
    monkeypatch.setattr(runtime, "Path", lambda path: tmp_path / str(path).lstrip("/"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    topology({0: (0, 0), 1: (0, 0), 2: (0, 1), 3: (0, 1)})
    assert runtime.physical_cores() == 2
    topology({2: (1, 0), 3: (1, 0)})  # cpus 2 and 3 on a second package, core id 0 there too
    assert runtime.physical_cores() == 2
    topology({2: (1, 0), 3: (1, 1)})
    assert runtime.physical_cores() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # taskset -c 0,1: one core's two threads
    assert runtime.physical_cores() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 7})  # cpu7 has no topology here
    assert runtime.physical_cores() == 3


@pytest.mark.slow  # over a second in tests/durations.json
def test_run_threads_is_applied_printed_and_recorded(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # restored after the test
    before = torch.get_num_threads()
    try:
        assert main(["train", "--preset", "tiny", "run.steps=2", "run.threads=1", "run.eval_every=0",
                     f"run.out_dir={tmp_path}", "run.name=t"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert "1 thread (run.threads)" in out
    run = tmp_path / "t"
    assert json.loads((run / "run.json").read_text())["torch_threads"] == 1
    assert "threads: 1" in (run / "config.yaml").read_text()


def test_a_busy_machine_gets_a_note_pointing_to_run_threads(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (40.0, 40.0, 40.0))
    assert "run.threads=1" in runtime.busy_note(threads=2)
    assert "run.threads=1" not in runtime.busy_note(threads=1)  # nothing left to lower
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    assert runtime.busy_note(threads=2) is None


def test_threads_refused_in_one_line(capsys):
    assert main(["train", "--preset", "tiny", "run.threads=-2"]) == 2
    assert "run.threads: got -2" in capsys.readouterr().err


def test_every_torch_command_sets_threads_before_its_work(monkeypatch):
    """The dispatcher applies run.threads (or the default) before calling the command."""
    calls = []
    monkeypatch.setattr(runtime, "set_threads", lambda n=0: calls.append(n) or 1)
    import keel.cli as cli

    monkeypatch.setattr(cli, "cmd_runs", lambda args: calls.append("work") or 0)
    monkeypatch.setattr(cli, "add_runs_command", lambda sub: sub.add_parser("runs").set_defaults(func=cli.cmd_runs))
    monkeypatch.setitem(cli._BUILDERS, "runs", cli.add_runs_command)
    assert main(["runs"]) == 0
    assert calls == [0, "work"]
