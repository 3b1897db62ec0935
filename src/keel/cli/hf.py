"""The Hugging Face commands: `keel export-hf`, `keel import-hf` and `keel lm-eval` (keel.hf; the `hf` and `eval`
extras). Their arguments are built only when one of them runs."""

from __future__ import annotations

import json

from keel.cli import COMMANDS
from keel.cli.support import output_dir
from keel.errors import ConfigError, optional
from keel.runtime import check_device


def cmd_export_hf(args) -> int:
    optional("transformers", "hf", "keel export-hf")
    from keel.hf import quiet_progress
    from keel.hf.export import export_run

    quiet_progress()
    output_dir(args.out_dir, "export-hf: the output directory", empty=True, make=False)  # before the checkpoint is read
    out = export_run(args.run_dir, args.out_dir, args.checkpoint)
    print(f"exported {args.run_dir} to {out} (load with AutoModelForCausalLM.from_pretrained)")
    return 0


def cmd_import_hf(args) -> int:
    from keel.hf.import_hf import import_llama

    run_dir = import_llama(args.hf_dir, args.out_run_dir, args.data)
    print(f"imported {args.hf_dir} as a pre_ln run: {run_dir}")
    return 0


def cmd_lm_eval(args) -> int:
    tasks = [t for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError(f"--tasks: got {args.tasks!r}; allowed: comma-separated task names, e.g. hellaswag,arc_easy")
    check_device(args.device, "--device")
    optional("transformers", "eval", "keel lm-eval")
    optional("lm_eval", "eval", "keel lm-eval")
    from keel.data.hub import hub_offline_unless_reachable

    hub_offline_unless_reachable()  # offline: one line at once, not a minute of retries
    import torch

    from keel.hf import quiet_progress
    from keel.hf.harness import run_lm_eval

    quiet_progress()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    results, out = run_lm_eval(args.path, tasks, args.include_path, device, args.batch_size, args.num_fewshot,
                               args.limit, args.checkpoint)
    print(json.dumps(results["results"], indent=1, default=str))
    print(f"results: {out}")
    return 0


def add_export_hf_command(sub) -> None:
    p = sub.add_parser("export-hf", help=COMMANDS["export-hf"])
    p.add_argument("run_dir")
    p.add_argument("out_dir")
    p.add_argument("--checkpoint", help="a checkpoint directory (default: the run's newest intact one)")
    p.set_defaults(func=cmd_export_hf)


def add_import_hf_command(sub) -> None:
    p = sub.add_parser("import-hf", help=COMMANDS["import-hf"])
    p.add_argument("hf_dir", help="a directory with config.json, model.safetensors and tokenizer.json")
    p.add_argument("out_run_dir")
    p.add_argument("--data", default="stdlib", help="data.source that `keel eval` of the new run reads")
    p.set_defaults(func=cmd_import_hf)


def add_lm_eval_command(sub) -> None:
    p = sub.add_parser("lm-eval", help=COMMANDS["lm-eval"])
    p.add_argument("path", help="a run directory or a transformers model directory (e.g. from export-hf)")
    p.add_argument("--tasks", required=True, help="comma-separated task names, e.g. hellaswag,arc_easy")
    p.add_argument("--include-path", help="a directory of your own task YAML files")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--limit", type=float, help="examples per task (a fraction if < 1)")
    p.add_argument("--batch-size", type=int, default=1, help="rows per batch (default 1; rows are never padded)")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda, cuda:1, ...")
    p.add_argument("--checkpoint", help="for a run directory: a checkpoint directory (default: newest intact)")
    p.set_defaults(func=cmd_lm_eval)

