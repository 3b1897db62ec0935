"""The `keel` command: train, eval, generate, summary, tokenizer, experiment, and the Hugging Face
bridges (export-hf, import-hf, lm-eval)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from keel import __version__
from keel.model.config import CONFIG_FIELDS, ModelConfig
from keel.model.counting import count_params, flops_per_token
from keel.model.presets import PRESETS, preset

# fields a resumed run may change; anything else must match the run's config
RESUMABLE = {"resume", "run.steps", "run.progress", "run.log_every", "run.eval_every", "run.eval_batches",
             "run.ac_every", "run.fsdp_group",
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
    from keel.model.transformer import TransformerLM

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

    from keel.train import checkpoint
    from keel.train.config import ConfigError, load_config, load_run_config, to_config

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
    from keel.train.trainer import DIVERGED_EXIT, INTERRUPTED_EXIT, Trainer

    config, run_dir, resume_from = train_config_for(args)
    summary = Trainer(config, run_dir).run(resume_from)
    if summary["diverged"]:
        print(f"keel: {summary['divergence_reason']} (diagnostic: {run_dir / 'diverged.json'})", file=sys.stderr)
        return DIVERGED_EXIT
    if summary["interrupted"]:
        return INTERRUPTED_EXIT
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
        print(json.dumps(summary, indent=1))
        print(f"run: {run_dir}")
    return 0


def load_run(run_dir: str, checkpoint_path: str | None = None):
    """(config, model, tokenizer) of a run directory, from its newest intact checkpoint."""
    from keel.data.tokenizer import load_saved_tokenizer
    from keel.model.transformer import TransformerLM
    from keel.train import checkpoint
    from keel.train.config import load_run_config

    config = load_run_config(Path(run_dir))
    model = TransformerLM(config.model)
    path = Path(checkpoint_path) if checkpoint_path else checkpoint.latest_valid(Path(run_dir))
    checkpoint.load(path, model)
    return config, model, load_saved_tokenizer(Path(run_dir) / "tokenizer"), path


def cmd_eval(args) -> int:
    import torch

    from keel.data import prepare
    from keel.train.evaluate import bytes_per_token, evaluate
    from keel.train.trainer import autocast_for, resolve_device

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
                   generator=generator, eos_id=tokenizer.eos_id, use_cache=not args.no_cache)
    print(tokenizer.decode(out[0].tolist()))
    return 0


def cmd_tokenizer(args) -> int:
    from dataclasses import fields

    from keel.data import DataConfig, build_corpus
    from keel.data.tokenizer import train_bpe

    values = parse_overrides(args.overrides)
    names = [f.name for f in fields(DataConfig)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"DataConfig has no field {unknown[0]!r}; fields: {', '.join(names)}")
    corpus = build_corpus(DataConfig(**values))
    tok = train_bpe(corpus.documents("train"), args.vocab_size, Path(args.out))
    print(f"trained a byte-level BPE with {tok.vocab_size} tokens on {corpus.fingerprint[:12]}: {args.out}")
    return 0


def _needs(extra: str, module: str) -> None:
    """Fail with the install line of the extra that provides `module` unless it imports."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise ValueError(f"this command needs {module.split('.')[0]}: pip install -e \".[{extra}]\"") from None


def cmd_export_hf(args) -> int:
    _needs("hf", "transformers")
    from keel.hf.export import export_run

    out = export_run(args.run_dir, args.out_dir, args.checkpoint)
    print(f"exported {args.run_dir} to {out} (load with AutoModelForCausalLM.from_pretrained)")
    return 0


def cmd_import_hf(args) -> int:
    from keel.hf.import_hf import import_llama

    run_dir = import_llama(args.hf_dir, args.out_run_dir, args.data)
    print(f"imported {args.hf_dir} as a pre_ln run: {run_dir}")
    return 0


def cmd_lm_eval(args) -> int:
    import torch

    _needs("eval", "transformers")
    _needs("eval", "lm_eval")
    from keel.hf.harness import run_lm_eval

    tasks = [t for t in args.tasks.split(",") if t]
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    results, out = run_lm_eval(args.path, tasks, args.include_path, device, args.batch_size, args.num_fewshot,
                               args.limit, args.checkpoint)
    print(json.dumps(results["results"], indent=1, default=str))
    print(f"results: {out}")
    return 0


def add_hf_commands(sub) -> None:
    p = sub.add_parser("export-hf", help="write a run's checkpoint as a Hugging Face transformers model directory")
    p.add_argument("run_dir")
    p.add_argument("out_dir")
    p.add_argument("--checkpoint", help="a checkpoint directory (default: the run's newest intact one)")
    p.set_defaults(func=cmd_export_hf)

    p = sub.add_parser("import-hf", help="convert a Llama transformers checkpoint into a pre_ln run directory")
    p.add_argument("hf_dir", help="a directory with config.json, model.safetensors and tokenizer.json")
    p.add_argument("out_run_dir")
    p.add_argument("--data", default="stdlib", help="data.source that `keel eval` of the new run reads")
    p.set_defaults(func=cmd_import_hf)

    p = sub.add_parser("lm-eval", help="run lm-evaluation-harness tasks on a run or transformers directory")
    p.add_argument("path", help="a run directory or a transformers model directory (e.g. from export-hf)")
    p.add_argument("--tasks", required=True, help="comma-separated task names, e.g. hellaswag,arc_easy")
    p.add_argument("--include-path", help="a directory of your own task YAML files")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--limit", type=float, help="examples per task (a fraction if < 1)")
    p.add_argument("--batch-size", type=int, default=1, help="rows per batch (default 1; rows are never padded)")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda, cuda:1, ...")
    p.add_argument("--checkpoint", help="for a run directory: a checkpoint directory (default: newest intact)")
    p.set_defaults(func=cmd_lm_eval)


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
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context each step (no KV cache)")
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

    add_hf_commands(sub)
    from keel.experiments.cli import register as add_experiment_command

    add_experiment_command(sub)
    from keel.experiments.bench import register as add_bench_command

    add_bench_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key=value overrides may come before or after options (`keel experiment depth --quick steps=9`):
    # argparse stops collecting a positional list at the first option, so gather the rest here
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any("=" not in e or e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        return args.func(args)
    except ValueError as err:  # ConfigError, DataError, CheckpointError: one line naming the field or file
        print(f"keel: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
