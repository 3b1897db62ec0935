"""The `keel` command: a thin dispatcher over the library; a `KeelError` is one line and exit code 2, anything else
a bug with its traceback (docs/internals.md#keelcli)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from keel import runtime
from keel._version import __version__
from keel.cli.support import (
    PLOT_FORMATS,
    DefaultsShown,
    Parser,
    add_data_arguments,
    check_flags,
    error_line,
    output_path,
    printable,
    run_interruptible,
    writable,
)
from keel.errors import ConfigError, KeelError
from keel.launch import launcher_environment
from keel.runs.trust import trusting


def _no_preset(args, why: str) -> None:  # --preset names a whole config: refused, not dropped, where a run's is used
    if getattr(args, "preset", None):
        raise ConfigError(f"--preset: not used with {why}")


def cmd_summary(args) -> int:
    from keel.config import load_config, merge
    from keel.config.reads import SUMMARY, SUMMARY_OF_RUN
    from keel.runs.run_dir import RunDir

    run_dir = args.run_dir
    if run_dir and "=" in run_dir:  # `keel summary scheme=pre_ln`: the optional positional took an override
        args.overrides, run_dir = [run_dir, *args.overrides], None
    if run_dir:  # that run's model, as it was trained
        _no_preset(args, "a run directory (its own config is described)")
        config = merge(RunDir.open(run_dir).config(), args.config, args.overrides, SUMMARY_OF_RUN)
    else:
        config = load_config(args.overrides, args.config, args.preset, SUMMARY)
    from keel.reporting.plan import describe  # torch: after the config's checks, so a bad field answers at once

    print(describe(config.model))
    return 0


def cmd_train(args) -> int:
    from keel.config import load_config, to_yaml
    from keel.runs.run_dir import RunDir, latest_run

    config = load_config(args.overrides, args.config, args.preset)  # a bad field or value: one line, no torch
    resume_from = None
    if args.trust_config and not config.resume:
        raise ConfigError("--trust-config: only with resume=RUN (a new run's config is the one you gave)")
    if config.resume:
        _no_preset(args, "resume= (a resumed run continues with its own config)")
        run = latest_run(config.run.out_dir) if config.resume == "latest" else RunDir.open(config.resume)
        config = run.resume_config(args.overrides, args.config)
        resume_from = run.latest_checkpoint()
        from keel.runs.resume import check_resume_fits

        check_resume_fits(run.path, config, resume_from)  # as eval does, before the trainer allocates anything
    runtime.set_threads(config.run.threads)  # once, from the merged config, before any torch work
    if args.print_config:
        print(to_yaml(config), end="")
        return 0
    from keel.cli.support import DIVERGED_EXIT, INTERRUPTED_EXIT
    from keel.reporting.plan import plan, recipe_warnings
    from keel.train.trainer import Trainer

    if args.dry_run:
        from keel.bench.perf_report import time_lines  # noqa: PLC0415

        print(plan(config, time_lines(config)))
        return 0
    trainer = Trainer(config)
    from keel.scale.distributed import current

    if current().main:  # after the trainer's checks: a refused config gets one line
        for line in recipe_warnings(config):
            print(line, file=sys.stderr)
    summary = trainer.run(resume_from)
    if summary["diverged"]:
        print(f"keel: {summary['divergence_reason']} (diagnostic: {trainer.run_dir / 'diverged.json'})",
              file=sys.stderr)
        return DIVERGED_EXIT
    if summary["interrupted"]:
        return INTERRUPTED_EXIT
    if current().main:  # under torchrun, rank 0 speaks for the run
        from keel.reporting.tables import SUMMARY_KEYS, key_values

        print(json.dumps(summary, indent=1) if args.json else key_values(summary, SUMMARY_KEYS))
        print(f"run: {trainer.run_dir}")
    return 0


def cmd_runs(args) -> int:
    from keel.reporting.tables import table, task_columns
    from keel.runs.run_dir import find_runs

    rows = [r.describe() | task_columns(r.metrics()) for r in find_runs(args.dir)]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(table(rows, ["run", "scheme", "sub-layers", "d_model", "steps", "val_loss", "task_acc", "status"]))
    return 0


def cmd_plot(args) -> int:
    from keel.runs.run_dir import RunDir

    runs = [RunDir.open(r) for r in args.runs]
    if args.out:
        out = output_path(args.out, "--out", PLOT_FORMATS, owned=[r.path for r in runs])
    elif len(runs) == 1:
        out = runs[0] / "curves.png"
    else:  # beside the runs compared
        out = runs[0].parent / f"compare-{'-'.join(r.name for r in runs)[:120]}.png"
    from keel.reporting.plot import plot_runs

    print(f"wrote {plot_runs(runs, out)}")
    return 0


def cmd_eval(args) -> int:
    runtime.check_device(args.device, "--device")
    from keel.reporting.tables import EVAL_KEYS, key_values
    from keel.train.evaluate import evaluate_run

    result = evaluate_run(args.run_dir, args.checkpoint, args.split, args.batches, args.device)
    from keel.scale.distributed import current

    if not current().main:  # under torchrun every rank evaluated its share; rank 0 reports
        return 0
    print(json.dumps(result, indent=1) if args.json else key_values(result, EVAL_KEYS))
    from keel import safe_io

    name = Path(result["checkpoint"]).name
    out = Path(args.run_dir) / f"eval-{name}-{args.split}.json"
    safe_io.write_text(args.run_dir, out, json.dumps(result, indent=1))  # never through a planted link
    return 0


def cmd_generate(args) -> int:
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("--prompt: not valid UTF-8 text") from None
    import torch

    from keel.generate import generate
    from keel.runs.run_dir import load_model

    config, model, tokenizer, _ = load_model(args.run_dir, args.checkpoint)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise ConfigError("--prompt: empty after tokenisation; give at least one character")
    generator = torch.Generator().manual_seed(args.seed)
    out = generate(model, torch.tensor([ids]), args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                   generator=generator, eos_id=tokenizer.eos_id, use_cache=not args.no_cache)
    text = tokenizer.decode(out[0].tolist())
    print(text if args.raw else printable(text))
    return 0


def cmd_tokenizer(args) -> int:
    from keel.config import TrainConfig, merge
    from keel.config.reads import TOKENIZER
    from keel.data import build_corpus
    from keel.data.tokenizer import train_bpe

    out = writable(output_path(args.out, "--out", (".json",)), "--out")  # before training, which can take hours
    corpus = build_corpus(merge(TrainConfig(), args.config, args.overrides, TOKENIZER).data)
    tok = train_bpe(corpus.document_streams("train"), args.vocab_size, out)  # a file read a block at a time
    print(f"trained a byte-level BPE with {tok.vocab_size} tokens on {corpus.fingerprint[:12]}: {args.out}")
    return 0


def add_trust_argument(p) -> None:
    p.add_argument("--trust-config", action="store_true",
                   help="follow the run config's data paths even outside the run directory, and load the task "
                        "files its run.eval_tasks names (they can run code), when keel did not write that config "
                        "for you (a downloaded or copied run), as KEEL_TRUST_CONFIG=1 does (docs/reliability.md)")


def add_train_command(sub) -> None:
    from keel.config import add_config_arguments

    p = sub.add_parser("train", help=COMMANDS["train"],
                       description="Train. Settings are dotted key=value overrides, e.g. model.n_blocks=8 "
                                   "model.scheme=pre_ln run.steps=500 optim.lr=1e-3; resume=RUN_DIR continues a run.")
    add_config_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="print the model, the run and its memory plan; train nothing")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML; train nothing")
    p.add_argument("--json", action="store_true", help="print the end-of-run summary as JSON")
    add_trust_argument(p)
    p.set_defaults(func=cmd_train, sets_threads=True)


def add_eval_command(sub) -> None:
    p = sub.add_parser("eval", help=COMMANDS["eval"])
    p.add_argument("run_dir")
    p.add_argument("--checkpoint", help="a checkpoint directory (default: the run's newest intact one)")
    p.add_argument("--split", default="val", choices=["val", "train"])
    p.add_argument("--batches", type=int, default=0, help="number of batches (default: run.eval_batches)")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda, cuda:1, ...")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_trust_argument(p)
    p.set_defaults(func=cmd_eval)


def add_runs_command(sub) -> None:
    p = sub.add_parser("runs", help=COMMANDS["runs"])
    p.add_argument("dir", nargs="?", default="runs")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_runs)


def add_plot_command(sub) -> None:
    p = sub.add_parser("plot", help=COMMANDS["plot"])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", help="the PNG (default: RUN/curves.png for one run, compare-<names>.png beside them)")
    p.set_defaults(func=cmd_plot)


def add_generate_command(sub) -> None:
    p = sub.add_parser("generate", help=COMMANDS["generate"], formatter_class=DefaultsShown)
    p.add_argument("run_dir")
    p.add_argument("--prompt", default="def ", help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample after the prompt")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed")
    p.add_argument("--checkpoint", help="a checkpoint directory (default: the run's newest intact one)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context each step (no KV cache)")
    p.add_argument("--raw", action="store_true", help="print the text as generated, control characters included "
                                                      "(default: shown escaped, e.g. \\r)")
    p.set_defaults(func=cmd_generate)


def add_summary_command(sub) -> None:
    from keel.config import add_config_arguments

    p = sub.add_parser("summary", help=COMMANDS["summary"])
    p.add_argument("run_dir", nargs="?", help="a run directory: describe that run's model")
    add_config_arguments(p)
    p.set_defaults(func=cmd_summary)


def add_tokenizer_command(sub) -> None:
    p = sub.add_parser("tokenizer", help=COMMANDS["tokenizer"])
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--out", default="tokenizer.json")
    add_data_arguments(p, "data.source=corpus.txt")
    p.set_defaults(func=cmd_tokenizer)


def _registered_in(module: str, register: str = "register"):  # imported only when its command runs
    return lambda sub: getattr(importlib.import_module(f"keel.cli.{module}"), register)(sub)


# Every command and its one line of help. Only the command being run gets its arguments built (train's and
# bench's import torch, seconds): `keel --help`, `--version` and a mistyped command answer at once.
COMMANDS = {
    "train": "train a model (default: a 32-sub-layer Keel on the stdlib corpus)",
    "eval": "validation loss, perplexity and bits per byte of a run's checkpoint",
    "runs": "list the runs in a directory: scheme, depth, progress, last val loss, status",
    "plot": "loss, validation, LR and gradient-norm curves of runs on one PNG, and per-sub-layer telemetry heatmaps",
    "generate": "sample text from a run's checkpoint",
    "summary": "print a model's shape, counts and sub-layer layout (a preset's or a run's)",
    "tokenizer": "train a byte-level BPE tokenizer on a corpus",
    "data": "tokenise a corpus into token shards for training (keel data prepare)",
    "export-hf": "write a run's checkpoint as a Hugging Face transformers model directory",
    "import-hf": "convert a Llama transformers checkpoint into a pre_ln run directory",
    "lm-eval": "run lm-evaluation-harness tasks on a run or transformers directory",
    "experiment": "run one of the paper's experiments (results.json, plots, report.md)",
    "sweep": "run a study file (results/<study>/study.yaml or your own): its points, then its report",
    "bench": "time Keel against Pre-LN at identical shapes, and against depth",
}
_BUILDERS = {"train": add_train_command, "eval": add_eval_command, "runs": add_runs_command,
             "plot": add_plot_command, "generate": add_generate_command, "summary": add_summary_command,
             "tokenizer": add_tokenizer_command, "data": _registered_in("data", "add_data_command"),
             **{name: _registered_in("hf", f"add_{name.replace('-', '_')}_command")
                for name in ("export-hf", "import-hf", "lm-eval")},
             "experiment": _registered_in("experiment"), "sweep": _registered_in("experiment", "register_sweep"),
             "bench": _registered_in("bench")}


def build_parser(command: str | None = "all") -> argparse.ArgumentParser:
    """The `keel` parser with `command`'s arguments ("all": every command's; None or another name: the others
    are only a name and a line of help)."""
    parser = Parser(prog="keel", description="Deep Transformer LMs with the Keel residual.")
    parser.add_argument("--version", action="version", version=f"keel {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_line in COMMANDS.items():
        if command in ("all", name):
            _BUILDERS[name](sub)
        else:
            sub.add_parser(name, help=help_line, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    launcher_environment()  # before torch loads: OpenMP's wait policy, CUDA's allocator (keel.launch)
    return run_interruptible(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # keel's own options take no values
    parser = build_parser(command if command in COMMANDS else None)
    # key=value overrides may come before or after options (`keel experiment frontier --quick run.steps=9`):
    # argparse stops collecting a positional list at the first option, so gather the rest here
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any("=" not in e or e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        check_flags(args)  # every numeric flag in its range (support.flag_limits), before any file is read
        if not getattr(args, "sets_threads", False):  # train, bench and experiments: from their merged config
            runtime.set_threads(0)
        with trusting(getattr(args, "trust_config", False)):  # --trust-config: as KEEL_TRUST_CONFIG=1, this call only
            return args.func(args)
    except KeelError as err:  # ConfigError, DataError, CheckpointError, ExportError: one line naming the field/file
        print(error_line(err), file=sys.stderr)
        return 2

