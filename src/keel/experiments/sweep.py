"""Sweep bookkeeping: each point trained once, kept on disk, shared by processes, never mixed with others."""

from __future__ import annotations

import contextvars
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from keel import runtime, safe_io
from keel.errors import ConfigError
from keel.experiments import store
from keel.experiments.partial import discard, keeping_progress_in

# how a point is computed, not what: compiled and eager agree to float32 tolerance (tests/test_experiments.py), so a
# sweep recorded with one may be continued with the other (every point records its own: `Sweep.execution`)
EXECUTION_FIELDS = ("run.compile", "run.threads")
# fields that only add points (points are named by their values; a config's class may name more: `ADDS_POINTS`): a
# sweep recorded with other values is continued, its points reused
ADDS_POINTS = ("seeds",)


def adds_points(config) -> tuple[str, ...]:
    """The fields of `config` that only add points: ADDS_POINTS and its class's own `ADDS_POINTS`."""
    return (*ADDS_POINTS, *getattr(type(config), "ADDS_POINTS", ()))


def _eager_fallbacks() -> int:  # frames Dynamo gave up compiling (recompile limit) in the point just run
    from torch._dynamo.utils import counters

    return sum(n for k, n in counters["unimplemented"].items() if "recompile limit" in k.lower())


def _fresh_compile(fn: Callable[[], dict]) -> dict:
    # from an empty Dynamo cache: earlier points' models would count against its recompile limit (then run eagerly)
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return fn()


_REPORT_ONLY = contextvars.ContextVar("report_only", default=False)


@contextmanager
def report_only(on: bool = True):
    """While open (and `on`), a sweep trains nothing: a point not on disk is a ConfigError naming it, raised
    before any point runs. `keel sweep --report-only` rebuilds a study's report from its committed points."""
    token = _REPORT_ONLY.set(on)
    try:
        yield
    finally:
        _REPORT_ONLY.reset(token)


@dataclass
class Sweep:
    """Runs named points once each, each kept on disk as soon as it is done. The directory records the config, so
    points of another configuration are never reused; only `ADDS_POINTS` may differ (points are named by their seed:
    added seeds run only the new points) and `EXECUTION_FIELDS` (each point records its own `execution`). Several
    processes may run one sweep: each point is claimed by one (`_claim`), the others wait for it; a running point may
    keep its progress in `<key>.partial` (keel.experiments.partial) for the process that next claims it."""

    out: Path
    config: object
    poll_seconds: float = 30.0

    def execution(self) -> dict:
        """How this process computes its points (recorded in each; a point without it ran eager)."""
        run = getattr(self.config, "run", None)  # a sweep of another config (tests) records only the threads
        return {"compile": bool(getattr(run, "compile", False)), "threads": torch.get_num_threads(),
                "eager_fallbacks": _eager_fallbacks()}

    def run(self, points: dict[str, Callable[[], dict]], desc: str,
            enough: Callable[[dict[str, dict]], bool] | None = None) -> dict[str, dict]:
        """Every point of `points` done (here, by another process, or found on disk), keyed as given. With `enough`,
        returns once `enough(done so far)` holds, the rest left to a later call (grid.run_searches: arms advance
        independently)."""
        # a `points` link (or file) planted in the output directory is refused, never written through
        folder = safe_io.check_dir(self.out, self.out / "points")
        if not _REPORT_ONLY.get():  # --report-only writes nothing, not even the config it would record
            folder.mkdir(parents=True, exist_ok=True)
        recorded, mine = self.out / "points" / "config.json", json.loads(json.dumps(asdict(self.config)))
        theirs = json.loads(recorded.read_text()) if recorded.exists() else None
        if theirs is not None:
            changed = [k for k in _differences(mine, theirs, json.loads(json.dumps(asdict(type(self.config)()))))
                       if k not in adds_points(self.config) + EXECUTION_FIELDS]
            if changed:
                raise ConfigError(f"{self.out}: holds points of another configuration (differs in "
                                  f"{', '.join(changed)}); use another --out or delete that directory")
            if "seeds" in mine:
                mine["seeds"] = sorted(set(theirs.get("seeds", [])) | set(mine["seeds"]))
        if mine != theirs and not _REPORT_ONLY.get():
            safe_io.write_text(recorded.parent, recorded, json.dumps(mine, indent=1), fsync=True)  # never via a link
        # the points already on disk first: with `enough`, an arm whose points are all saved is handed back before
        # this process starts an hour-long point of another
        on_disk = {key for key in points if store.exists(self.out / "points", key)}
        if _REPORT_ONLY.get() and len(on_disk) < len(points):
            missing = sorted(set(points) - on_disk)
            raise ConfigError(f"{self.out / 'points'}: {len(missing)} point(s) not there, e.g. {missing[0]}; "
                              "--report-only trains nothing (drop it to run them)")
        if on_disk:
            print(f"{desc}: reused {len(on_disk)} of {len(points)} saved points from {self.out / 'points'}", flush=True)
        results, pending = {}, {key: points[key] for key in sorted(points, key=lambda k: k not in on_disk)}
        bar = tqdm(total=len(points), desc=desc, file=sys.stdout, dynamic_ncols=True)
        while pending:
            elsewhere = {}  # points another process is running: read them when they are done
            for key, fn in pending.items():
                runtime.stop_if_signalled()
                folder = self.out / "points"
                if not store.exists(folder, key):
                    claim = folder / f"{key}.claim"
                    if not _claim(claim):
                        elsewhere[key] = fn
                        continue
                    try:
                        if not store.exists(folder, key):  # finished by another process between our look and claim
                            bar.set_postfix_str(key)
                            partial = folder / f"{key}.partial"  # its progress while it trains
                            with keeping_progress_in(partial):
                                result = _fresh_compile(fn)
                            # a point is either finished on disk or not there
                            store.write(folder, key, result | {"execution": self.execution()})
                    finally:
                        _release(claim)
                discard(self.out / "points" / f"{key}.partial")  # left if a process died just after the point
                results[key] = store.load(folder, key)
                bar.update()
                if enough is not None and enough(results):
                    bar.close()
                    return results
            if elsewhere and len(elsewhere) == len(pending):
                bar.set_postfix_str(f"waiting for {len(elsewhere)} point(s) another process runs")
                time.sleep(self.poll_seconds)
            pending = elsewhere
        bar.close()
        return {key: results[key] for key in points}


