"""`keel bench`: its command line. The model, run and optimiser settings come from the one config merge
(`--preset`, `--config`, `key=value`, as `keel train` takes them); the flags here are only what is bench's own
(which schemes, how many timed steps, the depth series, where to write)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from keel import runtime, safe_io
from keel.bench import MODELLED_GPUS
from keel.cli import COMMANDS
from keel.cli.support import output_dir
from keel.config import add_config_arguments, load_config
from keel.config.presets import DEFAULT_PRESET
from keel.config.reads import Reads
from keel.errors import ConfigError, KeelError
from keel.model.architecture import with_scheme
from keel.runtime import machine, resolve_device, use_bf16

# What the comparison reads of the merged config (besides every model.* field): everything else given is refused
RUN_FIELDS = ("batch_size", "seq_len", "grad_accum", "seed", "device", "dtype", "compile", "fused_junction",
              "ac_every", "threads")
OPTIM_FIELDS = ("lr", "beta1", "beta2", "eps", "weight_decay", "decay_norms_and_embeddings", "grad_clip")
HINTS = {"model.scheme": "the schemes compared are --schemes; name it there too",
         "run.steps": "timed steps are --steps", "run.out_dir": "the output directory is --out",
         "run.name": "the output directory is --out", "data": "bench trains on synthetic batches",
         "optim": "bench steps at the constant rate optim.lr", "run": "bench runs in one process and writes no run"}
# What `--model-gpu <GPU>` reads of the merged config (besides every model.* field but the scheme: it predicts both)
MODEL_RUN_FIELDS = ("batch_size", "seq_len", "dtype", "ac_every")


def reads(args) -> Reads:
    """What this `keel bench` reads of the merged config, by mode: a field set in --config or an override that
    it does not read is refused by the merge. Every mode reads run.threads (applied before it times anything)."""
    if args.model_gpu:
        return Reads("keel bench", ("model", "run.threads", *(f"run.{f}" for f in MODEL_RUN_FIELDS)),
                     f"it reads model.* and run.{{{','.join(MODEL_RUN_FIELDS)}}}",
                     refuse={"model.scheme": "the model predicts both keel and pre_ln"})
    # the compared schemes are --schemes; model.scheme, when one of them, picks whose options apply
    return Reads("keel bench", ("model", *(f"run.{f}" for f in RUN_FIELDS), *(f"optim.{f}" for f in OPTIM_FIELDS)),
                 f"it reads model.*, run.{{{','.join(RUN_FIELDS)}}} and optim.{{{','.join(OPTIM_FIELDS)}}}",
                 only={"model.scheme": tuple(args.schemes.split(","))}, hints=HINTS)


def bench_config(args):
    """The merged config (--preset < --config < overrides) under this mode's `reads`, with its run.threads
    applied: once, before anything is timed. A mode that reads no model refuses --preset too."""
    declared = reads(args)
    if args.preset and "model" not in declared.fields:
        raise ConfigError(f"--preset: not used by keel bench ({declared.why})")
    config = load_config(args.overrides, args.config, args.preset, declared)
    runtime.set_threads(config.run.threads)
    return config


def run_model(args) -> str:
    """`--model-gpu`: the performance model's PREDICTED step at the merged config's shape."""
    import torch  # noqa: PLC0415

    from keel.bench.perf_model import DEVICES, calibrated
    from keel.bench.perf_report import prediction_markdown
    from keel.reporting.plan import memory_plan  # noqa: PLC0415

    config = bench_config(args)
    r, name = config.run, f"predicted-{args.model_gpu}"
    memory = memory_plan(config, device=torch.device("cuda"))["total"]
    spec = calibrated(args.model_gpu) or DEVICES[args.model_gpu]  # the dry run's model: one prediction
    text = prediction_markdown(config.model, r.batch_size, r.seq_len, spec, bf16=r.dtype != "float32",
                               ac_every=r.ac_every, memory=memory)
    print(text)
    if args.out:
        write_out(Path(args.out), f"{name}.md", text)
        print(f"written: {Path(args.out) / f'{name}.md'}")
    return text


def run(args) -> dict:
    """The comparison at the merged config's shape, then the depth series of the first scheme."""
    if args.model_gpu:
        return run_model(args)
    config = bench_config(args)  # a bad field answers at once, before torch loads
    from keel.bench.core import check_schemes, compare, depth_series, to_markdown

    schemes = args.schemes.split(",")
    check_schemes(schemes)
    model, run_cfg, device = config.model, config.run, resolve_device(config.run.device)
    result = {"machine": machine(device), "settings": {
        "preset": args.preset or DEFAULT_PRESET, "config_file": args.config, "overrides": args.overrides,
        "schemes": schemes,
        "steps": args.steps, "warmup": args.warmup, "n_sublayers": model.n_sublayers,
        "dtype": "bfloat16 autocast" if use_bf16(device, run_cfg.dtype) else "float32", "model": asdict(model),
        "run": {k: getattr(run_cfg, k) for k in RUN_FIELDS},
        "optim": {k: getattr(config.optim, k) for k in OPTIM_FIELDS}}}
    depths = args.depths
    fitting = fitting_depths(config, schemes, depths, device)  # by the memory plan, before anything is built
    result["compare"] = compare(model, run_cfg, schemes, args.steps, args.warmup, config.optim, device)
    result["depth"] = depth_series(with_scheme(model, schemes[0]), run_cfg, fitting, args.depth_steps,
                                   config.optim, device)
    result["depth"] += [{"n_sublayers": n, "skipped": "does not fit this device by the memory plan"}
                        for n in depths[len(fitting):]]
    table = to_markdown(result)
    print(table)
    if args.out:
        writer(Path(args.out), to_markdown)(result)
        print(f"written: {Path(args.out) / 'bench.json'}, {Path(args.out) / 'bench.md'}")
    else:
        print(json.dumps(result, indent=1))
    return result


