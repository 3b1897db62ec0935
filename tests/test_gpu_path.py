"""The GPU path checked on a CPU: each bench variant starts from nothing (the model of the previous one
is freed before the next is built, proved by a weak reference), compile warm-up is measured per scheme from an
empty cache with its graph count (benchmarks/gpu/cold_compile.py), and the fused-junction default under compile
is the measured-faster path."""

import gc
import statistics
import time
import weakref
from dataclasses import replace

import cold_compile
import pytest
import torch
from cold_compile import cold_warmup

from keel.bench import core
from keel.bench.core import Bench, compare
from keel.config import RunConfig
from keel.model import ModelConfig

TINY = ModelConfig(vocab_size=64, d_model=32, n_blocks=2, n_heads=2, n_kv_heads=1, max_seq_len=16)
RUN = RunConfig(batch_size=2, seq_len=16)


@pytest.mark.slow
def test_one_scheme_after_another_frees_the_first_model_before_the_second_is_built(monkeypatch):
    built, alive_at_build = [], []
    real = Bench.__init__

    def init(self, *args, **kwargs):
        gc.collect()
        alive_at_build.append([ref() is not None for ref in built])
        real(self, *args, **kwargs)
        built.append(weakref.ref(self.model))
    monkeypatch.setattr(Bench, "__init__", init)
    compare(TINY, RUN, ["keel", "pre_ln", "post_ln"], steps=1, warmup=0, together=False)
    assert alive_at_build == [[], [False], [False, False]]


@pytest.mark.slow  # over a second in tests/durations.json
def test_together_builds_every_scheme_before_stepping_them_and_frees_them_all_after(monkeypatch):
    built = []
    real = Bench.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        built.append(weakref.ref(self.model))
    monkeypatch.setattr(Bench, "__init__", init)
    compare(TINY, RUN, ["keel", "pre_ln"], steps=1, warmup=0, together=True)
    gc.collect()
    assert len(built) == 2 and all(ref() is None for ref in built)


@pytest.mark.slow  # compiles four models from an empty cache
def test_cold_warmup_compiles_each_scheme_from_nothing_and_counts_its_graphs():
    """Blocks are compiled one by one and share Block.forward: Pre-LN's blocks are all alike (one graph); Keel's
    first block follows the first-layer rule (two graphs, with the junction fused across blocks or not: the last
    block hands on its sum like the middle ones). A second call compiles again (nothing is reused)."""
    config = ModelConfig(vocab_size=64, d_model=32, n_blocks=4, n_heads=2, n_kv_heads=1, max_seq_len=16)
    run = RunConfig(batch_size=2, seq_len=16, compile=True)
    got = cold_warmup(config, run, ["keel", "pre_ln"], compile_backend="aot_eager")
    assert (got["keel"]["graphs"], got["pre_ln"]["graphs"]) == (2, 1)
    assert got["keel"]["recompiles"] == 1
    off = cold_warmup(config, RunConfig(batch_size=2, seq_len=16, compile=True, fused_junction="off"), ["keel"],
                      compile_backend="aot_eager")
    assert off["keel"]["graphs"] == 2


# The cold warm-up in fresh processes itself (each scheme in a process of its own, not this one; Keel's two graphs,
# Pre-LN's one) is checked by tests/test_gpu_campaign.py's toy campaign, whose warm-up section is this call at the
# same size: it was run a second time here.


def test_repeated_cold_warmup_alternates_the_order_and_reports_the_median(monkeypatch):
    # each repeat reversed from the last, so no scheme always pays for going first; the fake child's seconds are
    # the order it ran in
    ran = []

    def first_steps(config, run, optim, device, options, cache, timeout):
        ran.append(config.scheme)
        return {"first_step_s": float(len(ran)), "second_step_s": 0.5, "graphs": 1, "recompiles": 0,
                "pid": len(ran)}

    monkeypatch.setattr(cold_compile, "_first_steps_in_process", first_steps)
    got = cold_warmup(TINY, RUN, ["keel", "pre_ln"], repeats=3, processes=True)
    assert ran == ["keel", "pre_ln", "pre_ln", "keel", "keel", "pre_ln"]
    assert got["keel"]["each_first_step_s"] == [1.0, 4.0, 5.0] and got["pre_ln"]["each_first_step_s"] == [2.0, 3.0, 6.0]
    assert got["keel"]["first_step_s"] == statistics.median([1.0, 4.0, 5.0]) == 4.0
    assert got["pre_ln"]["processes"] == [2, 3, 6] and got["pre_ln"]["n"] == 3


