"""What a run will be, before it runs: the model's layout and counts, and the memory one process needs; nothing
here builds the model (docs/internals.md#keelreportingplan)."""

from __future__ import annotations

import torch

from keel._version import __version__
from keel.config import optimizer_implementation
from keel.errors import ConfigError
from keel.model import CONFIG_FIELDS, ModelConfig, count_params, flops_per_token
from keel.model.schemes import SCHEME_OPTIONS
from keel.model.transformer import build_scheme
from keel.runtime import GPU_MEMORY, device_memory, resolve_device, use_bf16
from keel.scale.fused_junction import hands_on_sums
from keel.scale.memory import estimate_memory, format_bytes


def describe(config: ModelConfig) -> str:
    """A readable summary: shape, counts, and the sub-layer layout with runs of equal blocks merged.
    Read from the scheme, not a built model, so any depth is described at once."""
    scheme = build_scheme(config)
    specs = [scheme.spec(i, "attn" if i % 2 == 0 else "ffn") for i in range(config.n_sublayers)]
    lines = [f"keel {__version__}", "", "config:"]
    shown = config.scheme_options_shown()  # the scheme's own options as it uses them; no other scheme's
    lines += [f"  {name} = {shown[name] if name in shown else repr(getattr(config, name))}" for name in CONFIG_FIELDS
              if name not in SCHEME_OPTIONS or name in shown]
    n_total, n_body = count_params(config), count_params(config, embedding=False)
    lines += [
        "",
        f"depth: {config.n_sublayers} sub-layers (the paper's L; model.n_blocks = {config.n_blocks} blocks)",
        f"parameters: {n_total:,} ({n_body:,} without the input embedding)",
        f"training FLOPs per token at T={config.max_seq_len}: {flops_per_token(config):.4g}",
        f"final norm before the head: {'yes' if scheme.final_norm else 'no (the stack ends in a norm)'}",
        "",
        "sub-layers: x' = norm_out(alpha*x + norm_branch(F(norm_in(x))))",
    ]
    layout = [(a.alpha, a.norm_in, a.norm_branch, a.norm_out, f.alpha, f.norm_in, f.norm_branch, f.norm_out)
              for a, f in zip(specs[0::2], specs[1::2])]
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


def recipe_warnings(config) -> list[str]:
    """One line for each setting that makes a run other than it looks: a warm-up the run never leaves, or a
    tokenizer whose vocabulary fills a small part of model.vocab_size (the rest of the embedding and head
    never trains). Printed by the dry run and before training starts."""
    from keel.data.tokenizer import planned_vocab_size

    out = []
    r, o = config.run, config.optim
    if o.warmup_steps >= r.steps:
        out.append(f"keel: warning: optim.warmup_steps={o.warmup_steps} >= run.steps={r.steps}: the learning rate "
                   f"never leaves warm-up or reaches optim.lr={o.lr:g}; lower optim.warmup_steps or raise run.steps")
    tokens = planned_vocab_size(config.data.tokenizer)
    if tokens is not None and 2 * tokens <= config.model.vocab_size:
        out.append(f"keel: warning: data.tokenizer={config.data.tokenizer!r} has {tokens:,} tokens, "
                   f"{tokens / config.model.vocab_size:.1%} of model.vocab_size={config.model.vocab_size:,}; set "
                   f"model.vocab_size={tokens} or a tokenizer of that size (data.tokenizer=bpe:<vocab_size>)")
    return out


def memory_line(config, world_size: int = 1, device: torch.device | None = None) -> str:
    """One process's memory for a TrainConfig: parameters, gradients, AdamW state, activations."""
    m = memory_plan(config, world_size, device)
    parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in m.items()
                      if isinstance(v, int) and k != "total" and v)
    if "phases" not in m:  # a pipeline rank: the sum of its parts
        return f"{format_bytes(m['total'])} ({parts})"
    phases = ", ".join(f"{k} {format_bytes(v)}" for k, v in m["phases"].items())
    return f"{format_bytes(m['total'])} at its peak, the {m['peak_phase']} phase ({phases}; parts: {parts})"


