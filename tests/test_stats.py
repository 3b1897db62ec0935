"""The verdict statistics against closed forms, and sweeps shared by several processes."""

import math
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from keel.experiments import stats, store
from keel.experiments.sweep import Sweep, _claim
from keel_studies.frontier import FrontierConfig, analyse, classify, grow_grids, key


def test_paired_t_test_against_the_closed_form_for_two_degrees_of_freedom():
    # differences 1, 2, 3: mean 2, SD 1, t = 2 / (1 / sqrt 3); with 2 degrees of freedom the t distribution
    # has the closed form P(|T| > t) = 1 - t / sqrt(t^2 + 2)
    test = stats.paired([11.0, 12.0, 13.0], [10.0, 10.0, 10.0])
    t = 2 * math.sqrt(3)
    assert test["n"] == 3 and test["mean"] == 2.0 and test["sd"] == 1.0
    assert test["t"] == pytest.approx(t)
    assert test["p"] == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-9)
    # the 97.5% quantile of t(2) is sqrt(2) * q / sqrt(1 - q^2) with q = 2 * 0.975 - 1
    q = 0.95
    half = math.sqrt(2) * q / math.sqrt(1 - q * q) / math.sqrt(3)
    assert test["ci95"] == pytest.approx([2 - half, 2 + half], rel=1e-9)
    assert stats.verdict(test, "lower", "higher") == "inconclusive"  # p = 0.074: the old 2-SE rule said "beyond"


def test_a_verdict_needs_p_below_005_and_gives_the_sign():
    strong = stats.paired([1.0, 1.1, 0.9, 1.05, 0.95], [2.0, 2.0, 2.0, 2.0, 2.0])
    assert strong["p"] < 1e-4 and stats.verdict(strong, "lower", "higher") == "lower"
    assert stats.verdict(stats.paired([3.0, 3.1, 2.9], [1.0, 1.0, 1.0]), "lower", "higher") == "higher"


def test_no_test_is_possible_without_two_pairs_or_without_spread():
    assert stats.paired([1.0], [2.0])["p"] is None
    assert stats.paired([1.0, None, float("nan")], [2.0, 2.0, 2.0])["n"] == 1
    flat = stats.paired([2.0, 3.0], [1.0, 2.0])  # differences all 1: SD 0
    assert flat["p"] is None and stats.verdict(flat, "lower", "higher") == "inconclusive"
    assert "p=n/a" in stats.describe(flat)


def test_frontier_classes_and_verdicts_from_known_points():
    cfg = FrontierConfig(schemes=["pre_ln", "keel"], depths=[64, 1024], seeds=[0, 1, 2],
                         lrs={"pre_ln": [1e-3, 3e-3, 1e-2], "keel": [1e-3, 3e-3, 1e-2]})
    unigram = 3.3
    assert classify([2.7, 2.8, 2.75], unigram, cfg) == "learns"
    assert classify([3.25, 3.4, None], unigram, cfg) == "stuck"
    assert classify([2.7, 3.25, 2.8], unigram, cfg) == "between"
    loss = {("pre_ln", 64): [2.60, 2.62, 2.61], ("keel", 64): [2.58, 2.61, 2.60],
            ("pre_ln", 1024): [3.28, 3.27, 3.29], ("keel", 1024): [2.70, 2.75, 2.72]}
    points = {}
    for (s, d), losses in loss.items():
        for lr in cfg.grid(s, d):
            for seed, v in enumerate(losses):
                worse = 0.0 if lr == 1e-3 else 0.1  # the lowest LR is best on the select half
                points[f"{s}-{d}-lr{lr:g}-seed{seed}"] = {"select_loss": v + worse, "report_loss": v + worse,
                                                          "grad_bottom_over_top": 1.0}
    res = analyse(cfg, points, unigram)
    assert cfg.grid("keel", 1024) == [1e-3, 3e-3] and res["arms"]["keel-1024"]["lr"] == 1e-3
    assert res["frontier"] == {"pre_ln": 64, "keel": 1024}
    v = res["verdicts"]["pre_ln"]
    assert v["trains_where_x_does_not"] == [1024]
    # per seed: gap at 1024 = -0.58, -0.52, -0.57; gap at 64 = -0.02, -0.01, -0.01
    assert v["advantage_grows"]["mean"] == pytest.approx((-0.56 - 0.51 - 0.56) / 3)
    assert v["advantage_grows_verdict"] == "agrees (grows)"


