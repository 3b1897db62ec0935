"""Shared fixtures and the test tiers.

Tiers (markers, registered in pyproject.toml):
  slow         takes about a second or more (training runs, subprocesses, compiles, quick experiments)
  distributed  starts several processes (torchrun, gloo on CPU)
  gpu          needs CUDA; skipped where there is none
`python -m pytest -q` runs the fast tier (neither slow nor distributed); `python -m pytest -q -m "not gpu"`
runs everything that runs on a CPU, as CI does; `python -m pytest -q -m gpu` on a GPU machine.
"""

from __future__ import annotations

import faulthandler
import gc
import inspect
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# One torch thread per test process (set before torch loads, so OpenMP reads it too, and inherited by the tests'
# subprocesses). Under pytest-xdist (CI's `-n 2`) each worker is one of two processes on two cores, and a worker's
# thread pool would oversubscribe the cores the other is using; in one process the tests' models are so small that a
# second thread costs more in hand-offs than it saves (the fast tier on 2 idle cores at 331ffdb: 94.2 s with torch's
# two threads, 76.7 s with one).
os.environ["OMP_NUM_THREADS"] = "1"
# before torch, as the `keel` command does: torch's idle OpenMP threads sleep (OMP_WAIT_POLICY=passive, inherited by
# the tests' subprocesses). With them spinning, the fast tier took 497 s, not 133 s, on 2 cores at load 3 to 4.
from keel.launch import launcher_environment

launcher_environment()

# isort: split
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # in case a plugin loaded torch before this file

# cuBLAS is deterministic only with a fixed workspace, read when its handle is made: set before any CUDA use
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# The project's CPU suite and GPU campaign are scripts in benchmarks/ that import their siblings by name (running a
# script puts its folder on the path): their tests import them the same way
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS / "gpu"), str(BENCHMARKS / "cpu")]
# each collected test's tier markers (tests/test_test_tiers.py reads them against the committed durations)
COLLECTED = pytest.StashKey[dict]()
# keel signs the run configs it writes with a per-user key (keel.runs.trust): one key for the test session,
# shared with its subprocesses, never the user's ~/.config/keel. Each xdist worker makes its own: two processes that
# create one key at once can read it before it is written.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["KEEL_CONFIG_DIR"] = tempfile.mkdtemp(prefix="keel-config-")
os.environ.setdefault("KEEL_CONFIG_DIR", tempfile.mkdtemp(prefix="keel-config-"))


TIERS = ("slow", "distributed", "gpu")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every collected test's tier markers
def pytest_collection_modifyitems(config, items):
    config.stash[COLLECTED] = {item.nodeid: {m.name for m in item.iter_markers() if m.name in TIERS}
                               for item in items}
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `--dist loadfile` hands out files in this order: longest first
        seconds = json.loads((Path(__file__).parent / "durations.json").read_text())["files"]
        order = {path: i for i, path in enumerate(dict.fromkeys(item.nodeid.split("::")[0] for item in items))}
        items.sort(key=lambda item: (-seconds.get(p := item.nodeid.split("::")[0], 0.0), order[p]))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Everything collection made (torch, transformers, every test module: about half a million objects) is frozen
    out of Python's full collections, as a caller of keel.train.trainer may do: each Trainer.run and each bench
    model's release collects in full, which walked all of it (about a quarter of tests/test_train.py's time). What
    the tests make after this is collected as before; tests/test_train.py thaws it where it checks the run's own
    freeze."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # the interpreter's own clean-up at exit sees everything again (nanobind reports leaks if not)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No test reaches a network or writes outside its tmp_path: Hugging Face offline, caches redirected."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))  # remote code lands here
    monkeypatch.setenv("KEEL_CACHE", str(tmp_path / "env-cache"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """About 150 KB of real text: the source of a few standard-library modules."""
    import argparse
    import json
    import pathlib

    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(inspect.getsource(m) for m in (argparse, json.decoder, pathlib)))
    return path


@pytest.fixture
def args(corpus, tmp_path):
    """`keel train` overrides for a run named `name` on the corpus, everything under tmp_path."""
    def make(*extra, name="run"):
        return [f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}", f"run.out_dir={tmp_path / 'runs'}",
                f"run.name={name}", *extra]
    return make