def check_fits(config, data, world_size: int, device: torch.device) -> None:
    """ConfigError unless the run fits its prepared data (a validation window, the tokenizer's vocabulary)
    and its device's memory: refused before anything is allocated or written, not with an allocator error."""
    c, tok = config, data.tokenizer
    if c.run.eval_every and len(data.val) < c.run.seq_len + 1:
        raise ConfigError(f"run.eval_every: the validation split has {len(data.val)} tokens, fewer than "
                          f"run.seq_len + 1 = {c.run.seq_len + 1}; set run.eval_every=0 or raise data.val_fraction")
    if tok.vocab_size > c.model.vocab_size:
        raise ConfigError(f"model.vocab_size: {c.model.vocab_size} is smaller than tokenizer {tok.name!r}'s "
                          f"vocabulary ({tok.vocab_size}); set model.vocab_size>={tok.vocab_size}")
    check_memory(c, world_size, device)


def check_memory(config, world_size: int, device: torch.device, depth_field: str = "model.n_blocks") -> None:
    """ConfigError unless one training step of `config` fits the device's memory by the memory plan, naming what
    to change: the model (`depth_field`, model.d_model) where its weights, gradients and optimizer state alone do
    not fit, else the batch. Nothing is built or allocated to find out."""
    plan, have = memory_plan(config, world_size, device), device_memory(device)
    need = plan["total"]
    if not have or need <= have:
        return
    states = sum(v for k, v in plan.items() if k in ("params", "grads", "optimizer") and isinstance(v, int))
    line = f"({memory_line(config, world_size, device)}), more than the {format_bytes(have)} of {device}"
    if states > have:
        raise ConfigError(f"{depth_field}, model.d_model: the model's weights, gradients and optimizer state alone "
                          f"need about {format_bytes(states)} per process {line}; a smaller model, optim.state=8bit, "
                          "or more processes (FSDP2)")
    raise ConfigError(f"run.batch_size: one training step needs about {format_bytes(need)} per process {line}; "
                      "lower run.batch_size or run.seq_len, or set run.ac_every=1")


def memory_plan(config, world_size: int = 1, device: torch.device | None = None) -> dict[str, int]:
    """keel.scale.memory.estimate_memory for a TrainConfig on `world_size` processes: FSDP2, or run.pp stages."""
    r = config.run
    world_size = max(world_size, r.pp)  # a plan made before launch: one replica of the pipeline
    fsdp = world_size > 1 and r.pp == 1  # under a pipeline, FSDP2 shards stages over replicas, in float32
    device = device or torch.device("cuda" if r.device.startswith("cuda") else "cpu")
    bf16 = use_bf16(device, r.dtype)
    return estimate_memory(config.model, r.batch_size, r.seq_len, ac_every=r.ac_every, world_size=world_size,
                           param_bytes=2 if fsdp and bf16 else 4, bf16_autocast=bf16 and not fsdp,
                           fsdp_group=r.fsdp_group if fsdp else 0, pp=r.pp, pp_schedule=r.pp_schedule,
                           pp_microbatches=r.pp_microbatches, grad_accum=r.grad_accum,
                           optim_impl=optimizer_implementation(config.optim, device), state=config.optim.state,
                           weights=r.weights, compiled=hands_on_sums(r, config.model, device) and not fsdp)