def test_a_time_boxed_cold_warmup_records_a_failed_measurement_and_saves_as_it_goes(monkeypatch):
    # in a GPU window a child that fails (or outlives the box) must not take the measurements already made with it
    timeouts = []

    def first_steps(config, run, optim, device, options, cache, timeout):
        timeouts.append(timeout)
        if config.scheme == "pre_ln":
            raise RuntimeError("cold warm-up of pre_ln in a fresh process failed:\nout of memory")
        return {"first_step_s": 2.0, "second_step_s": 0.5, "graphs": 2, "recompiles": 1, "pid": 1}

    monkeypatch.setattr(cold_compile, "_first_steps_in_process", first_steps)
    seen = []
    got = cold_warmup(TINY, RUN, ["keel", "pre_ln"], repeats=2, processes=True, deadline=time.monotonic() + 600,
                      progress=lambda summary: seen.append(summary))
    assert got["keel"]["n"] == 2 and got["keel"]["first_step_s"] == 2.0
    assert got["pre_ln"] == {"n": 0, "failed": ["cold warm-up of pre_ln in a fresh process failed:"] * 2}
    assert len(seen) == 4 and seen[0] == {"keel": got["keel"] | {"n": 1, "each_first_step_s": [2.0],
                                                               "processes": [1]}}
    assert all(t > cold_compile.DEADLINE_GRACE_S for t in timeouts)  # a child outliving the box is stopped
    with pytest.raises(RuntimeError, match="out of memory"):  # without a time box a failure is an error
        cold_warmup(TINY, RUN, ["pre_ln"], processes=True)


def test_cold_warmup_reports_the_median_of_its_fresh_processes(monkeypatch):
    times = iter([1.0, 2.0, 9.0])  # median 2, mean 4

    def first_steps(config, run, optim, device, options, cache, timeout):
        return {"first_step_s": next(times), "second_step_s": 0.5, "graphs": 1, "recompiles": 0, "pid": 1}

    monkeypatch.setattr(cold_compile, "_first_steps_in_process", first_steps)
    got = cold_warmup(TINY, RUN, ["pre_ln"], repeats=3, processes=True)
    assert got["pre_ln"]["each_first_step_s"] == [1.0, 2.0, 9.0] and got["pre_ln"]["first_step_s"] == 2.0


def test_the_step_times_of_cold_warmup_come_from_the_clock(monkeypatch):
    ticks = iter([10.0, 15.0, 20.0, 22.0])  # a step reads the clock at its start and its end: 5 s, then 2 s
    monkeypatch.setattr(core, "clock", lambda: next(ticks))
    got = cold_warmup(TINY, RUN, ["pre_ln"])
    assert (got["pre_ln"]["first_step_s"], got["pre_ln"]["second_step_s"]) == (5.0, 2.0)
    assert got["pre_ln"]["graphs"] == 0  # eager: nothing compiled


@pytest.mark.parametrize("variant", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])  # compiles: 1 s+
def test_compare_reports_graph_counts_only_when_compiled(variant):
    run = RunConfig(batch_size=2, seq_len=16, compile=variant == "compiled")
    out = compare(TINY, run, ["pre_ln"], steps=1, warmup=1, compile_backend="aot_eager")
    assert ("compile_graphs" in out["pre_ln"]) == (variant == "compiled")
    if variant == "compiled":
        assert out["pre_ln"]["compile_graphs"]["graphs"] == 1
    torch._dynamo.reset()


@pytest.mark.parametrize(("mode", "device", "compiled", "kernel_ok", "expected"), [
    ("auto", "cuda", True, True, "composed"),  # measured fastest on an H200: Inductor fuses it across blocks
    ("auto", "cuda", False, True, "kernel"),  # eager on CUDA: the kernel beats the unfused ops
    ("auto", "cpu", True, False, "composed"),
    ("auto", "cpu", False, False, None),
    ("on", "cuda", True, True, "kernel"),  # asked for explicitly
    ("on", "cpu", True, False, "composed"),
    ("off", "cuda", True, True, None),
    ("composed", "cuda", True, True, "composed"),
    ("composed", "cpu", True, False, "composed"),
])
def test_the_junction_default_under_compile_is_the_measured_faster_path(mode, device, compiled, kernel_ok, expected):
    from keel.scale.fused_junction import junction_impl

    assert junction_impl(mode, device, compiled, None if kernel_ok else "no triton") == expected


def test_fused_junction_on_or_composed_without_what_they_need_is_refused_in_one_line():
    from keel.errors import ConfigError
    from keel.scale.fused_junction import junction_impl

    with pytest.raises(ConfigError, match="run.fused_junction=on: no triton and run.compile is off"):
        junction_impl("on", "cpu", False, "no triton")
    with pytest.raises(ConfigError, match="run.fused_junction=composed: .* needs run.compile=true"):
        junction_impl("composed", "cuda", False, None)


