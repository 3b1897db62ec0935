"""`keel experiment <name>`: parse, merge the experiment's config with overrides, run, report."""

from __future__ import annotations

import shlex
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from keel.experiments import EXPERIMENTS


def register(subparsers) -> None:
    p = subparsers.add_parser("experiment", help="run one of the paper's experiments (results.json, plots, report.md)",
                              description="Overrides set the experiment's fields, e.g. depths=[16,64] "
                                          "schemes=[keel,pre_ln] steps=200 shape.d_model=64 data.source=stdlib.")
    p.add_argument("name", choices=list(EXPERIMENTS))
    p.add_argument("--quick", action="store_true", help="a CPU-sized version that runs in seconds to minutes")
    p.add_argument("--out", help="output directory (default results/<name>, or results/<name>-quick)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_experiment)


def build(name: str, quick: bool, overrides: list[str]):
    cls, _ = EXPERIMENTS[name]
    base = OmegaConf.structured(cls.quick() if quick else cls())
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected key=value, e.g. steps=100")
    try:
        return OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides))))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        raise ValueError(f"{name}: {key}: {str(err).splitlines()[0]}" if key else str(err).splitlines()[0]) from None


def cmd_experiment(args) -> int:
    cfg = build(args.name, args.quick, args.overrides)
    out = Path(args.out or f"results/{args.name}{'-quick' if args.quick else ''}")
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["keel experiment", args.name] + (["--quick"] if args.quick else [])
                       + ([f"--out {shlex.quote(args.out)}"] if args.out else [])
                       + [shlex.quote(o) for o in args.overrides])
    EXPERIMENTS[args.name][1](cfg, out, command)
    print(f"wrote {out}/results.json, {out}/report.md and plots")
    print((out / "report.md").read_text())
    return 0