def test_frontier_grows_an_edge_choice_until_interior_or_bound(tmp_path):
    # rule 22: select loss (log10 lr - log10 best)^2 per arm; Keel's best (3e-4) lies one step below its deep grid
    # {1e-3, 3e-3}, Pre-LN's (1e-6) far below: Keel's grid grows to an interior choice, Pre-LN's stops at its bound
    best = {"keel": 3e-4, "pre_ln": 1e-6}
    ran = []

    def job(scheme, depth, lr, seed):
        def point():
            ran.append((scheme, lr, seed))
            loss = 3.0 + (math.log10(lr) - math.log10(best[scheme])) ** 2
            return {"select_loss": loss + 0.01 * seed, "report_loss": loss, "grad_bottom_over_top": 1.0}
        return point

    cfg = FrontierConfig(schemes=["pre_ln", "keel"], depths=[1024], seeds=[0, 1], grow=2,
                         lrs={"pre_ln": [1e-3, 3e-3, 1e-2], "keel": [1e-3, 3e-3, 1e-2]})
    sweep = Sweep(tmp_path, FrontierConfig(schemes=cfg.schemes, depths=cfg.depths, seeds=cfg.seeds, lrs=cfg.lrs))
    points = sweep.run({key(s, 1024, lr, k): job(s, 1024, lr, k) for s in cfg.schemes for lr in cfg.grid(s, 1024)
                        for k in cfg.seeds}, "start")  # recorded without growth, as rule 15's points were
    grids = grow_grids(cfg, Sweep(tmp_path, cfg), points, job, cfg.schemes)
    assert grids["keel-1024"].describe() == {"values": [0.000111111, 0.000333333, 0.001, 0.003],
                                             "added": [0.000333333, 0.000111111], "bound": None}
    assert grids["pre_ln-1024"].describe()["bound"] == "low"  # two values added, still at the low edge
    res = analyse(cfg, points, 3.3, grids)
    assert res["arms"]["keel-1024"]["lr"] == 0.000333333 and res["arms"]["pre_ln-1024"]["lr"] == 0.000111111
    assert res["arms"]["keel-1024"]["lr_grid"]["added"] == [0.000333333, 0.000111111]
    assert len(ran) == len(set(ran)) == 2 * 2 * 4  # each point once: 2 schemes x 2 seeds x 4 LRs


@dataclass
class _Cfg:
    seeds: list = field(default_factory=lambda: [0])


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def test_two_processes_running_one_sweep_train_each_point_once(tmp_path):
    calls, lock = [], threading.Lock()

    def job(name):
        def run():
            with lock:
                calls.append(name)
            time.sleep(0.05)
            return {"name": name}
        return run
    points = {f"p{i}": job(f"p{i}") for i in range(8)}
    results = [None, None]

    def worker(i):
        results[i] = Sweep(tmp_path, _Cfg(), poll_seconds=0.01).run(points, f"worker {i}")
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(calls) == sorted(points)  # every point trained exactly once between the two
    # each point as its job returned it, plus how it ran (Sweep.execution)
    assert results[0] == results[1] == {k: {"name": k, "execution": {"compile": False, "threads": torch_threads(),
                                                                               "eager_fallbacks": 0}}
                                        for k in points}
    assert not list(tmp_path.glob("points/*.claim"))


def test_a_sweep_with_enough_hands_back_the_saved_points_before_training_and_stops_once_enough_is_done(tmp_path):
    ran = []

    def job(name):
        def run():
            ran.append(name)
            return {"name": name}
        return run
    sweep = Sweep(tmp_path, _Cfg(), poll_seconds=0.01)
    sweep.run({"b0": job("b0"), "b1": job("b1")}, "saved before")
    ran.clear()
    # arm a's points come first but are not saved; arm b's are: enough (an arm complete) holds before any training
    points = {"a0": job("a0"), "a1": job("a1"), "b0": job("b0"), "b1": job("b1")}
    arm_done = lambda done: {"a0", "a1"} <= done.keys() or {"b0", "b1"} <= done.keys()  # noqa: E731
    assert set(sweep.run(points, "sweep", enough=arm_done)) == {"b0", "b1"} and ran == []
    # without b, it trains a's two points and stops there: c's point is left to a later call
    points = {"a0": job("a0"), "a1": job("a1"), "c0": job("c0")}
    assert set(sweep.run(points, "sweep", enough=lambda done: {"a0", "a1"} <= done.keys())) == {"a0", "a1"}
    assert ran == ["a0", "a1"] and not store.exists(tmp_path / "points", "c0")
    assert set(sweep.run(points, "sweep")) == {"a0", "a1", "c0"} and ran == ["a0", "a1", "c0"]


