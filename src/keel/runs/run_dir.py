"""The run directory, the project's central artefact, and the one object that owns it (`RunDir`, path-like); its
files: docs/internals.md#keelrunsrun_dir."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from keel import safe_io
from keel.config import TrainConfig, load_run_config, merge, to_yaml
from keel.config.reads import RESUME
from keel.data.tokenizer import load_saved_tokenizer
from keel.errors import CheckpointError, ConfigError, DataError

if TYPE_CHECKING:  # the model and checkpoints import torch (seconds): `keel runs` lists runs without it
    from keel.model import TransformerLM

LOCK = ".lock"


class RunDir(os.PathLike):
    def __init__(self, path, made: tuple = ()):
        self.path = Path(path)
        self._lock = None
        self.made = made  # the folders above it that `create` made, innermost first: a failed start removes them

    # ---- finding or making one ------------------------------------------------------------------
    @staticmethod
    def default_name(config: TrainConfig) -> str:
        return f"{config.model.scheme}-{config.model.n_sublayers}L-{time.strftime('%Y%m%d-%H%M%S')}"

    @staticmethod
    def check_new(config: TrainConfig) -> None:
        """Refuse, before any work, a named run that would overwrite an existing one."""
        if config.run.name:
            path = Path(config.run.out_dir) / config.run.name
            if path.exists() and (not path.is_dir() or any(p.name != LOCK for p in path.iterdir())):
                raise ConfigError(f"run directory {path} already exists; continue it with resume={path} "
                                  "or choose another run.name")

    @classmethod
    def create(cls, config: TrainConfig) -> RunDir:
        """A new, empty run directory under run.out_dir: run.name, or a generated name made unique with a
        numeric suffix when runs start within the same second."""
        cls.check_new(config)
        out = Path(config.run.out_dir)
        made = tuple(p for p in (out, *out.parents) if not p.exists())
        try:
            out.mkdir(parents=True, exist_ok=True)
            if config.run.name:
                (out / config.run.name).mkdir(exist_ok=True)
                return cls(out / config.run.name, made)
            base = cls.default_name(config)
            for n in range(1, 1000):
                path = out / (base if n == 1 else f"{base}-{n}")
                try:
                    path.mkdir()  # atomic: two processes never get the same directory
                    return cls(path, made)
                except FileExistsError:
                    continue
        except OSError as err:
            raise ConfigError(f"run.out_dir: cannot create a run directory in {out}: {err.strerror}") from None
        raise ConfigError(f"run.out_dir: {out} already holds 999 runs named {base}*; set run.name")

    @classmethod
    def create_at(cls, path) -> RunDir:
        """A new run directory at exactly `path` (keel import-hf); refused if it exists and is not empty."""
        path = Path(path)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ConfigError(f"{path}: already exists and is not empty; choose a new run directory")
        path.mkdir(parents=True, exist_ok=True)
        return cls(path)

    @classmethod
    def open(cls, path) -> RunDir:
        """An existing run; a directory without config.yaml is named as not being one."""
        path = Path(path)
        if not os.path.lexists(path / "config.yaml"):  # a planted link or FIFO is named when read, not here
            raise ConfigError(f"{path}: not a Keel run directory (no config.yaml)")
        return cls(path)

    # ---- one writer at a time ------------------------------------------------------------------
    def lock(self) -> None:
        """Take the run's exclusive lock (held until `unlock` or process exit, also after kill -9, since the
        kernel drops it with the process). A second trainer on the same run gets one clear error."""
        import fcntl

        f = safe_io.open_lock(self.path, self.path / LOCK)  # a planted link, directory or FIFO: one line
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read(200).decode("utf-8", "replace").strip() or "another process"
            f.close()
            raise ConfigError(f"run directory {self.path} is in use by {holder}; wait for it to finish "
                              "or stop it first") from None
        f.seek(0)
        f.truncate()
        f.write(f"keel process {os.getpid()}".encode())
        f.flush()
        self._lock = f

    def unlock(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def status(self) -> str:
        """running (another process holds the lock), finished, diverged, interrupted, imported (by keel import-hf,
        never trained here), or new (nothing trained)."""
        import fcntl

        lock = self.path / LOCK
        if self._lock is None and lock.is_file() and not lock.is_symlink():
            try:
                fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                fd = None
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError:
                    return "running"
                finally:
                    os.close(fd)
        summary = self.summary()
        if summary is not None:
            if summary.get("diverged"):
                return "diverged"
            if summary.get("interrupted"):
                return "interrupted"
            return "finished"
        if (self.path / "diverged.json").exists():
            return "diverged"
        if "imported_from" in self.provenance() and not (self.path / "metrics.jsonl").exists():
            return "imported"  # keel import-hf: weights to evaluate, not a training run to continue
        return "interrupted" if self.checkpoints() or (self.path / "metrics.jsonl").exists() else "new"

    def describe(self) -> dict:
        """One row of `keel runs`; a run whose config cannot be read is listed as damaged, with one note."""
        try:
            config = self.config()
        except (ConfigError, DataError) as err:
            _note(f"{str(err).removeprefix('keel: ')}; listed as damaged")
            return {"run": self.name, "scheme": None, "sub-layers": None, "d_model": None, "steps": None,
                    "val_loss": None, "status": "damaged", "path": str(self.path)}
        records = self.metrics()
        steps = steps_done(self)  # the later of the last metrics record and the summary (a Ctrl-C between records)
        val = [r["val_loss"] for r in records if _number(r.get("val_loss"))]
        return {"run": self.name, "scheme": config.model.scheme, "sub-layers": config.model.n_sublayers,
                "d_model": config.model.d_model, "steps": f"{steps}/{config.run.steps}",
                "val_loss": round(val[-1], 4) if val else None, "status": self.status(), "path": str(self.path)}

    def discard_if_unused(self) -> None:
        """Remove a run directory a failed start left empty (nothing but the lock), so a retry is not blocked."""
        self.unlock()
        if self.path.is_dir() and all(p.name == LOCK for p in self.path.iterdir()):
            for p in self.path.iterdir():
                if p.is_symlink() or p.is_file():  # unlink removes a link itself, never its target
                    p.unlink()
            if not any(self.path.iterdir()):
                self.path.rmdir()
                self._discard_made()

    def discard_untrained(self) -> None:
        """Remove a run that has not trained a step (no checkpoints, no metrics): what a start that failed
        while writing its first files leaves behind."""
        self.unlock()
        trained = (self.path / "checkpoints").exists() or (self.path / "metrics.jsonl").exists()
        if self.path.is_dir() and not trained:
            shutil.rmtree(self.path, ignore_errors=True)
            self._discard_made()

    def _discard_made(self) -> None:
        """The folders `create` made for this run (run.out_dir and any above it), while nothing else is in them."""
        for folder in self.made:
            try:
                folder.rmdir()  # only an empty folder; another run started there meanwhile keeps it
            except OSError:
                return

    # ---- what it holds --------------------------------------------------------------------------
    def config(self) -> TrainConfig:
        # refused here when a link, FIFO or oversized; load_run_config then parses the regular file
        safe_io.read_bytes(self.path, self.path / "config.yaml", safe_io.CAP_SMALL)
        return load_run_config(self.path)

    def write_config(self, config: TrainConfig) -> None:
        from keel.runs import trust

        self._write("config.yaml", to_yaml(replace(config, resume="")))
        trust.sign(self.path)  # keel wrote it for this user: its paths are followed (keel.runs.trust)

    def write_provenance(self, info: dict) -> None:
        self._write("run.json", json.dumps(info, indent=1, default=str))

    def provenance(self) -> dict:
        return _read_json_object(self.path / "run.json") or {}

    def save_tokenizer(self, tokenizer) -> None:
        tokenizer.save(safe_io.check_dir(self.path, self.path / "tokenizer"))

    def tokenizer(self):
        return load_saved_tokenizer(safe_io.check_dir(self.path, self.path / "tokenizer"))

    def log(self, record: dict, name: str = "metrics.jsonl") -> None:
        safe_io.append_text(self.path, self.path / name, json.dumps(record) + "\n")

    def metrics(self) -> list[dict]:
        return [record for _, record in self._records()]

    def telemetry(self) -> list[dict]:
        """The per-sub-layer records of keel.train.telemetry, one per telemetry step."""
        return [record for _, record in self._records("telemetry.jsonl")]

    def _records(self, name: str = "metrics.jsonl") -> list[tuple[str, dict]]:
        """(line, record) of a JSON-lines log. A line that is not a record of the file's shape (torn by a kill,
        damaged, a string where a number belongs, no integer step) is skipped with one note naming the file
        and lines; an unreadable file (a directory, no permission) is skipped with one note."""
        path = self.path / name
        text = _read_or_note(path, safe_io.CAP_LOG, "skipped")
        if text is None:
            return []
        out, bad = [], []
        for n, line in enumerate((line for line in text.splitlines() if line.strip()), 1):
            try:
                record = safe_io.loads_json(line)
            except ValueError:
                record = None
            if _valid_record(record, name):
                out.append((line, record))
            else:
                bad.append(n)
        if bad:
            lines = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            _note(f"{path}: skipped {len(bad)} damaged record{'s' if len(bad) > 1 else ''} (line "
                  f"{lines}: not JSON, no integer step, or a value of the wrong type)")
        return out

    def truncate_log(self, step: int) -> None:
        """Drop records past `step` (and a torn last line), so a resumed run's log reads as if it was never
        interrupted."""
        for name in ("metrics.jsonl", "telemetry.jsonl"):
            if (self.path / name).exists():
                keep = [line for line, record in self._records(name) if record.get("step", 0) <= step]
                self._write(name, "".join(line + "\n" for line in keep))

    def write_summary(self, summary: dict) -> None:
        self._write("summary.json", json.dumps(summary, indent=1))

    def summary(self) -> dict | None:
        """summary.json, or None if there is none; a damaged one (torn, not a JSON object) is noted and None."""
        return _read_json_object(self.path / "summary.json")

    def write_diverged(self, diagnostic: dict) -> None:
        self._write("diverged.json", json.dumps(diagnostic, indent=1))

    def checkpoints(self) -> list[Path]:
        from keel.runs.paths import list_checkpoints  # no torch: `keel runs` asks every run

        return list_checkpoints(self.path)

    def latest_checkpoint(self) -> Path:
        """The newest intact checkpoint (damaged ones are reported and skipped)."""
        from keel.runs import checkpoint

        return checkpoint.latest_valid(self.path)

    # ---- using it -------------------------------------------------------------------------------
    def load_model(self, checkpoint_path=None) -> tuple[TrainConfig, TransformerLM, object, Path]:
        """(config, model, tokenizer, checkpoint) from the given or the newest intact checkpoint, on CPU."""
        config = self.config()
        model, _, path = self.load_weights(config, checkpoint_path)
        return config, model, self.tokenizer(), path

    def load_weights(self, config: TrainConfig, checkpoint_path=None) -> tuple[TransformerLM, dict, Path]:
        """(model, the checkpoint's meta, checkpoint) on CPU, from `checkpoint_path` or else the newest checkpoint that
        loads, falling back past damaged ones (docs/internals.md#keelrunsrun_dirrundirload_weights)."""
        from keel.runs import checkpoint
        from keel.runs.resume import load_older

        loaded = {}

        def load(path: Path) -> None:
            try:
                model = self.build_model(config, path)
                _, loaded["meta"] = checkpoint.load(path, model)
            except OSError as err:  # removed while being read
                raise CheckpointError(f"checkpoint {path}: cannot be read ({err.strerror or err})") from None
            loaded["model"] = model

        if checkpoint_path:
            load(Path(checkpoint_path))
            return loaded["model"], loaded["meta"], Path(checkpoint_path)
        for _ in range(3):
            newest = self.latest_checkpoint()
            try:
                load(newest)
                return loaded["model"], loaded["meta"], newest
            except CheckpointError as err:
                if newest.exists() and checkpoint.list_checkpoints(self.path)[-1:] == [newest]:
                    path = load_older(newest, load, err)  # damaged, and still the newest: the next older
                    return loaded["model"], loaded["meta"], path
        raise CheckpointError(f"checkpoint {newest}: removed while being read, three times over (a run still "
                              "training prunes its old checkpoints); try again")

    def build_model(self, config: TrainConfig, path: Path) -> TransformerLM:
        """`TransformerLM(config.model)`, once its sizes are checked against checkpoint `path` and this
        machine's memory without allocating anything (config.yaml may come from elsewhere:
        keel.runs.untrusted.check_model_fits, the one copy of these checks)."""
        import torch

        from keel.model import TransformerLM
        from keel.runs.untrusted import check_model_fits
        from keel.runtime import device_memory

        check_model_fits(self.path / "config.yaml", config.model, path, device_memory(torch.device("cpu")))
        return TransformerLM(config.model)

    def resume_config(self, overrides=(), config_file: str | None = None) -> TrainConfig:
        """The run's own config with `overrides` merged in (keel.config.reads.RESUME: changing anything but
        RESUMABLE is refused). In a config keel did not write for this user (keel.runs.trust), a data path
        outside the run is refused, and so is a task file in run.eval_tasks unless an override names it."""
        from keel.runs import trust

        saved = self.config()
        trust.check_data_paths(self.path, saved.data)
        overrides = [o for o in overrides if not o.startswith("resume=")]
        resumed = merge(saved, config_file, overrides, RESUME)
        if resumed.run.eval_tasks:
            # the tasks the command line names ([] when it names none), merged over the saved config without
            # its tasks so that any spelling counts; a --config file does not name them: it may be the run's own
            blank = replace(saved, run=replace(saved.run, eval_tasks=[]))
            named = merge(blank, None, overrides, RESUME).run.eval_tasks
            trust.check_task_files(self.path, [t for t in resumed.run.eval_tasks if t not in named])
        return replace(resumed, resume=str(self.path))

    def _write(self, name: str, text: str) -> None:
        """Write a whole file atomically: a full disk or a kill leaves the old file (or none), never half."""
        safe_io.write_text(self.path, self.path / name, text)  # never through a planted link

    # ---- path-likeness --------------------------------------------------------------------------
    def __fspath__(self) -> str:
        return str(self.path)

    def __truediv__(self, other) -> Path:
        return self.path / other

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __eq__(self, other) -> bool:
        return Path(self) == Path(other) if isinstance(other, (RunDir, str, Path)) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def parent(self) -> Path:
        return self.path.parent


def find_runs(root) -> list[RunDir]:
    """Every run directory directly under `root`, oldest first (by when its config was written)."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"{root}: no such directory of runs")
    runs = [RunDir(p) for p in root.iterdir() if os.path.lexists(p / "config.yaml")]
    return sorted(runs, key=lambda r: (r.path / "config.yaml").lstat().st_mtime)


def latest_run(root) -> RunDir:
    """The most recently active run under `root` (`resume=latest`); imported runs are not training runs."""
    def activity(r: RunDir) -> float:
        return max((r.path / n).lstat().st_mtime for n in ("config.yaml", "metrics.jsonl", "summary.json")
                   if os.path.lexists(r.path / n))
    runs = [r for r in find_runs(root) if r.status() != "imported"]
    if not runs:
        raise ConfigError(f"resume=latest: no runs in {root}")
    latest = max(runs, key=activity)
    if latest.path.is_symlink():  # planted or not, it would resume and write a run outside `root`
        raise ConfigError(f"resume=latest: {latest.path} is a symbolic link to {os.readlink(latest.path)}; keel "
                          f"resumes only runs inside {root} this way: name the run with resume=<path> to continue it")
    return latest


_TEXT_FIELDS = {"event", "reason"}  # metrics.jsonl's only text; every other value is a number (or null)
_noted: set[str] = set()


def _note(message: str) -> None:
    """Print a note about a damaged file once per process (a command reads a log more than once)."""
    if message not in _noted:
        _noted.add(message)
        print(f"keel: {message}", file=sys.stderr)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _valid_record(record, name: str) -> bool:
    """A record of `name` readers can use: an object with an integer step >= 0 and values of the right type
    (metrics: numbers or null, text only under _TEXT_FIELDS; telemetry: one list of numbers per quantity)."""
    if not isinstance(record, dict):
        return False
    step = record.get("step")
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        return False
    values = [(k, v) for k, v in record.items() if k != "step"]
    if name == "telemetry.jsonl":
        return all(isinstance(v, list) and v and all(map(_number, v)) for _, v in values)
    return all(v is None or _number(v) or (k in _TEXT_FIELDS and isinstance(v, str)) for k, v in values)


def _read_or_note(path: Path, cap: int, then: str) -> str | None:
    # None when absent, or refused by keel.safe_io (a planted link, FIFO or directory: never followed or waited on)
    # or unreadable, which is noted with what is done `then`
    try:
        return safe_io.read_text(path.parent, path, cap)
    except DataError as err:
        _note(f"{str(err).removeprefix('keel: ')}; {then}")
    except OSError as err:
        _note(f"{path}: cannot read ({err.strerror or err}); {then}")
    return None


def _read_json_object(path: Path) -> dict | None:
    """A JSON object file, or None if absent; one that is unreadable, torn or not an object is noted, None."""
    text = _read_or_note(path, safe_io.CAP_SMALL, "ignored")
    if text is None:
        return None
    try:
        value = safe_io.loads_json(text)
    except ValueError as err:
        _note(f"{path}: not valid JSON ({str(err).splitlines()[0]}); ignored")
        return None
    if not isinstance(value, dict):
        _note(f"{path}: not a JSON object; ignored")
        return None
    return value


def load_model(path, checkpoint_path=None):
    """`RunDir.open(path).load_model(checkpoint_path)`."""
    return RunDir.open(path).load_model(checkpoint_path)


def steps_done(run) -> int:
    """The last step the run `run` (a RunDir) completed, as `keel runs` shows it: the later of its last metrics record
    and its summary's step (docs/internals.md#keelrunsrun_dirsteps_done)."""
    logged = max((r["step"] for r in run.metrics() if "loss" in r and "event" not in r), default=0)
    stopped = (run.summary() or {}).get("steps")
    if isinstance(stopped, int) and not isinstance(stopped, bool) and stopped >= 0:
        return max(logged, stopped)
    return logged
