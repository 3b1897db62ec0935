"""The `keel` command."""

from __future__ import annotations

import argparse
import sys

from keel import __version__
from keel.config import CONFIG_FIELDS, ModelConfig
from keel.counting import count_params, flops_per_token
from keel.presets import PRESETS, preset


def parse_overrides(items: list[str]) -> dict:
    """`key=value` strings to typed values (YAML scalars: 8 -> int, 1e-5 -> float, true -> bool)."""
    from omegaconf import OmegaConf

    for item in items:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected key=value")
    return OmegaConf.to_container(OmegaConf.from_dotlist(items))


def model_config(preset_name: str, overrides: list[str]) -> ModelConfig:
    values = parse_overrides(overrides)
    unknown = sorted(set(values) - set(CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"ModelConfig has no field {unknown[0]!r}; fields: {', '.join(CONFIG_FIELDS)}")
    return preset(preset_name, **values)


def describe(config: ModelConfig) -> str:
    """A readable summary: shape, counts, and the sub-layer layout with runs of equal sub-layers merged."""
    from keel.model import TransformerLM

    model = TransformerLM(config)
    lines = [f"keel {__version__}", "", "config:"]
    lines += [f"  {name} = {getattr(config, name)!r}" for name in CONFIG_FIELDS]
    n_total, n_body = count_params(config), count_params(config, embedding=False)
    lines += [
        "",
        f"blocks: {config.n_blocks}   sub-layers (the paper's L): {model.n_sublayers}",
        f"parameters: {n_total:,} ({n_body:,} without the input embedding)",
        f"training FLOPs per token at T={config.max_seq_len}: {flops_per_token(config):.4g}",
        f"final norm before the head: {'yes' if model.scheme.final_norm else 'no (the stack ends in a norm)'}",
        "",
        "sub-layers: x' = norm_out(alpha*x + norm_branch(F(norm_in(x))))",
    ]
    subs = model.sublayers()
    layout = [(a.alpha, a.norm_in, a.norm_branch, a.norm_out, f.alpha, f.norm_in, f.norm_branch, f.norm_out)
              for a, f in zip(subs[0::2], subs[1::2])]
    first = 0
    for b in range(config.n_blocks):
        if b + 1 < config.n_blocks and layout[b + 1] == layout[b]:
            continue
        blocks = f"block {b}" if first == b else f"blocks {first}..{b}"
        for kind, (alpha, *norms) in (("attn", layout[b][:4]), ("ffn", layout[b][4:])):
            names = [n for n, on in zip(("norm_in", "norm_branch", "norm_out"), norms) if on]
            lines.append(f"  {blocks:<16} {kind:<4}  alpha={alpha:<9g} {', '.join(names) or 'no norms'}")
            blocks = ""
        first = b + 1
    return "\n".join(lines)


def cmd_summary(args) -> int:
    print(describe(model_config(args.preset, args.overrides)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keel", description="Deep Transformer LMs with the Keel residual.")
    parser.add_argument("--version", action="version", version=f"keel {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("summary", help="print a model's shape, counts and sub-layer layout")
    p.add_argument("--preset", default="cpu-demo", choices=list(PRESETS), help="size preset (default cpu-demo)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="ModelConfig fields, e.g. scheme=pre_ln")
    p.set_defaults(func=cmd_summary)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"keel: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