@pytest.fixture
def make_run():
    """A run directory as the trainer leaves it (config.yaml, tokenizer/, one checkpoint), random weights."""
    from keel.config import RunConfig, TrainConfig, to_yaml
    from keel.data.corpus import DataConfig
    from keel.data.tokenizer import ByteTokenizer
    from keel.model import ModelConfig, TransformerLM
    from keel.runs import checkpoint

    def make(run_dir: Path, scheme: str = "keel", tokenizer=None, **model) -> TransformerLM:
        tokenizer = tokenizer or ByteTokenizer()
        config = ModelConfig(vocab_size=max(256, tokenizer.vocab_size), d_model=32, n_blocks=3, n_heads=4,
                             n_kv_heads=2, max_seq_len=64, init_std=0.3, scheme=scheme, **model)
        run_dir.mkdir(parents=True)
        source = "bytes" if isinstance(tokenizer, ByteTokenizer) else str(tokenizer.path)
        (run_dir / "config.yaml").write_text(to_yaml(TrainConfig(model=config, data=DataConfig(tokenizer=source),
                                                                 run=RunConfig(seq_len=32))))
        tokenizer.save(run_dir / "tokenizer")
        torch.manual_seed(0)
        m = TransformerLM(config).eval()
        with torch.no_grad():  # non-trivial norm gains, so a misplaced or missing norm shows
            for p in m.parameters():
                if p.dim() == 1:
                    p.uniform_(0.5, 1.5)
        checkpoint.save(run_dir, 7, m, {}, {}, keep=1)
        return m
    return make


def _traced(rank: int, worker, port: int, *args) -> None:
    """`worker` in a spawned process with faulthandler on: if C++ aborts it (SIGABRT), the test's captured
    stderr gets every thread's Python stack, not only the signal's name."""
    faulthandler.enable(all_threads=True)
    worker(rank, port, *args)


def _traced_in(rank: int, env: dict, worker, port: int, *args) -> None:
    """`_traced` in a process forked from the forkserver, with the environment the test has now (a spawned process
    gets it at its start; the forkserver's children would have the one of the test that started the server)."""
    os.environ.clear()
    os.environ.update(env)
    _traced(rank, worker, port, *args)


# what the forkserver imports once, before it forks: what each rank would otherwise import again (about 3.5 CPU s a
# rank). Nothing here reads the test's environment at import beyond what conftest fixes for the whole session.
FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor",
                      "torch.distributed.checkpoint", "torch.distributed.pipelining"]


@pytest.fixture(scope="session")
def spawn():
    """`spawn(worker, *args, nprocs=2)`: run `worker(rank, port, *args)` in `nprocs` fresh processes (a free
    local port for their process group) and wait for all of them; a hung worker is killed at `timeout`.

    `forkserver=True`: the processes are forked from multiprocessing's forkserver (a fresh interpreter, started once
    per test process, that has imported torch and its distributed packages: FORKSERVER_PRELOAD) instead of each
    starting a new interpreter that imports them again; each is still a process of its own, with the test's
    environment at the call."""
    import multiprocessing

    import torch.multiprocessing as mp

    def run(worker, *args, nprocs: int = 2, timeout: float = 300, forkserver: bool = False):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if forkserver:
            multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
            context = mp.start_processes(_traced_in, args=(dict(os.environ), worker, port, *args), nprocs=nprocs,
                                         join=False, start_method="forkserver")
        else:
            context = mp.start_processes(_traced, args=(worker, port, *args), nprocs=nprocs, join=False,
                                         start_method="spawn")
        deadline = time.monotonic() + timeout
        try:  # each join returns when some worker ends (raising if it failed): wait for all, up to the deadline
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    pytest.fail(f"{worker.__name__}: workers still running after {timeout:g} s (killed)")
        finally:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
    return run


