"""`keel experiment <name>`: parse, merge the experiment's config with overrides, run, report."""

from __future__ import annotations

import importlib
import json
import re
import shlex
import sys
from pathlib import Path

from keel.cli import COMMANDS
from keel.cli.support import output_dir
from keel.config import merge
from keel.config.merge import load_yaml
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
    """The `keel_studies` package (its `STUDIES`, and `EXPERIMENTS`: the studies written as code): importable
    already, or found in a `research/` folder at or above `near` (a study file), the working directory or this
    package's checkout. One ConfigError when there is none."""
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


def register(subparsers) -> None:
    p = subparsers.add_parser("experiment", help=COMMANDS["experiment"],
                              description="Overrides set the experiment's own fields and keel train's sections, "
                                          "e.g. depths=[16,64] schemes=[keel,pre_ln] run.steps=200 "
                                          "model.d_model=64 data.source=stdlib; a field the experiment sets per "
                                          "point (model.n_blocks, optim.lr, ...) is refused.")
    try:
        names = sorted({*studies().STUDIES, *study_files()})
    except ConfigError:  # not in a checkout: the command says where the studies are when it runs
        names = None
    p.add_argument("name", choices=names, help=None if names else WHERE)
    p.add_argument("--quick", action="store_true", help="a CPU-sized version that runs in seconds to minutes")
    p.add_argument("--out", help="output directory (default runs/experiments/<name>; with --quick "
                                 "runs/quick/<name>; --out results/<name> adds to the committed results)")
    p.add_argument("--config", help="a YAML file with any of the experiment's fields (a study written as a study "
                                    "file, results/<name>/study.yaml, takes none: its fields are in its file)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_experiment, sets_threads=True)


def register_sweep(subparsers) -> None:
    s = subparsers.add_parser("sweep", help=COMMANDS["sweep"],
                              description="STUDY.yaml declares a study as data (`arms:`, `axes:`, `tune:`, `seeds:`, "
                                          "`compare:`; docs/experiments.md#your-own-study) or names a study kind "
                                          "(`study:`, one of keel experiment's names) and its fields (`fields:`); "
                                          "results/<study>/study.yaml are the paper's. Overrides as for keel "
                                          "experiment (a declared study takes none: its fields are in its file).")
    s.add_argument("study", help="the study file (YAML)")
    s.add_argument("--out", help="output directory (default: the study file's folder)")
    s.add_argument("--report-only", action="store_true",
                   help="train nothing: rebuild the report from the points on disk (a missing point is an error)")
    s.add_argument("overrides", nargs="*", metavar="key=value")
    s.set_defaults(func=cmd_sweep, sets_threads=True)


STUDY_KEYS = {"study": "the study kind", "fields": "the kind's fields this study sets", "rule": "its decision rule",
              "question": "what it asks", "answer": "what it found"}


def load_study(path: str) -> dict:
    """A study file's mapping; one ConfigError naming the file when it is not one."""
    from omegaconf import OmegaConf  # noqa: PLC0415

    doc = OmegaConf.to_container(load_yaml(path, path))
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: a study file is a mapping: `arms:` (a declared study) or `study:` and `fields:`")
    return doc


def declared_file(doc: dict) -> bool:
    """Whether a study file's mapping is a study declared as data (`arms:` and the rest; an empty or misspelt one
    too, so its message lists the declared keys), not one naming a study kind (`study:` and `fields:`)."""
    return "arms" in doc or not {"study", "fields"} & set(map(str, doc))


def read_study(path: str) -> tuple[str, list[str]]:
    """(kind, overrides) from a study file that names a study kind, checked whole: one ConfigError naming the file
    and the key."""
    doc = load_study(path)
    unknown = sorted(set(map(str, doc)) - set(STUDY_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} (allowed: {', '.join(STUDY_KEYS)}; a declared "
                          "study has `arms:` instead of `study:`)")
    kind, fields = doc.get("study"), doc.get("fields") or {}
    names = studies(path).STUDIES
    if kind not in names:
        raise ConfigError(f"{path}: study: {kind!r} is not a study kind ({', '.join(names)})")
    if not isinstance(fields, dict):
        raise ConfigError(f"{path}: fields: a mapping of the study's fields")
    return kind, [f"{k}={json.dumps(v)}" for k, v in _dotted(fields).items()]


def _dotted(fields: dict) -> dict:  # keel train's sections dotted; a study's own mappings (arms, lrs, ...) whole
    from keel.experiments.study_file import dotted  # torch: after the command line's checks

    sections = ("model", "data", "optim", "guard", "run")
    return {f: x for k, v in fields.items() for f, x in (dotted({k: v}) if k in sections else {k: v}).items()}


def cmd_sweep(args) -> int:
    from keel.experiments.sweep import report_only

    out = Path(args.out) if args.out else Path(args.study).parent
    where = "--out" if args.out else "the study file's folder"
    command = _command(["keel sweep", shlex.quote(args.study)], args.out, args.overrides)
    doc = load_study(args.study)
    if declared_file(doc):  # a study declared as data (keel.experiments.declared): `arms:` and the rest
        with report_only(args.report_only):
            run_declared(args.study, doc, args.overrides, out, where, command,
                         out.resolve().name or Path(args.study).stem, make=not args.report_only)
        return _wrote(out)
    kind, fields = read_study(args.study)
    _run_kind(kind, build(kind, False, [*fields, *args.overrides]), out, where, command, report_only(args.report_only),
              make=not args.report_only)
    return _wrote(out)


def _command(words: list[str], out: str | None, overrides: list[str]) -> str:  # as a report's "Produced by" shows it
    return " ".join([*words, *([f"--out {shlex.quote(out)}"] if out else []), *map(shlex.quote, overrides)])


def _run_kind(kind: str, cfg, out: Path, where: str, command: str, around, make: bool = True) -> None:
    from keel import runtime

    runtime.set_threads(cfg.run.threads)  # once, from the merged config (a YAML file's run.threads too)
    output_dir(str(out), where, make=make)
    with around:
        studies().EXPERIMENTS[kind][1](cfg, out, command)


def _wrote(out: Path, report: bool = False) -> int:
    print(f"wrote {out}/results.json, {out}/report.md and plots")
    if report:
        print((out / "report.md").read_text())
    return 0


def run_declared(path: str, doc: dict, overrides: list[str], out: Path, where: str, command: str, name: str,
                 quick: bool = False, make: bool = True) -> None:
    """A study declared as data, read and checked whole (one line naming the field), then run; with `quick` at its
    smoke-test size (keel.experiments.declared.smoke); `make=False` (--report-only) makes no output folder."""
    from keel import runtime
    from keel.experiments import declared

    if overrides:
        raise ConfigError(f"{path}: a declared study takes no key=value overrides (got {overrides[0]!r}); its fields "
                          "are in its file")
    study = declared.read(doc, path, quick)
    runtime.set_threads(study.run.threads)
    output_dir(str(out), where, make=make)  # a link, a file, read-only: one line before any point trains
    declared.run(study, out, command, name=name, question=str(doc.get("question") or ""),
                 rule=str(doc.get("rule") or ""))


def build(name: str, quick: bool, overrides: list[str], config_file: str | None = None):
    """The experiment's defaults (or its --quick version) < --config YAML < overrides: keel's one merge."""
    cls, _ = studies().EXPERIMENTS[name]  # every experiment, and torch: after the command line's checks
    try:
        cfg = merge(cls.quick() if quick else cls(), config_file, overrides)
        cfg.check_fields()
        return cfg
    except ConfigError as err:
        raise ConfigError(f"{name}: {err}") from None


def cmd_experiment(args) -> int:
    from keel.experiments.common import smoke_test

    # never results/<name> without --out: its points belong to the configuration that produced them
    out = Path(args.out or (f"runs/quick/{args.name}" if args.quick else f"runs/experiments/{args.name}"))
    command = _command(["keel experiment", args.name, *(["--quick"] if args.quick else [])], args.out, args.overrides)
    files = study_files()
    if args.name in files:  # a study written as a study file: run that file, as it is
        given = [o.split("=", 1)[0] for o in args.overrides] + (list(_dotted(load_study(args.config)))
                                                                 if args.config else [])
        if given:
            path = files[args.name].resolve()
            shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
            raise ConfigError(f"{args.name}: {given[0]}: not used here (the study's fields are in its file, "
                              f"{shown}: copy it and run keel sweep on the copy)")
        with smoke_test(args.quick):
            run_declared(str(files[args.name]), load_study(str(files[args.name])), [], out, "--out", command,
                         args.name, quick=args.quick)
        return _wrote(out, report=True)
    cfg = build(args.name, args.quick, args.overrides, args.config)
    _run_kind(args.name, cfg, out, "--out", command, smoke_test(args.quick))
    return _wrote(out, report=True)