def gpu_fit_lines(config) -> list[str]:
    """For one process on each GPU of GPU_MEMORY, by the memory plan: whether the run fits as configured, else the
    first options with which it would (PREDICTED; docs/internals.md#keelreportingplangpu_fit_lines)."""
    r, o = config.run, config.optim
    w = r.weights
    steps = [("as configured", o.implementation if o.implementation != "auto" else "fused", o.state, r.ac_every, w)]
    steps += [("with optim.implementation=fused", "fused", o.state, r.ac_every, w),
              ("with optim.implementation=fused optim.state=8bit", "fused", "8bit", r.ac_every, w),
              ("with optim.state=8bit run.ac_every=1", "fused", "8bit", 1, w),
              ("with run.weights=bfloat16 optim.state=8bit run.ac_every=1", "fused", "8bit", 1, "bfloat16")]
    out = []
    for gpu, have in GPU_MEMORY.items():  # what a process can use, the CUDA context taken off
        for text, impl, state, ac, weights in steps:
            need = estimate_memory(config.model, r.batch_size, r.seq_len, ac_every=ac, bf16_autocast=True,
                                   grad_accum=r.grad_accum, optim_impl=impl, state=state, weights=weights,
                                   compiled=hands_on_sums(r, config.model, torch.device("cuda"), True))["total"]
            if need <= have:
                out.append(f"  {gpu}: fits {text} ({format_bytes(need)} of {format_bytes(have)})")
                break
        else:
            out.append(f"  {gpu}: does not fit one GPU even with bf16 weights, 8-bit moments and checkpointing "
                       f"({format_bytes(need)} of {format_bytes(have)}): shard it (torchrun, FSDP2) or pipeline it")
    return out


def memory_lines(config) -> list[str]:
    """Memory, saying which figure applies: this run's peak on the device it would train on (run.device resolved
    here), then, unless that is a GPU, what one GPU would need instead and which GPUs that fits."""
    r = config.run
    device = resolve_device(r.device)
    fits = gpu_fit_lines(config)
    if device.type == "cuda":
        return [f"memory per process, this run's peak on {device}: {memory_line(config, device=device)}", *fits]
    dtype = "bf16 autocast" if use_bf16(device, r.dtype) else "float32"
    return [f"memory per process, this run's peak here on the CPU ({dtype}): {memory_line(config)}",
            "on one GPU instead (PREDICTED by the memory plan with bf16 autocast; validated on CPU within 10%):",
            *fits]


def plan(config, predicted: list[str] = ()) -> str:
    """`keel train --dry-run`: the model, the run's token budget, the memory plan, and `predicted` (the CLI's
    keel.bench.perf_report.time_lines: the run's time on a GPU by the calibrated performance model)."""
    r = config.run
    tokens = r.steps * r.batch_size * r.grad_accum * r.seq_len
    return "\n".join([
        describe(config.model), "",
        f"run: {r.steps} steps x {r.batch_size} x {r.grad_accum} sequences x {r.seq_len} tokens = {tokens:,} tokens "
        f"(per process), lr {config.optim.lr:g}, {config.optim.schedule} after {config.optim.warmup_steps} warm-up "
        f"steps, data {config.data.source!r}",
        *memory_lines(config),
        *predicted,
        *data_notes(config, tokens),
        *recipe_warnings(config),
    ])


def data_notes(config, tokens: int) -> list[str]:
    """What the run's data is, where a budget outgrows the offline default (the paper presets' case:
    keel.config.presets.PAPER_PRESETS), and the command that prepares the paper's data (docs/data.md's recipe)."""
    from keel.config.presets import PAPER_DATA  # noqa: PLC0415 (presets import config, which imports this module's users)

    out = []
    if config.data.source == "stdlib" and tokens > 10**9:
        out.append(f"data: 'stdlib', the offline default (Python's own source, tens of MB): {tokens:,} tokens repeat "
                   "it thousands of times; the paper trained on web text: tokenise FineWeb-EDU's 10B-token sample "
                   f"once into shards, `keel data prepare --out DIR --workers 16 {PAPER_DATA} "
                   f"data.tokenizer={config.data.tokenizer}` (needs network and `pip install datasets`), then train "
                   "with data.source=DIR (docs/data.md: the recipe, disk and time)")
    return out
