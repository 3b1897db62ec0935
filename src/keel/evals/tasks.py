"""Task names and what they stand for: the built-in probes (items cached per corpus) and lm-evaluation-harness tasks,
resolved without a model or data (docs/internals.md#keelevalstasks)."""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from keel import safe_io
from keel.data.corpus import DataConfig, build_corpus, cache_root
from keel.errors import ConfigError
from keel.evals import probes

STORED = 1000  # items written per probe; scoring keeps the first max_items (every prefix is balanced)
HARNESS_PREFIX = "lm_eval:"
TASK_FILE_CAP = 1 << 20  # a task YAML is a few KiB


@dataclass(frozen=True)
class Task:
    """One entry of `run.eval_tasks`. `chance` is the accuracy of a uniform random pick (None for a harness
    task until it is scored: it depends on the task's choices)."""

    name: str
    chance: float | None
    description: str


@dataclass(frozen=True)
class Probe(Task):
    """A built-in probe: multiple choice from the validation split, scored by total log-likelihood."""

    version: int = 1
    generate: object = None  # (validation docs, random.Random, cap) -> items; see keel.evals.probes

    def items(self, data: DataConfig, tokenizer, corpus=None) -> list[dict]:
        """Every stored item (generated and cached on the first call for this corpus and tokenizer); `corpus`:
        `data`'s, when the caller has built it already (building one walks a directory source's files)."""
        corpus = build_corpus(data) if corpus is None else corpus
        key = hashlib.sha256(f"{corpus.fingerprint}|{tokenizer.name}".encode()).hexdigest()[:16]
        path = cache_root(data) / "evals" / key / f"{self.name}-v{self.version}.jsonl"
        if (cached := _read_items(path, self)) is not None:
            return cached
        # seeded by the probe alone: the same text gives the same items wherever it lies (the fingerprint holds
        # paths and modification times)
        rng = random.Random(f"{self.name}:{self.version}")
        items = [{"version": self.version, "task": self.name, **item}
                 for item in self.generate(list(corpus.documents("val")), rng, STORED)]
        path.parent.mkdir(parents=True, exist_ok=True)
        # ranks that generate at once write the same items; a reader sees a whole file or none, and a planted
        # link is refused, not written through
        safe_io.write_text(path.parent, path, "".join(json.dumps(item) + "\n" for item in items))
        return items


def _valid_item(item, probe: Probe) -> bool:
    """An item scoring can use: this probe's and version's, a text context, text choices and an answer among them."""
    return (isinstance(item, dict) and item.get("task") == probe.name and item.get("version") == probe.version
            and isinstance(item.get("context"), str) and isinstance(item.get("choices"), list)
            and item["choices"] and all(isinstance(c, str) for c in item["choices"])
            and type(item.get("answer")) is int and 0 <= item["answer"] < len(item["choices"]))


def _read_items(path: Path, probe: Probe) -> list[dict] | None:
    """The cached items at `path`, or None (to generate them again) when there are none or the file is damaged:
    a link, FIFO or oversized file (keel.safe_io), lines that are not bounded JSON, or items scoring cannot use.
    The cache may be shared, so its contents are read as from elsewhere."""
    try:
        text = safe_io.read_text(path.parent, path, safe_io.CAP_LOG)
        items = [safe_io.loads_json(line) for line in text.splitlines()] if text is not None else None
    except (ValueError, OSError):  # DataError is a ValueError too
        return None
    return items if items and all(_valid_item(item, probe) for item in items) else None


@dataclass(frozen=True)
class HarnessTask(Task):
    """An lm-evaluation-harness task: registered by name, or read from a local YAML file whose folder becomes
    the harness's include path."""

    task: str = ""
    include_path: str | None = None


PROBES = {p.name: p for p in (
    Probe("brackets", 1 / probes.K, "which of ) ] } or a quote closes the open bracket or string here",
          version=1, generate=probes.brackets),
    Probe("indent", 1 / probes.K, "the indentation of the line after a block opener (a line ending in ':')",
          version=1, generate=probes.indent),
    Probe("identifiers", 1 / probes.K, "repeat a name the file defined earlier (induction/copy)",
          version=1, generate=probes.identifiers),
    Probe("next_line", 1 / probes.K, "the true next line of a held-out file against lines from elsewhere",
          version=1, generate=probes.next_line),
)}


def resolve(names: list[str], field: str = "run.eval_tasks") -> list[Task]:
    """The tasks `names` stand for: a probe name (see PROBES), `lm_eval:<task>` or `lm_eval:<path to a task
    YAML>`. Cheap: no model, no data, no harness import. A bad name raises a one-line ConfigError naming
    `field` and what is allowed."""
    allowed = f"{', '.join(PROBES)}, lm_eval:<task>, lm_eval:<task.yaml>"
    tasks = []
    for name in names:
        if not isinstance(name, str):
            raise ConfigError(f"{field}: got {name!r}; allowed: {allowed}")
        if name in PROBES:
            tasks.append(PROBES[name])
        elif name.startswith(HARNESS_PREFIX):
            tasks.append(_harness_task(name, field))
        else:
            close = difflib.get_close_matches(name, list(PROBES), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{field}: unknown task {name!r}{hint}; allowed: {allowed}")
    if len({t.name for t in tasks}) < len(tasks):
        raise ConfigError(f"{field}: a task is named twice in {names}")
    return tasks


def is_task_file(name) -> bool:
    """Whether the `run.eval_tasks` entry `name` names a task YAML (`lm_eval:<path>.yaml`): a file the harness
    runs code from (`!function`, `include`, a Python metric), unlike a task registered with the harness itself."""
    return isinstance(name, str) and name.startswith(HARNESS_PREFIX) and name.endswith((".yaml", ".yml"))


def _harness_task(name: str, field: str) -> HarnessTask:
    spec = name.removeprefix(HARNESS_PREFIX)
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(f"{field}: {name!r} needs lm-evaluation-harness, which is not installed: "
                          "pip install -e \".[eval]\"")
    if not is_task_file(name):
        if not spec:
            raise ConfigError(f"{field}: {name!r} names no task; allowed: lm_eval:<task>, lm_eval:<task.yaml>")
        # the harness reads a name it does not know exactly as a file path, and a pattern matches known names
        # first: `arc_eas?` would load a file of that name from the current directory
        if set(spec) & set("*?[]"):
            raise ConfigError(f"{field}: {name!r}: one task name, without wildcards (* ? [ ]); allowed: "
                              "lm_eval:<task>, lm_eval:<task.yaml>")
        return HarnessTask(name, None, f"lm-evaluation-harness task {spec}", task=spec)
    path = Path(spec).expanduser()
    try:  # a run's config names it, so it is read whenever that config is loaded (`keel runs` too): never waited on
        text = safe_io.read_regular(path, TASK_FILE_CAP, follow_links=True).decode("utf-8")
        # a regex, not a YAML parser: harness files use tags (!function) that safe_load refuses
        found = re.search(r"^task:[ \t]*['\"]?([\w.-]+)", text, re.M)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err) or type(err).__name__
        raise ConfigError(f"{field}: {name!r}: cannot read the task file ({reason})") from None
    if not found:
        raise ConfigError(f"{field}: {path} has no 'task: <name>' line")
    return HarnessTask(name, None, f"lm-evaluation-harness task {found[1]} from {path}", task=found[1],
                       include_path=str(path.resolve().parent))