HANDOFF_CASES = {  # (model fields, run.ac_every, junctions fused: Keel v2 with n sub-layers has n - 2)
    "keel": ({}, 1, 6),
    "keel-ac-every-2": ({}, 2, 6),
    "mix-ln": ({"scheme": "mix_ln"}, 1, 1),  # its one Post-LN to Pre-LN junction, at a block boundary
    "looped": ({"loop_blocks": 2}, 1, 2),  # no handoff: a looped block follows the embedding and the stack's end
}


@pytest.mark.parametrize("case", list(HANDOFF_CASES))
def test_the_sum_handoff_computes_what_the_plain_model_does(case):
    """The modules a compiled, checkpointed model runs (swapped in, run eagerly here) against the plain model, with
    norm gains away from 1 (at 1 a norm's weight cannot be told from another's): the same loss and gradients."""
    from keel.model import TransformerLM
    from keel.scale.fused_junction import apply_fused_junction, fused_junctions
    from keel.scale.parallel import apply_ac

    fields, ac_every, fused = HANDOFF_CASES[case]
    config = ModelConfig(vocab_size=64, d_model=32, n_blocks=4, n_heads=2, n_kv_heads=1, max_seq_len=16, **fields)
    torch.manual_seed(0)
    plain = TransformerLM(config)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model = TransformerLM(config)
    model.load_state_dict(plain.state_dict())
    assert apply_fused_junction(model, "composed", compiled=True, checkpointed=True) == fused
    assert fused_junctions(model) == fused
    apply_ac(model, ac_every)
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    out = []
    for m in (plain, model):
        _, loss = m(ids[:, :-1], ids[:, 1:])
        loss.backward()
        out.append((loss.detach(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in
                                    m.named_parameters()}))
    (want, plain_grads), (got, grads) = out
    assert torch.allclose(got, want, rtol=1e-6), (got, want)
    for name, g in plain_grads.items():
        assert torch.allclose(grads[name], g, rtol=1e-5, atol=1e-7), name


def backward_matmuls(scheme: str, ac_every: int, fused: str = "auto") -> tuple[list[int], dict]:
    """aten.mm nodes in each backward graph of a compiled (AC'd) model, in compile order, with Inductor's partitioner
    (what it recomputes), and the model's loss and gradients."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from keel.model import TransformerLM
    from keel.train.step import build_model

    counts = []

    def forward(gm, _):
        return make_boxed_func(gm)

    def backward(gm, _):
        counts.append(sum(n.target == torch.ops.aten.mm.default for n in gm.graph.nodes))
        return make_boxed_func(gm)
    backend = aot_autograd(fw_compiler=forward, bw_compiler=backward, partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    config = ModelConfig(vocab_size=64, d_model=32, n_blocks=3, n_heads=2, n_kv_heads=1, max_seq_len=16, scheme=scheme)
    torch.manual_seed(0)
    plain = TransformerLM(config)
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, model in (("plain", plain), ("compiled", build_model(
            config, RunConfig(compile=True, ac_every=ac_every, fused_junction=fused), torch.device("cpu"),
            model=TransformerLM(config), compile_backend=backend))):
        model.load_state_dict(plain.state_dict())
        _, loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        out[name] = (loss.detach(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in
                                     model.named_parameters()})
        out[f"{name}_model"] = model
    torch._dynamo.reset()
    return counts, out


@pytest.mark.slow  # compiles three models
def test_under_activation_checkpointing_a_keel_block_hands_on_its_sum_and_recomputes_no_more_matmuls_than_pre_ln():
    """A checkpointed block keeps only its input and recomputes the rest in its backward. Ending with LN_out, a Keel
    block would recompute its last matmul for that norm's input; handing on alpha*x + h instead (the next block
    normalises it), one tensor still crosses each boundary and the recomputation matches Pre-LN's, whose output
    x + h is not needed either. The model computes what the plain one does."""
    from keel.scale.fused_junction import FusedResidual, NormOfSum, fused_junctions

    pre_ln, _ = backward_matmuls("pre_ln", ac_every=1)
    keel, out = backward_matmuls("keel", ac_every=1)
    inside, _ = backward_matmuls("keel", ac_every=1, fused="off")  # each block ends with LN_out
    # one backward graph per block shape: Pre-LN one, Keel block 0 and the rest (the last compiles to the middle's)
    assert len(pre_ln) == 1 and len(keel) == 2 and len(inside) == 2
    assert keel[0] == pre_ln[0] and inside[0] == pre_ln[0] + 1  # the down projection, recomputed for LN_out
    model = out["compiled_model"]
    assert fused_junctions(model) == 4 and isinstance(model.final_norm, NormOfSum)  # 6 sub-layers: 1-2 ... 4-5
    assert sum(isinstance(m, FusedResidual) and m.hands_head for m in model.modules()) == 1  # the last hands its sum
    assert model.state_dict().keys() == out["plain_model"].state_dict().keys()
    (loss, grads), (plain_loss, plain_grads) = out["compiled"], out["plain"]
    assert torch.allclose(loss, plain_loss, rtol=1e-6)
    for name, g in plain_grads.items():
        assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-6 * g.abs().max()), name


def test_the_one_gpu_presets_fit_their_gpus_by_the_memory_plan_and_the_dry_run_says_so(capsys):
    """paper-1024 on one 80 GB GPU and paper-2048 on one 141 GB GPU, by the phase plan that
    tests/test_memory.py holds to torch's storage tracker; 20 bytes a parameter (float32 foreach AdamW) would not."""
    from keel.cli import main
    from keel.config.presets import train_preset
    from keel.runtime import GPU_MEMORY
    from keel.scale.memory import estimate_memory

    for name, gpu in (("paper-1024", "H100 80GB"), ("paper-2048", "H200 141GB")):
        c = train_preset(name)
        r = c.run
        need = estimate_memory(c.model, r.batch_size, r.seq_len, r.ac_every, bf16_autocast=True, optim_impl="fused",
                               state=c.optim.state)["total"]
        plain = estimate_memory(c.model, r.batch_size, r.seq_len, r.ac_every, bf16_autocast=True)["total"]
        assert need < GPU_MEMORY[gpu] - 2**29 < plain
        assert main(["train", "--preset", name, "--dry-run"]) == 0
        assert f"  {gpu}: fits as configured" in capsys.readouterr().out
    assert train_preset("paper-1024").model.n_sublayers == 1024 and train_preset("paper-2048").model.n_sublayers == 2048


