"""`keel experiment <name>`: parse, merge the experiment's config with overrides, run, report."""

from __future__ import annotations

import shlex
from pathlib import Path

from keel.errors import ConfigError
from keel.experiments import NAMES
from keel.train.config import merge


def register(subparsers) -> None:
    p = subparsers.add_parser("experiment", help="run one of the paper's experiments (results.json, plots, report.md)",
                              description="Overrides set the experiment's own fields and keel train's sections, "
                                          "e.g. depths=[16,64] schemes=[keel,pre_ln] run.steps=200 "
                                          "model.d_model=64 data.source=stdlib; a field the experiment sets per "
                                          "point (model.n_blocks, optim.lr, ...) is refused.")
    p.add_argument("name", choices=list(NAMES))
    p.add_argument("--quick", action="store_true", help="a CPU-sized version that runs in seconds to minutes")
    p.add_argument("--out", help="output directory (default runs/experiments/<name>; with --quick "
                                 "runs/quick/<name>; --out results/<name> adds to the committed results)")
    p.add_argument("--config", help="a YAML file with any of the experiment's fields")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_experiment, sets_threads=True)


def build(name: str, quick: bool, overrides: list[str], config_file: str | None = None):
    """The experiment's defaults (or its --quick version) < --config YAML < overrides: keel's one merge."""
    from keel.experiments import EXPERIMENTS  # every experiment, and torch: after the command line's checks

    cls, _ = EXPERIMENTS[name]
    try:
        cfg = merge(cls.quick() if quick else cls(), config_file, overrides)
        cfg.check_fields()
        return cfg
    except ConfigError as err:
        raise ConfigError(f"{name}: {err}") from None


def default_out(name: str, quick: bool) -> str:
    """Where a run goes without --out: never results/<name>, whose committed points belong to the configuration
    that produced them (a new run with other settings would be refused there)."""
    return f"runs/quick/{name}" if quick else f"runs/experiments/{name}"


def cmd_experiment(args) -> int:
    from keel import runtime
    from keel.experiments import EXPERIMENTS
    from keel.experiments.common import smoke_test

    cfg = build(args.name, args.quick, args.overrides, args.config)
    runtime.set_threads(cfg.run.threads)  # once, from the merged config (a YAML file's run.threads too)
    out = Path(args.out or default_out(args.name, args.quick))
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["keel experiment", args.name] + (["--quick"] if args.quick else [])
                       + ([f"--out {shlex.quote(args.out)}"] if args.out else [])
                       + [shlex.quote(o) for o in args.overrides])
    with smoke_test(args.quick):
        EXPERIMENTS[args.name][1](cfg, out, command)
    print(f"wrote {out}/results.json, {out}/report.md and plots")
    print((out / "report.md").read_text())
    return 0