@pytest.fixture(scope="session")
def torchrun():
    """`torchrun(module, *args, nproc=2)`: `python -m torch.distributed.run ... -m module *args`, one thread per
    process; asserts it exits 0 and returns the completed process."""
    def run(module: str, *args: str, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
               "-m", module, *args]
        # the repository root on the path: a module of benchmarks/ runs as `-m benchmarks.cpu...` from any folder
        path = os.pathsep.join(filter(None, [str(BENCHMARKS.parent), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "PYTHONPATH": path}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        return out
    return run


@pytest.fixture
def one_rank():
    """A one-process gloo group, enough for DCP's collectives and `save_sharded`."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A real `keel train --preset tiny` run with checkpoints at steps 3 and 6 (copy it before changing it)."""
    import argparse

    from keel.cli import main

    tmp = tmp_path_factory.mktemp("trained")
    (tmp / "corpus.txt").write_text(inspect.getsource(argparse))
    assert main(["train", "--preset", "tiny", f"data.source={tmp / 'corpus.txt'}", f"data.cache_dir={tmp / 'cache'}",
                 f"run.out_dir={tmp / 'runs'}", "run.name=run", "run.steps=6", "run.ckpt_every=3",
                 "run.progress=false"]) == 0
    return tmp / "runs" / "run"


@pytest.fixture(scope="session")
def tiny_two_step_run(corpus, tmp_path_factory) -> Path:
    """damage.tiny_run for 2 steps with its checkpoint and an evaluation at step 2, on `corpus` with its token cache
    outside the run (runs/base under a folder of its own; cache/ beside runs/): the run that tests/hostile/'s
    test_run_dir, test_untrusted_inputs and test_trust each trained alike, made once. Tests copy it (damage.victim)
    before changing it; one that edits its cache in place restores it."""
    from damage import tiny_run

    return tiny_run(tmp_path_factory.mktemp("trained"), corpus, "run.steps=2", "run.ckpt_every=2", "run.eval_every=2")


@pytest.fixture
def trainer_for(args):
    """A `Trainer` on the tiny preset for a run named `name` under `args`' directories, with `extra` overrides."""
    from keel.config import load_config
    from keel.train.trainer import Trainer

    def make(*extra, name="run", callbacks=()):
        config = load_config(args(*extra, name=name), preset="tiny")
        return Trainer(config, Path(config.run.out_dir) / config.run.name, callbacks)
    return make


@pytest.fixture
def no_curves(monkeypatch):
    """Trainer.run without drawing curves.png at its end (in this process): the plot is about half of a tiny run's
    time, for tests that check something else. curves.png itself is checked by tests/test_runs.py,
    tests/test_interrupts.py, tests/test_eval_tasks.py and tests/test_plot_readable.py."""
    from keel.train.trainer import Trainer

    monkeypatch.setattr(Trainer, "draw_curves", lambda self, quiet=False: None)


# seconds one training step takes on the fake clock, per sub-layer, by scheme
COST_PER_SUBLAYER = {"keel": 0.05, "pre_ln": 0.04, "deepnorm": 0.06}


class Seen(list):
    """What the fake clock saw, one entry per step."""


@pytest.fixture
def fake_clock(monkeypatch):
    """keel.bench.core.clock reads a fake time that only a training step advances: n_sublayers x
    COST_PER_SUBLAYER[scheme] seconds, plus `seen.overhead(model config, call)` where a test sets one (`call`: 1 for
    a TrainStep's first step). Returns what each step saw: its TrainStep, the batch, the lr and the autocast context."""
    from keel.bench import core
    from keel.train.step import TrainStep

    now, seen = [0.0], Seen()
    real = TrainStep.__call__

    def timed(self, next_batch, lr):
        batch = next_batch()
        seen.append({"step": self, "batch": batch, "lr": lr, "autocast": self.autocast()})
        result = real(self, lambda: batch, lr)
        config = self.model.config
        now[0] += COST_PER_SUBLAYER[config.scheme] * config.n_sublayers
        if hasattr(seen, "overhead"):
            now[0] += seen.overhead(config, sum(e["step"] is self for e in seen))
        return result
    monkeypatch.setattr(TrainStep, "__call__", timed)
    monkeypatch.setattr(core, "clock", lambda: now[0])
    return seen