def fitting_depths(config, schemes: list[str], depths: list[int], device) -> list[int]:
    """The comparison's shape must fit the device by the memory plan (else one ConfigError, before anything is
    built); so must the first of `depths`. Returns the depths up to the first that does not fit."""
    from keel.reporting.plan import check_memory  # noqa: PLC0415

    for scheme in schemes:
        check_memory(replace(config, model=with_scheme(config.model, scheme)), 1, device)
    fitting = []
    for n in depths:
        deep = replace(config, model=replace(with_scheme(config.model, schemes[0]), n_blocks=n // 2))
        try:
            check_memory(deep, 1, device, depth_field=f"--depths {n}")
        except ConfigError:
            if not fitting:
                raise
            break
        fitting.append(n)
    return fitting


def writer(out: Path | None, markdown):
    def write(result: dict) -> None:
        if out is not None:
            write_out(out, "bench.json", json.dumps(result, indent=1))
            write_out(out, "bench.md", markdown(result))
    return write


# The project's own suites were `keel bench` flags; they are scripts beside their data in the repository now, and a
# user who gives one of their flags is told where it went (argparse would only say "unrecognized arguments")
SUITES = "python benchmarks/cpu/suite.py (was --suite cpu) or python benchmarks/gpu/campaign.py (was --suite gpu)"
MOVED = {"suite": f"the project's suites run from a clone of the repository: {SUITES}",
         "toy": "python benchmarks/gpu/campaign.py --toy", "sections": f"a flag of {SUITES}",
         "idle_load": "python benchmarks/cpu/suite.py --idle-load",
         "idle_wait": "python benchmarks/cpu/suite.py --idle-wait",
         "validate_model": "the model's CPU twin is python benchmarks/gpu/validate_model.py"}


def check_moved(args) -> None:
    for name, where in MOVED.items():
        if getattr(args, name) is not None:
            raise ConfigError(f"--{name.replace('_', '-')}: no longer a keel bench flag; {where}")


DEPTH_LIMIT = 2 * 2**16  # sub-layers: ModelConfig's n_blocks limit


def parse_depths(text: str) -> list[int]:
    """--depths: comma-separated sub-layer counts, each an even integer >= 2 (one attention and one FFN per
    block); empty: no depth series."""
    if not text:
        return []
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 2 or int(item) % 2 or int(item) > DEPTH_LIMIT:
            raise ConfigError(f"--depths: got {item!r} in {text!r}; allowed: comma-separated even integers in "
                              f"[2, {DEPTH_LIMIT:,}] (sub-layers), e.g. 16,32,64")
        out.append(int(item))
    return out


def write_out(out: Path, name: str, text: str) -> Path:
    try:
        return safe_io.write_text(out, out / name, text)
    except KeelError as err:
        raise ConfigError(f"--out: {err}") from None


def cmd_bench(args) -> int:
    check_moved(args)
    args.depths = parse_depths(args.depths)
    args.out = output_dir(args.out, "--out")
    run(args)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help=COMMANDS["bench"],
        description="Alternating training steps of each scheme after warm-up; JSON and a table. The shape, device, "
                    "dtype, compile, checkpointing and optimiser are the merged config's (run.batch_size, "
                    "run.seq_len, run.dtype, ...): an override bench does not read is refused.")
    add_config_arguments(p)
    p.add_argument("--schemes", default="keel,pre_ln", help="the schemes compared, by their registry names")
    p.add_argument("--steps", type=int, default=10, help="timed steps per scheme")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per scheme first")
    p.add_argument("--depths", default="16,32,64,128,256,512,1024",
                   help="sub-layer counts for the depth series of the first scheme (empty: none)")
    p.add_argument("--depth-steps", type=int, default=3)
    p.add_argument("--out", help="directory for bench.json and bench.md")
    for name in MOVED:  # hidden: only to say where each went
        p.add_argument(f"--{name.replace('_', '-')}", nargs="?", const="", help=argparse.SUPPRESS)
    p.add_argument("--model-gpu", choices=MODELLED_GPUS,
                   help="print the performance model's PREDICTED step (keel.bench.perf_model) of Keel and Pre-LN at "
                        "the merged config's shape on this GPU, eager / compiled / compiled+fused (run.dtype auto "
                        "means bf16, as on a GPU)")
    p.set_defaults(func=cmd_bench, sets_threads=True)