def test_a_sweep_stops_between_points_when_its_signal_was_swallowed_by_a_finaliser(tmp_path, capsys, monkeypatch):
    """`keel experiment` killed just as a point finished: SIGTERM lands while Python frees that point's objects, in
    a `__del__`, whose KeyboardInterrupt Python only prints (the likely reason a real sweep trained on for an hour
    after SIGTERM). The sweep must stop before its next point, with keel's one line and exit 130, the finished
    point saved."""
    import os
    import signal

    from keel import runtime
    from keel.cli.support import INTERRUPTED_EXIT, run_interruptible

    class Held:  # what a finished point leaves behind; freeing it is where the signal arrives
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # Python runs the handler at the next bytecodes: inside __del__
                pass

    ran = []

    def job(name):
        def run():
            ran.append(name)
            if name == "first":
                Held()  # freed as run returns
            return {"name": name}
        return run

    def work():
        Sweep(tmp_path, _Cfg(), poll_seconds=0.01).run({k: job(k) for k in ("first", "second", "third")}, "sweep")
        return 0

    swallowed = []  # what Python could not raise (it prints these as "Exception ignored in ...")
    monkeypatch.setattr(sys, "unraisablehook", lambda u: swallowed.append(u.exc_type))
    runtime.PENDING_SIGNALS.clear()
    try:
        assert run_interruptible(work) == INTERRUPTED_EXIT
    finally:
        runtime.PENDING_SIGNALS.clear()
    assert swallowed == [KeyboardInterrupt] and capsys.readouterr().err == "keel: interrupted\n"
    assert ran == ["first"] and store.exists(tmp_path / "points", "first")
    assert not list(tmp_path.glob("points/*.claim"))


@pytest.mark.slow  # compiles
def test_each_point_compiles_from_an_empty_dynamo_cache_and_records_a_fallback(tmp_path):
    # one process runs many points: each new model's graphs would count against Dynamo's recompile limit, and
    # past it later points would run eagerly while recording compile=True
    import torch
    import torch._dynamo

    # torch's own patch: pytest's monkeypatch undoes a config module's attribute by deleting it (then hidden)
    with torch._dynamo.config.patch(recompile_limit=2, automatic_dynamic_shapes=False):
        _fallbacks_per_point(tmp_path)


def _fallbacks_per_point(tmp_path):
    import torch
    import torch._dynamo

    @torch.compile(backend="eager")
    def step(x):
        return x.sin() + 1

    def point(shapes):
        def run():
            for n in shapes:
                step(torch.ones(n))
            return {}
        return run
    points = {f"p{i}": point([2 * i + 1, 2 * i + 2]) for i in range(4)}  # two graphs each, eight in all
    points["greedy"] = point([20, 21, 22])  # three graphs in one point: over the limit of two by itself
    ran = Sweep(tmp_path, _Cfg(), poll_seconds=0.01).run(points, "sweep")
    assert [ran[f"p{i}"]["execution"]["eager_fallbacks"] for i in range(4)] == [0, 0, 0, 0]
    assert ran["greedy"]["execution"]["eager_fallbacks"] == 1
    torch._dynamo.reset()


