"""The engine studies run on (docs/experiments.md#the-engine-module-by-module); the studies live in research/."""

import importlib
import re
import sys
from pathlib import Path

from keel.errors import ConfigError

WHERE = ("the studies live beside the library in a Keel checkout's research/ folder (research/keel_studies): run "
         "keel experiment / keel sweep from inside a clone of the Keel repository")


def _checkout(near: str | Path | None = None) -> Path | None:  # at or above `near`, the working directory or here
    starts = [Path(near).resolve() if near else None, Path.cwd(), Path(__file__).resolve()]
    for start in filter(None, starts):
        for folder in (start, *start.parents):
            if (folder / "research" / "keel_studies" / "__init__.py").is_file():
                return folder
    return None


def studies(near: str | Path | None = None):
    """The `keel_studies` package: importable already, or found in a `research/` folder at or above `near` (a
    study file), the working directory or this package's checkout. One ConfigError when there is none."""
    try:
        return importlib.import_module("keel_studies")
    except ModuleNotFoundError as err:
        if err.name != "keel_studies":
            raise
    folder = _checkout(near)
    if folder is None:
        raise ConfigError(WHERE)
    sys.path.insert(0, str(folder / "research"))
    return importlib.import_module("keel_studies")


def study_files() -> dict[str, Path]:
    """The checkout's studies declared as data: {name: results/<name>/study.yaml} for each study file that names
    `arms:` (`keel experiment NAME` runs it); empty outside a checkout."""
    folder = _checkout()
    files = sorted(folder.glob("results/*/study.yaml")) if folder else []
    return {f.parent.name: f for f in files if re.search(r"^arms:", f.read_text(), re.M)}


def __getattr__(name: str):
    if name == "EXPERIMENTS":  # name -> (config class, run function), loaded once
        registry = studies().STUDIES
        modules = {m: importlib.import_module(f"keel_studies.{m}") for m, _, _ in registry.values()}
        experiments = {n: (getattr(modules[m], c), getattr(modules[m], r)) for n, (m, c, r) in registry.items()}
        globals()["EXPERIMENTS"] = experiments
        return experiments
    raise AttributeError(f"module 'keel.experiments' has no attribute {name!r}")