def test_keels_extra_operators_per_sub_layer_are_its_second_norm_and_nothing_else():
    """Host cost at depth: Keel's eager step runs more ATen ops per sub-layer than Pre-LN's by exactly the ops of
    one more RMSNorm forward and backward (the norm the equation has; Pre-LN's shortcut is multiplied by its
    alpha = 1 too), counted independently on a lone RMSNorm."""
    from keel.model.layers import RMSNorm
    from op_count import OpCounter, aten_ops_per_sublayer

    x = torch.randn(2, 8, 32, requires_grad=True)
    norm = RMSNorm(32, 1e-5)
    with OpCounter() as with_norm:
        norm(x).sum().backward()
    with OpCounter() as without:
        x.sum().backward()
    one_norm = sum(with_norm.ops.values()) - sum(without.ops.values())
    keel, pre_ln = (aten_ops_per_sublayer(replace(TINY, scheme=s)) for s in ("keel", "pre_ln"))
    assert keel - pre_ln == one_norm


@pytest.mark.parametrize("mode", ["auto", "composed", "on", "off"])
@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("kernel", [False, True])
def test_hands_on_sums_says_what_apply_fused_junction_builds(mode, compiled, norm, kernel, monkeypatch):
    """The memory plan and the bench ask `hands_on_sums(run, config, device)` whether a run's model hands on sums
    (and norms the last at the root); the answer is what `apply_fused_junction` builds for that run, where the
    Triton kernel cannot run and where it can (its CPU interpreter standing in for CUDA), for RMSNorm and for
    LayerNorm, which the kernel does not compute."""
    from keel.errors import ConfigError
    from keel.kernels import junction
    from keel.model import TransformerLM
    from keel.scale.fused_junction import NormOfSum, SumHandoff, apply_fused_junction, hands_on_sums

    if kernel:
        pytest.importorskip("triton")
        monkeypatch.setattr(junction, "_INTERPRETED", True)  # building only: no kernel runs here
    config = replace(TINY, n_blocks=4, norm=norm)
    model = TransformerLM(config)
    try:
        apply_fused_junction(model, mode, compiled=compiled, checkpointed=True)
    except ConfigError:  # composed, or on where the kernel cannot run, without compile: refused up front
        assert not compiled and mode in ("composed", "on")
        return
    sums = any(isinstance(getattr(m, "junction", None), SumHandoff) for m in model.modules())
    run = replace(RUN, compile=compiled, fused_junction=mode, ac_every=1)
    assert hands_on_sums(run, config, torch.device("cpu")) == sums == isinstance(model.final_norm, NormOfSum)
    kernel_runs = kernel and norm == "rmsnorm"
    assert sums == (compiled and mode != "off" and not (mode == "on" and kernel_runs))