def test_a_claim_of_a_dead_process_is_taken_over_and_a_live_one_respected(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    claim = tmp_path / "p.claim"
    claim.write_text(f"{socket.gethostname()} {dead.pid}")
    assert _claim(claim) and claim.read_text().split()[1] != str(dead.pid)
    claim.write_text(f"{socket.gethostname()} {subprocess.os.getppid()}")  # a live process
    assert not _claim(claim)
    claim.write_text("another-host 1")  # cannot be checked from here: respected
    assert not _claim(claim)


@pytest.mark.skipif(not Path("/proc/uptime").exists(), reason="boot time from Linux's /proc")
def test_a_claim_written_before_this_machine_booted_is_taken_over(tmp_path):
    from keel.experiments import sweep

    uptime = float(Path("/proc/uptime").read_text().split()[0])
    assert abs(sweep._boot_time() - (time.time() - uptime)) < 2  # /proc/stat's btime against /proc/uptime
    claim = tmp_path / "p.claim"
    claim.write_text(f"{socket.gethostname()} {os.getppid()}")  # a live pid: after a reboot, another process's
    assert not _claim(claim)
    os.utime(claim, (sweep._boot_time() - 30,) * 2)  # within the slack for a clock stepped after boot
    assert not _claim(claim)
    os.utime(claim, (sweep._boot_time() - 120,) * 2)
    assert _claim(claim) and claim.read_text() == f"{socket.gethostname()} {os.getpid()}"
    # releasing a claim another process has since taken over leaves that process's claim in place
    claim.write_text("vm-elsewhere 1")
    sweep._release(claim)
    assert claim.read_text() == "vm-elsewhere 1"
    claim.write_text(f"{socket.gethostname()} {os.getpid()}")
    sweep._release(claim)
    assert not claim.exists()


def _race_claims(claim, roots: list[str], rounds: int, barrier, won) -> None:
    """One racer: in each round of each root wait for the others, then all try `claim` on the same path at once."""
    mine = []
    for root in roots:
        for r in range(rounds):
            barrier.wait()
            if claim(Path(root) / f"r{r}.claim"):
                mine.append((root, r))
    won.put(mine)


@pytest.mark.slow
def test_a_point_raced_by_several_processes_is_claimed_by_exactly_one_each_time(tmp_path):
    # four processes released together onto one path, 200 times with nothing there and 200 times onto a dead owner's
    # claim (one set of processes for both: each spawned racer imports torch); no one releases a claim during a
    # round, so each round has exactly one winner, also when a dead owner's claim is there to take over (without
    # the lock on the directory two racers both judged it dead and both won: 45-126 of 200 rounds). Creating the
    # claim exclusively and writing it afterwards let a racer read it empty, take it for a dead owner's and win too
    # (3 to 133 rounds of 200 had two winners, in three trials)
    import multiprocessing

    ctx, n, rounds = multiprocessing.get_context("spawn"), 4, 200
    roots = [tmp_path / "nothing", tmp_path / "dead"]
    for root in roots:
        root.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for r in range(rounds):
        (roots[1] / f"r{r}.claim").write_text(f"{socket.gethostname()} {dead.pid}")
    barrier, won = ctx.Barrier(n, timeout=120), ctx.Queue()
    procs = [ctx.Process(target=_race_claims, args=(_claim, [str(r) for r in roots], rounds, barrier, won))
             for _ in range(n)]
    for p in procs:
        p.start()
    wins = [w for _ in procs for w in won.get(timeout=300)]
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0] * n
    for root in roots:  # every round won once: none twice, none by no one
        assert sorted(r for where, r in wins if where == str(root)) == list(range(rounds)), root.name
        assert sorted(q.name for q in root.iterdir()) == sorted(f"r{r}.claim" for r in range(rounds))  # no temp file


def test_an_empty_claim_is_respected_while_fresh_and_taken_over_once_stale(tmp_path):
    # an empty claim is one being written (or one an older keel created before writing it): not a dead owner's
    claim = tmp_path / "p.claim"
    claim.write_text("")
    assert not _claim(claim) and claim.read_text() == ""
    old = time.time() - 3600
    os.utime(claim, (old, old))
    assert _claim(claim) and claim.read_text() == f"{socket.gethostname()} {os.getpid()}"


def test_holm_adjusts_step_down_as_written_out():
    from keel.experiments.stats import holm

    # sorted 0.01, 0.03, 0.04: x3 = 0.03, x2 = 0.06, x1 = 0.04 -> running max 0.06; None stays out of the family
    assert holm([0.01, 0.04, None, 0.03]) == pytest.approx([0.03, 0.06, None, 0.06])
    assert holm([0.6, 0.7]) == [1.0, 1.0]


def test_a_grid_grows_past_an_edge_choice_by_the_same_factor_until_interior_or_bound():
    from keel.experiments.grid import Grid

    loss = {1e-3: 2.0, 3e-3: 2.1, 1e-2: 2.5}  # best at the low edge
    grid = Grid([3e-3, 1e-3, 1e-2], max_extensions=2)
    new = grid.extend(loss.get)
    assert new == pytest.approx(1e-3 / 3, rel=1e-5) and grid.values[0] == new
    loss[new] = 1.9  # still improving: grows once more, then the bound
    newer = grid.extend(loss.get)
    assert newer == pytest.approx(1e-3 / 9, rel=1e-4)
    loss[newer] = 1.8
    assert grid.extend(loss.get) is None and grid.bound == "low" and grid.choice(loss.get) == newer
    top = Grid([1e-3, 1e-2], max_extensions=1)
    assert top.extend({1e-3: 3.0, 1e-2: 2.0}.get) == pytest.approx(1e-1)
    assert top.extend({1e-3: 3.0, 1e-2: 2.0, 1e-1: float("nan")}.get) is None and top.bound is None  # interior