def _claim(path: Path) -> bool:
    # host and pid; a dead process's claim on this host, or one from before it booted, is taken over. Linked into
    # place from a private name (os.link fails if the name exists): a create-then-write would leave an empty claim
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(_owner())
    try:
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return not _claim_alive(path) and _take_over(path, tmp)
    finally:
        tmp.unlink(missing_ok=True)


def _take_over(path: Path, mine: Path) -> bool:
    # under the directory's lock, only if still dead: else two processes that found it dead would both replace it
    with _directory_lock(path.parent):
        if _claim_alive(path):
            return False
        path.unlink(missing_ok=True)
        try:
            os.link(mine, path)
            return True
        except FileExistsError:  # a new owner linked it between our unlink and our link
            return False


def _release(path: Path) -> None:
    # under `_take_over`'s lock: a claim another process took over (it judged this one dead) is left to it
    with _directory_lock(path.parent), suppress(FileNotFoundError):
        if path.read_text() == _owner():
            path.unlink()


@contextmanager
def _directory_lock(directory: Path):
    # flock(2) on the directory itself: no lock file left behind, dropped by the kernel if the process dies
    import fcntl  # noqa: PLC0415

    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _owner() -> str:  # what a claim of this process holds
    return f"{socket.gethostname()} {os.getpid()}"


def _claim_alive(path: Path) -> bool:
    try:
        host, pid = path.read_text().split()
        if host != socket.gethostname():
            return True
        # a minute's slack: a clock stepped forward after boot moves btime forward as much
        return path.stat().st_mtime >= _boot_time() - BOOT_SLACK_SECONDS and _pid_alive(int(pid))
    except FileNotFoundError:  # its owner just finished: try again
        return False
    except (OSError, ValueError):  # not a claim this code wrote whole: respect it while it is fresh
        try:
            return time.time() - path.stat().st_mtime < 60
        except OSError:
            return False


BOOT_SLACK_SECONDS = 60


def _boot_time() -> float:  # seconds since the epoch (Linux's /proc/stat), or 0 where that is not known
    try:
        with open("/proc/stat") as f:
            return float(next(line.split()[1] for line in f if line.startswith("btime ")))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _differences(mine: dict, theirs: dict, defaults: dict, prefix: str = "") -> list[str]:
    # dotted fields that differ; a field `theirs` lacks (newer code) is none while `mine` holds its default
    out = []
    for k in sorted(mine.keys() | theirs.keys()):
        a, b, default = mine.get(k), theirs.get(k), defaults.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, default if isinstance(default, dict) else {}, f"{prefix}{k}.")
        elif k not in theirs and k in defaults and a == default:
            continue
        elif a != b:
            out.append(prefix + k)
    return out
