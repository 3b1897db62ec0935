"""The `keel` command: train, eval, generate, summary, tokenizer."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from keel import __version__
from keel.config import CONFIG_FIELDS, ModelConfig
from keel.counting import count_params, flops_per_token
from keel.presets import PRESETS, preset

# fields a resumed run may change; anything else must match the run's config
RESUMABLE = {"resume", "run.steps", "run.progress", "run.log_every", "run.eval_every", "run.eval_batches",
             "run.ckpt_every", "run.keep_checkpoints", "run.device", "run.compile", "run.out_dir", "run.name"}


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
    """A readable summary: shape, counts, and the sub-layer layout with runs of equal blocks merged."""
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


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def train_config_for(args):
    """(config, run_dir, checkpoint to resume from or None) for `keel train`."""
    from dataclasses import asdict

    from omegaconf import OmegaConf

    from keel import checkpoint
    from keel.train_config import ConfigError, load_config, load_run_config, to_config

    config = load_config(args.overrides, args.config, args.preset)
    if not config.resume:
        name = config.run.name or f"{config.model.scheme}-{config.model.n_sublayers}L-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = Path(config.run.out_dir) / name
        if run_dir.exists() and any(run_dir.iterdir()):
            raise ConfigError(f"run directory {run_dir} already exists; continue it with resume={run_dir} "
                              "or choose another run.name")
        return config, run_dir, None
    run_dir = Path(config.resume)
    saved = load_run_config(run_dir)
    layers = [OmegaConf.structured(saved)]
    if args.config:
        layers.append(OmegaConf.load(args.config))
    layers.append(OmegaConf.from_dotlist(list(args.overrides)))
    resumed = to_config(layers)
    before, after = _flatten(asdict(saved)), _flatten(asdict(resumed))
    for key in before:
        if key not in RESUMABLE and before[key] != after[key]:
            raise ConfigError(f"resume: {key}={after[key]!r} differs from the run's config ({before[key]!r}); "
                              "a resumed run must keep it")
    return resumed, run_dir, checkpoint.latest_valid(run_dir)


def cmd_train(args) -> int:
    from keel.trainer import DIVERGED_EXIT, INTERRUPTED_EXIT, Trainer

    config, run_dir, resume_from = train_config_for(args)
    summary = Trainer(config, run_dir).run(resume_from)
    if summary["diverged"]:
        print(f"keel: {summary['divergence_reason']} (diagnostic: {run_dir / 'diverged.json'})", file=sys.stderr)
        return DIVERGED_EXIT
    if summary["interrupted"]:
        return INTERRUPTED_EXIT
    print(json.dumps(summary, indent=1))
    print(f"run: {run_dir}")
    return 0


def load_run(run_dir: str, checkpoint_path: str | None = None):
    """(config, model, tokenizer) of a run directory, from its newest intact checkpoint."""
    from keel import checkpoint
    from keel.model import TransformerLM
    from keel.tokenizer import load_saved_tokenizer
    from keel.train_config import load_run_config

    config = load_run_config(Path(run_dir))
    model = TransformerLM(config.model)
    path = Path(checkpoint_path) if checkpoint_path else checkpoint.latest_valid(Path(run_dir))
    checkpoint.load(path, model)
    return config, model, load_saved_tokenizer(Path(run_dir) / "tokenizer"), path


def cmd_eval(args) -> int:
    import torch

    from keel.data import prepare
    from keel.evaluate import bytes_per_token, evaluate
    from keel.trainer import autocast_for, resolve_device

    config, model, tokenizer, path = load_run(args.run_dir, args.checkpoint)
    device = resolve_device(args.device)
    data = prepare(config.data)
    tokens = data.val if args.split == "val" else data.train
    batches = args.batches or config.run.eval_batches
    torch.manual_seed(0)
    result = evaluate(model.to(device), tokens, config.run.seq_len, config.run.batch_size, batches, device,
                      autocast_for(device, config.run.dtype), bytes_per_token(tokenizer))
    result = {"checkpoint": str(path), "split": args.split, **result}
    print(json.dumps(result, indent=1))
    (Path(args.run_dir) / f"eval-{path.name}-{args.split}.json").write_text(json.dumps(result, indent=1))
    return 0


def cmd_generate(args) -> int:
    import torch

    from keel.generate import generate

    config, model, tokenizer, _ = load_run(args.run_dir, args.checkpoint)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise ValueError("--prompt: empty after tokenisation; give at least one character")
    generator = torch.Generator().manual_seed(args.seed)
    out = generate(model, torch.tensor([ids]), args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                   generator=generator, eos_id=tokenizer.eos_id)
    print(tokenizer.decode(out[0].tolist()))
    return 0


def cmd_tokenizer(args) -> int:
    from keel.data import DataConfig, build_corpus
    from keel.tokenizer import train_bpe

    values = parse_overrides(args.overrides)
    corpus = build_corpus(DataConfig(**values))
    tok = train_bpe(corpus.documents("train"), args.vocab_size, Path(args.out))
    print(f"trained a byte-level BPE with {tok.vocab_size} tokens on {corpus.fingerprint[:12]}: {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keel", description="Deep Transformer LMs with the Keel residual.")
    parser.add_argument("--version", action="version", version=f"keel {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model (default: a 32-sub-layer Keel on the stdlib corpus)",
                       description="Train. Settings are dotted key=value overrides, e.g. model.n_blocks=8 "
                                   "model.scheme=pre_ln run.steps=500 optim.lr=1e-3; resume=RUN_DIR continues a run.")
    p.add_argument("--preset", default="cpu-demo", help="training preset: cpu-demo (default) or tiny")
    p.add_argument("--config", help="a YAML file with any of model/data/optim/guard/run")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="validation loss, perplexity and bits per byte of a run's checkpoint")
    p.add_argument("run_dir")
    p.add_argument("--checkpoint", help="a checkpoint directory (default: the run's newest intact one)")
    p.add_argument("--split", default="val", choices=["val", "train"])
    p.add_argument("--batches", type=int, default=0, help="number of batches (default: run.eval_batches)")
    p.add_argument("--device", default="auto")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="sample text from a run's checkpoint")
    p.add_argument("run_dir")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("summary", help="print a model's shape, counts and sub-layer layout")
    p.add_argument("--preset", default="cpu-demo", choices=list(PRESETS), help="size preset (default cpu-demo)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="ModelConfig fields, e.g. scheme=pre_ln")
    p.set_defaults(func=cmd_summary)

    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on a corpus")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--out", default="tokenizer.json")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="DataConfig fields, e.g. source=corpus.txt")
    p.set_defaults(func=cmd_tokenizer)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:  # ConfigError, DataError, CheckpointError: one line naming the field or file
        print(f"keel: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
