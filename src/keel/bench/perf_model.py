"""A roofline model of one training step of Keel and Pre-LN, as keel runs it; every figure it gives is a PREDICTION
(docs/scale.md#performance: how it counts; benchmarks/gpu/: its output with the formulas, its fit and its checks)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from keel.bench import MODELLED_GPUS
from keel.kernels.junction import MAX_FUSED_WIDTH
from keel.model import ModelConfig, count_params, flops_per_token
from keel.model.counting import count_param_tensors
from keel.model.sizes import paper
from keel.model.transformer import build_scheme
from keel.runtime import GPU_MEMORY, PEAK_BF16

IMPLS = ("eager", "compiled", "compiled+fused")
S = 4  # bytes of a residual-stream element: always float32 (keel.model.numerics)
# per element, eager RMSNorm as layers.RMSNorm runs it: pow, mean, x*rstd, gain*x (+ per-row add, rsqrt);
# backward by autograd's formulas: gain (mul + column sum), rstd (mul, mul + row sum), mean, pow (pow(x,1) copy,
# *2, *grad), and the add of the two paths into x
EAGER_NORM = {"rmsnorm": (28, 6, 92, 15), "layernorm": (8, 1, 16, 2)}  # fwd bytes, launches, bwd bytes, launches
# per parameter, float32: torch's foreach AdamW (decay, lerp m, v*b2 + g*g, sqrt, /bc, +eps, addcdiv, each a pass),
# or its fused AdamW (what keel runs on CUDA: p, g, m, v read and p, m, v written once)
ADAMW_BYTES = {"foreach": 84, "fused": 28}
CLIP_BYTES = 12  # per parameter: the grad norm reads every gradient, clipping multiplies them in place
OPTIM_LAUNCHES = {"foreach": 12, "fused": 3}  # multi-tensor ops per step (clip + AdamW), each over the tensor list


@dataclass(frozen=True)
class DeviceSpec:
    """Peak rates (dense, no sparsity) and the fractions of them assumed achievable (stated, not measured)."""

    name: str
    bf16_flops: float
    fp32_flops: float  # plain fp32 (keel does not enable TF32)
    bandwidth: float  # bytes/s
    memory: float  # bytes
    source: str
    matmul_eff: float = 0.70  # large cuBLAS GEMMs reach ~65-75% of the dense bf16 peak
    attention_eff: float = 0.40  # FlashAttention-2 (what SDPA runs) forward+backward on Hopper/Ampere
    memory_eff: float = 0.85  # a streaming copy reaches ~85-90% of the datasheet bandwidth
    launch_s: dict = field(default_factory=lambda: {"eager": 5e-6, "compiled": 3e-6})  # host time per kernel
    # host time per sub-layer and pass (forward, backward): module calls, autograd's bookkeeping, a compiled graph's
    # guards and call, beyond its kernels' launches; "recompute" (eager only: compiled, the recompute is inside the
    # backward graph): an eager checkpointed sub-layer's forward again, with checkpoint's hooks and RNG state
    sublayer_s: dict = field(default_factory=lambda: {"eager": 0.0, "compiled": 0.0})
    overlap: bool = True  # GPU: the host runs ahead, the step is the longer of host and device; CPU: they add
    # measured effective bandwidth (bytes/s) of keel's fused junction kernel forward+backward; None: the roofline
    fused_junction_bw: float | None = None
    calibrated: str = ""  # the measured run the host and memory terms were fitted to (`calibrated`); "" = assumed
    foreach_batch: int = 48  # tensors per launch of a foreach op (CUDA's multi_tensor_apply; a CPU loops in C++)


GB, TB = 1e9, 1e12
DEVICES = {  # vendor datasheets, SXM parts; bf16 peaks are keel.runtime.PEAK_BF16 (what bench's MFU divides by)
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 1,979 TFLOPS with sparsity (989 dense), FP32 67
    # TFLOPS, HBM3 3.35 TB/s, 80 GB
    "H100": DeviceSpec("H100", PEAK_BF16["H100"], 67 * TB, 3.35 * TB, GPU_MEMORY["H100 80GB"],
                       "NVIDIA H100 datasheet (SXM)"),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): same compute as H100 SXM, HBM3e 4.8 TB/s, 141 GB
    "H200": DeviceSpec("H200", PEAK_BF16["H200"], 67 * TB, 4.8 * TB, GPU_MEMORY["H200 141GB"],
                       "NVIDIA H200 datasheet (SXM)"),
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16 312 TFLOPS dense, FP32 19.5 TFLOPS,
    # HBM2e 2,039 GB/s
    "A100": DeviceSpec("A100", PEAK_BF16["A100"], 19.5 * TB, 2.039 * TB, GPU_MEMORY["A100 80GB"],
                       "NVIDIA A100 datasheet (80GB SXM)"),
}
assert tuple(DEVICES) == MODELLED_GPUS  # one list of names: the one `keel bench --model-gpu` offers
# each measured GPU's efficiencies fitted to its newest measured run: the measurements and the fit are the project's
# (benchmarks/gpu/measured_gpu.json, benchmarks/gpu/calibrate.py); only the fitted numbers ship with the package
FITS = Path(__file__).with_name("calibrated_gpu.json")


def calibrated(device: str) -> DeviceSpec | None:
    """DEVICES[device] with the efficiencies fitted to the newest step times measured on it (FITS), or None where
    none were measured. `python benchmarks/gpu/calibrate.py --store` refits FITS after a new measurement. A
    prediction from the calibrated model is still a PREDICTION."""
    fit = json.loads(FITS.read_text()).get(device)
    if fit is None:
        return None
    spec = DEVICES[device]
    if fit.get("fused_junction_bw") is not None:  # the kernel's bandwidth as it was measured, not fitted
        spec = replace(spec, fused_junction_bw=fit["fused_junction_bw"])
    return replace(spec, matmul_eff=fit["matmul_eff"], attention_eff=fit.get("attention_eff", spec.attention_eff),
                   memory_eff=fit["memory_eff"],
                   launch_s={"eager": fit["launch_eager"], "compiled": fit["launch_compiled"]},
                   sublayer_s={"eager": fit.get("sublayer_eager", 0.0), "compiled": fit.get("sublayer_compiled", 0.0),
                               "recompute": fit.get("sublayer_recompute", fit.get("sublayer_eager", 0.0))},
                   calibrated=fit["calibrated"])


class Op(NamedTuple):
    group: str  # matmul, attention, norm+junction, rope, activation, casts, embed/head/loss, optimizer
    phase: str  # fwd, bwd, recompute, step
    flops: float
    bytes: float
    launches: int
    kind: str = "memory"  # matmul, attention, memory or fused (keel's junction kernel): which peak bounds it


def _matmuls(M, K, N, c, bf16):
    """X (M, K) @ W (K, N): forward, input gradient, weight gradient; under autocast the fp32 weight is cast to
    bf16 once per step (autocast's cache) and its bf16 gradient back to fp32."""
    io = c * (M * K + K * N + M * N)
    ops = [Op("matmul", p, 2 * M * K * N, io, 1, "matmul") for p in ("fwd", "bwd", "bwd")]
    if bf16:
        ops += [Op("casts", p, 0, 6 * K * N, 1) for p in ("fwd", "bwd")]
    return ops


def _branch(config, kind, M, B, T, c, bf16, impl):
    """The attention or FFN branch from its input u (already in the compute dtype) to its output h."""
    d, q, kv, f = config.d_model, config.n_heads * config.head_dim, config.kv_heads * config.head_dim, config.ffn_dim
    eager = impl == "eager"
    if kind == "attn":
        ops = [o for n in (q, kv, kv) for o in _matmuls(M, d, n, c, bf16)] + _matmuls(M, q, d, c, bf16)
        # rope on q and k: eager neg(half), cat, x*cos, rot*sin, add; backward muls, neg, two slice scatters,
        # two adds; compiled one kernel each way
        fwd, bwd = (10 * c, 15 * c) if eager else (2 * c, 2 * c)
        ops += [Op("rope", "fwd", 0, fwd * M * (q + kv), 10 if eager else 2),
                Op("rope", "bwd", 0, bwd * M * (q + kv), 18 if eager else 2)]
        # SDPA's flash kernel: causal, so half the score matrix; backward recomputes scores (2.5x the forward)
        flops = 4 * B * T * T * q / 2
        ops += [Op("attention", "fwd", flops, c * M * (2 * q + 2 * kv), 1, "attention"),
                Op("attention", "bwd", 2.5 * flops, c * M * (4 * q + 4 * kv), 3, "attention")]
        if build_scheme(config).qkv_norm:
            fb, fl, bb, bl = EAGER_NORM[config.norm] if eager else (2 * c, 1, 5 * c, 2)
            ops += [Op("norm+junction", "fwd", 0, fb * M * (q + 2 * kv), 3 * fl),
                    Op("norm+junction", "bwd", 0, bb * M * (q + 2 * kv), 3 * bl)]
        return ops
    swiglu = config.ffn == "swiglu"
    ops = [o for _ in range(2 if swiglu else 1) for o in _matmuls(M, d, f, c, bf16)] + _matmuls(M, f, d, c, bf16)
    if swiglu:  # silu(g) * u: eager two passes, backward mul's two products and silu's; compiled one kernel each
        fwd, fl, bwd, bl = (5 * c, 2, 9 * c, 3) if eager else (3 * c, 1, 5 * c, 1)
    else:
        fwd, fl, bwd, bl = 2 * c, 1, 3 * c, 1
    return ops + [Op("activation", "fwd", 0, fwd * M * f, fl), Op("activation", "bwd", 0, bwd * M * f, bl)]


def _consumers(config, kind):
    return 3 if kind == "attn" else (2 if config.ffn == "swiglu" else 1)


@dataclass(frozen=True)
class Code:
    """What keel's code did at the junction when a step was measured, where it has changed since: a measured run is
    calibrated with the model of the code it ran (measured_gpu.json's "code"), and predictions use today's."""

    cast_once: bool = True  # under autocast a branch casts its float32 input once (keel.model.layers.compute_dtype),
    # not once per matmul (as older code did)
    fused_u_compute_dtype: bool = True  # the fused kernel writes u in the compute dtype, not float32 plus a cast
    sum_handoff: bool = True  # compiled under AC, a Keel block hands on alpha*x + h
    # (keel.scale.fused_junction.SumHandoff) and its recomputation skips the block's last matmul, as Pre-LN's does;
    # older code ended it with LN_out, whose input its backward needs, and ran that matmul again
    one_pass_norms: bool = True  # a compiled junction's two RMSNorms are one op whose backward reads two independent
    # row sums (keel.kernels.norm_pair): one backward kernel (PREDICTED, not measured); chained, as every measured
    # run had them, two (Inductor does not fuse a norm's backward after the one whose output it reads)
    fused_adamw: bool = True  # AdamW on CUDA is torch's fused kernel (keel.train.optim); foreach in the oldest run


def _boundary(config, prev, nxt, cons, c, bf16, mode, code: Code = Code()):
    """Bytes per token and launches between sub-layers: `y = norm_out(alpha*x + h)` of `prev` (None: the
    embedding) and `u = norm_in(y)` cast for the `cons` linears of `nxt` (None: the final norm and head).

    mode: "eager" (one pass per op), "graph" (both in one compiled graph), "split" (a compiled-graph boundary
    between the sum with norm_out and norm_in: the stream is written, then read back), "handoff" (the sum ends one
    graph, both norms start the next: keel.scale.fused_junction.SumHandoff), "fused" (keel.kernels.junction: one
    kernel each way, gains summed in registers; u written in the compute dtype the matmuls read, its gradient read
    back in it).

    Compiled, a graph's forward is one kernel; its backward is a chain of kernels, one per RMSNorm (Inductor's
    mix-order reduction computes a norm's input gradient and its gain's column sums in one pass, and does not fuse
    a norm's backward after the one whose output it reads) or one for a graph without a norm, and one for a norm
    pair whose backward reads two independent row sums (`code.one_pass_norms`, keel.kernels.norm_pair). The
    backward reads u's gradients and the stream's, each norm's float32 input (the pair: z alone, y recomputed),
    writes dx and dh, and each kernel after the first reads what the one before it wrote (2S)."""
    d = config.d_model
    n_out, n_in = bool(prev and prev.norm_out), bool(nxt and nxt.norm_in)
    has_u = nxt is not None and (n_in or bf16)  # a float32 branch without norm_in reads the stream itself
    du = cons * c  # the gradients of u from its linears
    if mode == "eager":
        nb, nl, bb, bl = EAGER_NORM[config.norm]
        norms = n_out + n_in + bool(prev and prev.norm_branch)
        fwd, lf, bwd, lb = nb * norms, nl * norms, bb * norms, bl * norms
        if prev:  # h cast to the stream, alpha*x (also alpha = 1.0: Residual multiplies), + h; backward alpha*g
            fwd, lf, bwd, lb = fwd + 20 + 6 * bf16, lf + 2 + bf16, bwd + 8 + 6 * bf16, lb + 1 + bf16
        if nxt and bf16 and code.cast_once:  # the branch casts u to bf16 once; backward: its consumers' bf16
            # gradients summed, cast back once, added to the gradient of y's other use
            fwd, lf = fwd + 6, lf + 1
            bwd, lb = bwd + 6 * (cons - 1) + 6 + 12, lb + cons + 1
        elif nxt:  # autocast casts u once per linear; the grads of u's consumers and of y's two uses are added
            fwd, lf = fwd + 6 * cons * bf16, lf + cons * bf16
            bwd, lb = bwd + 6 * cons * bf16 + 12 * cons, lb + cons * bf16 + cons
        return fwd * d, lf, bwd * d, lb
    if mode == "fused" and code.fused_u_compute_dtype:  # x, h in; y, u out (u in the compute dtype); backward:
        pre = cons > 1  # sum u's gradients, then x h dy du in, dx dh out
        return (2 * S + c + c) * d, 1, ((du + c) * pre + 3 * S + c + 2 * c) * d, 1 + pre + 4
    if mode == "fused":  # u written float32 and cast by one more kernel for the matmuls
        pre = bf16 or cons > 1
        return (3 * S + c + (S + c) * bf16) * d, 1 + bf16, ((du + S) * pre + 4 * S + 2 * c) * d, 1 + pre + 4
    pair = n_out and n_in and code.one_pass_norms  # one op, one backward kernel, reading z alone

    def chain(norms: int, both: bool) -> int:  # backward kernels of one graph's part of the junction
        return 1 if both and code.one_pass_norms else max(1, norms)
    if mode == "graph":  # x, h in, y, u out
        fwd, lf, kernels = (3 * S + c + c * has_u), 1, chain(n_out + n_in, n_out and n_in)
    elif mode == "handoff":  # graph A: x, h in, z out; graph B: z in, y, u out
        fwd, lf, kernels = 2 * S + c + 2 * S + c, 2, 1 + chain(n_out + n_in, n_out and n_in)
    else:  # graph A: x, h in, y out (its norm_out); graph B: y in, u out (its norm_in or the cast)
        fwd, lf = (2 * S + c) * bool(prev) + (S + c) * has_u, bool(prev) + has_u
        kernels = (max(1, n_out) if prev else 0) + (max(1, n_in) if has_u else 0)
    inputs = 1 if pair else n_out + n_in
    bwd = du * has_u + S + S + c * bool(prev) + S * inputs + 2 * S * (kernels - 1)
    return fwd * d, lf, bwd * d, kernels


def _reads_last_output(config: ModelConfig, scheme, specs: list, j: int, impl: str, code: Code) -> bool:
    """Whether the backward of the block ending with sub-layer j needs its branch output h: a norm on h
    (Peri-LN's norm_branch), or the block's output norm_out(alpha*x + h) (Post-LN; Keel unless it hands on the sum,
    which a compiled, checkpointed, unlooped Keel does at every junction and at the stack's end:
    keel.scale.fused_junction.SumHandoff)."""
    spec = specs[j]
    if spec.norm_branch:
        return True
    if not spec.norm_out:
        return False
    # a junction follows (the stack's last sub-layer: one of its own, NormOfSum then norms its sum at the root)
    junction = specs[j + 1].norm_in if j + 1 < len(specs) else spec.norm_in and not scheme.final_norm
    return not (junction and impl == "compiled" and code.sum_handoff and config.loop_blocks is None)


def step_ops(config: ModelConfig, batch: int, seq: int, bf16: bool, impl: str, ac_every: int = 0,
             code: Code = Code()) -> list[Op]:
    """Every op group of one training step (`batch` sequences of `seq` tokens, one micro-batch) of `code`."""
    if impl not in IMPLS:
        raise ValueError(f"impl: got {impl!r}; allowed: {', '.join(IMPLS)}")
    M, c, d, V = batch * seq, 2 if bf16 else 4, config.d_model, config.vocab_size
    scheme = build_scheme(config)
    kinds = ["attn", "ffn"] * config.n_blocks
    specs = [scheme.spec(i, k) for i, k in enumerate(kinds)]
    fusable = impl == "compiled+fused" and config.norm == "rmsnorm" and d <= MAX_FUSED_WIDTH
    handoff = impl == "compiled" and code.sum_handoff and config.loop_blocks is None
    checkpointed = {b for b in range(config.n_blocks) if ac_every and b % ac_every == 0}
    ops = []
    for j in range(config.n_sublayers + 1):  # boundary j sits before sub-layer j
        prev, nxt = (specs[j - 1] if j else None), (specs[j] if j < len(specs) else None)
        if impl == "eager":
            mode = "eager"
        elif fusable and prev and nxt and prev.norm_out and nxt.norm_in:
            mode = "fused"
        elif j % 2 and prev and nxt:  # per-block compile: the attention -> FFN boundary is inside a block's graph
            mode = "graph"
        elif handoff and prev and nxt and prev.norm_out and nxt.norm_in:
            mode = "handoff"
        else:
            mode = "split"
        fwd, lf, bwd, lb = _boundary(config, prev, nxt, _consumers(config, kinds[j]) if nxt else 0, c, bf16, mode,
                                     code)
        kind = "fused" if mode == "fused" else "memory"
        ops += [Op("norm+junction", "fwd", 0, fwd * M, lf, kind), Op("norm+junction", "bwd", 0, bwd * M, lb, kind)]
        if (max(j - 1, 0) // 2) in checkpointed:
            ops.append(Op("norm+junction", "recompute", 0, fwd * M, lf, kind))
        if nxt:
            branch = _branch(config, kinds[j], M, batch, seq, c, bf16, impl)
            ops += branch
            if j // 2 in checkpointed:
                again = [o for o in branch if o.phase == "fwd"]
                if j % 2 and impl != "eager" and not _reads_last_output(config, scheme, specs, j, impl, code):
                    # compiled, the partitioner recomputes only what the backward reads: not the block's last matmul
                    # (the FFN's down projection) when no norm's backward needs its output
                    last = max(i for i, o in enumerate(again) if o.kind == "matmul")
                    again = again[:last] + again[last + 1:]
                ops += [o._replace(phase="recompute") for o in again]
    # root, eager in every variant (only blocks are compiled): embedding gather and its dense scatter-add
    # gradient, the final norm (Pre-LN-like schemes), the head, float32 cross-entropy
    ops += [Op("embed/head/loss", "fwd", 0, 2 * S * M * d, 1), Op("embed/head/loss", "bwd", 0, 3 * S * M * d
                                                                  + S * V * d, 3)]
    if scheme.final_norm:
        nb, nl, bb, bl = EAGER_NORM[config.norm]
        ops += [Op("norm+junction", "fwd", 0, nb * M * d, nl), Op("norm+junction", "bwd", 0, bb * M * d, bl)]
    if bf16:
        ops += [Op("casts", "fwd", 0, 6 * M * d, 1), Op("casts", "bwd", 0, 6 * M * d, 1)]
    ops += [o._replace(group="embed/head/loss") for o in _matmuls(M, d, V, c, bf16)]
    ops += [Op("embed/head/loss", "fwd", 0, (8 + 6 * bf16) * M * V, 3),  # .float(), log_softmax, nll
            Op("embed/head/loss", "bwd", 0, (16 + 6 * bf16) * M * V, 4)]  # nll scatter, log_softmax, cast
    n, tensors = count_params(config), count_param_tensors(config)
    adamw = "fused" if code.fused_adamw else "foreach"
    ops.append(Op("optimizer", "step", 0, (ADAMW_BYTES[adamw] + CLIP_BYTES) * n, OPTIM_LAUNCHES[adamw] * tensors))
    return ops


PHASES = {"fwd": 0, "bwd": 1, "recompute": 1, "step": 2}  # the passes: forward, backward (recompute in it), step


def sublayer_passes(config: ModelConfig, ac_every: int = 0, impl: str = "eager") -> tuple[int, int, int]:
    """Sub-layer calls the host makes in a step: forward, backward, and eager checkpointed blocks' sub-layers
    forward again (in the backward pass). Compiled, a block's checkpoint is inside its graph (keel.scale.parallel:
    AC goes inside compile), so its recompute is kernels of the backward graph, not a call of its own."""
    checkpointed = sum(1 for b in range(config.n_blocks) if ac_every and b % ac_every == 0)
    return config.n_sublayers, config.n_sublayers, 2 * checkpointed * (impl == "eager")


class _Table(NamedTuple):
    """One step's op groups as arrays, built once per shape and code; a fit evaluates it on many devices."""

    flops: np.ndarray
    bytes: np.ndarray
    launches: np.ndarray
    optimizer: np.ndarray  # indices of the multi-tensor ops: launched once per `foreach_batch` tensors
    matmul: np.ndarray  # the other FLOP-bound kind is attention (memory ops count no FLOPs)
    fused: np.ndarray
    groups: tuple  # (name, op indices, flops, bytes) in order of first appearance
    flops_total: float
    bytes_total: float
    passes: tuple  # sublayer_passes
    phases: tuple  # the op indices of each pass (PHASES)
    flops_per_token: float


@functools.lru_cache(maxsize=512)
def _table(config: ModelConfig, batch: int, seq: int, bf16: bool, impl: str, ac_every: int, code: Code) -> _Table:
    ops = step_ops(config, batch, seq, bf16, impl, ac_every, code)
    names = list(dict.fromkeys(o.group for o in ops))
    groups = []
    for name in names:
        idx = [i for i, o in enumerate(ops) if o.group == name]
        flops = bytes_ = 0.0
        for i in idx:  # summed in op order, as a loop over the ops would
            flops += ops[i].flops
            bytes_ += ops[i].bytes
        groups.append((name, np.array(idx), flops, bytes_))

    def column(values, dtype=float):
        a = np.array(values, dtype=dtype)
        a.flags.writeable = False
        return a
    return _Table(column([o.flops for o in ops]), column([o.bytes for o in ops]), column([o.launches for o in ops]),
                  column([i for i, o in enumerate(ops) if o.group == "optimizer"], int),
                  column([o.kind == "matmul" for o in ops], bool),
                  column([o.kind == "fused" for o in ops], bool), tuple(groups), sum(o.flops for o in ops),
                  sum(o.bytes for o in ops), sublayer_passes(config, ac_every, impl),
                  tuple(column([i for i, o in enumerate(ops) if PHASES[o.phase] == p], int) for p in range(3)),
                  flops_per_token(config, seq))


def _in_order(values: np.ndarray) -> float:
    """values[0] + values[1] + ... left to right (np.sum pairs them up), so a sum is the op-by-op loop's to the
    last bit."""
    return float(np.add.accumulate(values)[-1]) if values.size else 0.0


def predict(config: ModelConfig, batch: int, seq: int, device: DeviceSpec, impl: str, bf16: bool = True,
            ac_every: int = 0, code: Code = Code()) -> dict:
    """Predicted step time, tokens/s and MFU of one training step of `code` (today's unless a measured run's), and
    time, FLOPs and bytes per op group: each op's roofline bound and its host's kernel launches (a multi-tensor op
    launches once per `foreach_batch`), summed over step_ops pass by pass."""
    t = _table(config, batch, seq, bf16, impl, ac_every, code)
    # every op at once: the same operations on the same numbers as tests/test_gpu_calibration.py's op-by-op loop
    peak = device.bf16_flops if bf16 else device.fp32_flops
    bandwidth = np.full(len(t.bytes), device.bandwidth * device.memory_eff)
    if device.fused_junction_bw:
        bandwidth[t.fused] = device.fused_junction_bw
    times = np.maximum(t.flops / np.where(t.matmul, peak * device.matmul_eff, peak * device.attention_eff),
                       t.bytes / bandwidth)
    launches = t.launches.copy()
    launches[t.optimizer] = np.ceil(launches[t.optimizer] / device.foreach_batch)
    per_kernel = launches * device.launch_s["eager" if impl == "eager" else "compiled"]
    per_pass = device.sublayer_s["eager" if impl == "eager" else "compiled"]
    forward, backward, again = t.passes
    calls = (forward * per_pass, backward * per_pass + again * device.sublayer_s.get("recompute", per_pass), 0.0)
    # the host runs ahead of the device within a pass, but a forward the host holds back cannot be made up by a
    # backward whose kernels outlast its launches: each pass's host time and device time meet
    host = [_in_order(np.concatenate(([c], per_kernel[idx]))) for c, idx in zip(calls, t.phases)]
    device_s = [_in_order(times[idx]) for idx in t.phases]
    memory_bound = t.bytes / (device.bandwidth * device.memory_eff) >= t.flops / (device.bf16_flops
                                                                                 * device.matmul_eff)
    bound_times = np.where(memory_bound, times, 0.0)  # adding 0.0 leaves a sum as it was
    groups = {name: {"time_s": _in_order(times[idx]), "flops": flops, "bytes": bytes_,
                     "memory_bound_s": _in_order(bound_times[idx])}
              for name, idx, flops, bytes_ in t.groups}
    kernels = sum(g["time_s"] for g in groups.values())
    # the host's time the device does not hide (a GPU's queue lets the host run ahead; a CPU does both in turn)
    exposed = sum(max(0.0, h - d) for h, d in zip(host, device_s)) if device.overlap else sum(host)
    groups["host"] = {"time_s": exposed, "flops": 0.0, "bytes": 0.0, "memory_bound_s": 0.0, "host_s": sum(host)}
    step = kernels + groups["host"]["time_s"]
    tps = batch * seq / step
    return {"step_time_s": step, "tokens_per_s": tps, "mfu": tps * t.flops_per_token / device.bf16_flops,
            "flops": t.flops_total, "bytes": t.bytes_total, "groups": groups}


def predict_pair(config: ModelConfig, batch: int, seq: int, device: DeviceSpec, impl: str, bf16: bool = True,
                 ac_every: int = 0, code: Code = Code()) -> dict:
    """Keel and Pre-LN at `config`'s shape, and their step-time ratio."""
    from keel.bench.core import scheme_config  # noqa: PLC0415 (core imports the training stack)

    out = {s: predict(scheme_config(config, s), batch, seq, device, impl, bf16, ac_every, code)
           for s in ("keel", "pre_ln")}
    out["keel_over_pre_ln_step_time"] = out["keel"]["step_time_s"] / out["pre_ln"]["step_time_s"]
    return out


def paper_config(d_model: int, n_sublayers: int, scheme: str = "keel") -> ModelConfig:
    """The paper's Table 8 shape (keel.model.sizes.paper) at width `d_model`, its SwiGLU FFN 3 x d_model."""
    return paper(n_sublayers, d_model=d_model, d_ffn=None, scheme=scheme)


def fits(config: ModelConfig, batch: int, seq: int, device: DeviceSpec, ac_every: int = 0, **plan) -> bool:
    """Whether keel.scale.memory's estimate of one process's training memory fits the device; `plan`: the rest of
    estimate_memory's options (bf16_autocast, optim_impl, state, weights, ...)."""
    from keel.scale.memory import estimate_memory  # noqa: PLC0415

    return estimate_memory(config, batch, seq, ac_every, **plan)["total"] <= device.memory
