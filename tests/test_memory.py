"""The memory model (keel.scale.memory) against what the model, AdamW and autograd actually hold."""

import contextlib

import pytest
import torch
from torch import nn

from keel.config import OptimConfig
from keel.model import lm_loss
from keel.model.architecture import ModelConfig
from keel.model.transformer import TransformerLM
from keel.scale.memory import activation_bytes, estimate_memory, measured_bytes, pipeline_memory
from keel.scale.parallel import apply_ac
from keel.train.optim import build_optimizer
from keel.train.step import TrainStep

SCHEMES = [{}, {"scheme": "pre_ln"}, {"scheme": "hybrid_norm"}, {"scheme": "peri_ln", "ffn": "gelu"},
           {"scheme": "deepnorm", "n_kv_heads": 2}, {"scheme": "mix_ln", "tie_embeddings": True}]


def saved_activation_bytes(model: nn.Module, *inputs) -> int:
    """Bytes of the tensors autograd saves for the backward pass of `model(*inputs)` (parameters and
    buffers excluded, each storage counted once). Runs one forward pass."""
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    return sum(seen.values())


def measure_phases(train_step, next_batch, lr: float = 1e-3, steps: int = 2) -> dict[str, int]:
    """Bytes of tensor storages live at each phase of `steps` steps of a keel.train.step.TrainStep, by torch's
    MemTracker (which also runs on a CPU): the peak of each phase over the steps. The phases are told apart by
    hooks: the model's forward returning ends "forward" ("backward" then runs to the optimiser step, clipping
    included), the optimiser's step pre- and post-hooks bound "optimizer"."""
    from torch.distributed._tools.mem_tracker import MemTracker  # noqa: PLC0415

    model, optimizer = train_step.model, train_step.optimizer
    device = next(model.parameters()).device

    class PhaseTracker(MemTracker):
        """MemTracker updates its own peak only at module boundaries; this one reads the live total after every
        operator, so a phase's peak includes its temporaries (the optimizer's foreach buffers)."""

        peak, phase = 0, None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.peak = max(self.peak, self._curr_mem_snap.get(device, {}).get("Total", 0))
            return out

    tracker = PhaseTracker()
    tracker.track_external(model, optimizer)
    peaks = dict.fromkeys(("forward", "backward", "optimizer"), 0)

    def switch(phase):
        if tracker.phase in peaks:
            peaks[tracker.phase] = max(peaks[tracker.phase], tracker.peak)
        tracker.phase, tracker.peak = phase, tracker.get_tracker_snapshot("current")[device]["Total"]

    hooks = [model.register_forward_hook(lambda *_: switch("backward")),
             optimizer.register_step_pre_hook(lambda *_: switch("optimizer")),
             optimizer.register_step_post_hook(lambda *_: switch(None))]
    try:
        with tracker:
            for _ in range(steps):
                tracker.reset_mod_stats()
                switch("forward")
                train_step(next_batch, lr)
    finally:
        for h in hooks:
            h.remove()
    return peaks


def one_step(cfg: ModelConfig) -> tuple[TransformerLM, torch.optim.Optimizer]:
    """A model of `cfg` and its AdamW after one step on a batch of 2 x 16 tokens (every state allocated)."""
    model = TransformerLM(cfg)
    optimizer = build_optimizer(model, OptimConfig())
    ids = torch.randint(0, 256, (2, 16))
    model(ids, ids)[1].backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("kw", SCHEMES)
def test_parameter_and_optimizer_bytes_are_exact(kw):
    cfg = ModelConfig(n_blocks=3, d_model=32, n_heads=4, max_seq_len=16, **kw)
    estimate, measured = estimate_memory(cfg, 2, 16), measured_bytes(*one_step(cfg))
    assert estimate["params"] == estimate["grads"] == measured["params"]
    assert estimate["optimizer"] == measured["optimizer"]


@pytest.mark.parametrize("ac_every", [0, 1, 3])
@pytest.mark.parametrize("kw", SCHEMES)
def test_activation_bytes_match_what_autograd_saves(kw, ac_every):
    cfg = ModelConfig(n_blocks=4, d_model=64, n_heads=4, max_seq_len=32, **kw)
    model = TransformerLM(cfg)
    apply_ac(model, ac_every)
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    measured = saved_activation_bytes(model, x, y)
    assert activation_bytes(cfg, 2, 32, ac_every, recompute=False) == pytest.approx(measured, rel=0.02)
    if ac_every:  # checkpointing keeps far less, and adds back one block while it is recomputed
        assert activation_bytes(cfg, 2, 32, ac_every) > measured
        assert activation_bytes(cfg, 2, 32, ac_every) < activation_bytes(cfg, 2, 32)


def test_sharding_divides_the_states_by_the_world_size():
    cfg = ModelConfig(n_blocks=8, d_model=64, n_heads=4, max_seq_len=32)
    one, four = estimate_memory(cfg, 2, 32), estimate_memory(cfg, 2, 32, world_size=4, fsdp_group=1)
    assert four["grads"] == one["grads"] // 4
    # AdamW's two float32 moments per parameter are sharded; its float32 step counter per tensor is on every rank
    params = list(TransformerLM(cfg).parameters())
    n, tensors = sum(p.numel() for p in params), len(params)
    assert (one["optimizer"], four["optimizer"]) == (8 * n + 4 * tensors, 8 * n // 4 + 4 * tensors)


LOOPED = [{"loop_blocks": 2}, {"loop_blocks": 1, "scheme": "pre_ln"}, {"loop_blocks": 2, "tie_embeddings": True}]


@pytest.mark.parametrize("kw", LOOPED)
def test_a_looped_model_holds_its_distinct_blocks_once_and_keeps_every_pass(kw):
    cfg = ModelConfig(n_blocks=4, d_model=32, n_heads=4, max_seq_len=16, **kw)
    estimate, measured = estimate_memory(cfg, 2, 16), measured_bytes(*one_step(cfg))
    assert estimate["params"] == measured["params"] and estimate["optimizer"] == measured["optimizer"]
    ids = torch.randint(0, 256, (2, 16))
    for ac_every in (0, 1, 2):
        model = TransformerLM(cfg)
        apply_ac(model, ac_every)
        saved = saved_activation_bytes(model, ids, ids)
        assert activation_bytes(cfg, 2, 16, ac_every, recompute=False) == pytest.approx(saved, rel=0.02), ac_every


class _Last(torch.nn.Module):
    """The last stage with the loss the pipeline schedule computes on its output."""

    def __init__(self, stage):
        super().__init__()
        self.stage = stage

    def forward(self, h, y):
        return lm_loss(self.stage(h), y)


@pytest.mark.parametrize("ac_every", [0, 1])
def test_each_pipeline_stage_holds_what_the_plan_says(ac_every):
    """pipeline_memory's per-rank parts against two stages of a real model (1F1B over 2 ranks, no replicas):
    the states of each rank's stage, and per micro-batch in flight the activations its forward saves."""
    from keel.scale.pipeline import Stage, split_blocks
    cfg = ModelConfig(n_blocks=4, d_model=64, n_heads=4, max_seq_len=32, tie_embeddings=False)
    model = TransformerLM(cfg)
    apply_ac(model, ac_every)
    spans = split_blocks(cfg, 2)
    stages = [Stage(model, spans[0], True, False), Stage(model, spans[1], False, True)]
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    plan = pipeline_memory(cfg, 4, 32, ac_every, world_size=2, pp=2, pp_microbatches=2)  # micro-batches of 2
    h = stages[0](x).detach().requires_grad_()
    saved = [saved_activation_bytes(stages[0], x), saved_activation_bytes(_Last(stages[1]), h, y)]
    in_flight = [2, 1]  # 1F1B: the first stage runs 2 forwards before its first backward, the last 1
    for rank, stage in enumerate(stages):
        optimizer = build_optimizer(stage, OptimConfig())
        for p in stage.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        measured = measured_bytes(stage, optimizer)
        assert plan[rank]["grads"] == measured["params"] and plan[rank]["optimizer"] == measured["optimizer"]
        recompute = plan[rank]["activations"] - in_flight[rank] * saved[rank]
        assert recompute == pytest.approx(0, abs=0.03 * plan[rank]["activations"]) if not ac_every else recompute > 0
    # the plan is the busiest rank's; two replicas halve the states and gather the whole stage
    assert estimate_memory(cfg, 4, 32, ac_every, world_size=2, pp=2, pp_microbatches=2) == max(
        plan, key=lambda m: m["total"])
    two = pipeline_memory(cfg, 4, 32, ac_every, world_size=4, pp=2, pp_microbatches=2)
    assert [m["grads"] for m in two] == [m["grads"] // 2 for m in plan]
    assert [m["params"] for m in two] == [m["params"] // 2 + m["params"] for m in plan]


# (model fields, batch, seq, ac_every, optimizer implementation, bf16 autocast): activation-heavy and
# parameter-heavy shapes; the activation-heavy ones (a second or more each) in the slow tier
SLOW = pytest.mark.slow
PHASE_CASES = [
    pytest.param({"d_model": 128, "n_blocks": 6}, 8, 128, 0, "foreach", False, marks=SLOW),
    pytest.param({"d_model": 128, "n_blocks": 6, "scheme": "pre_ln"}, 8, 128, 1, "foreach", False, marks=SLOW),
    pytest.param({"d_model": 128, "n_blocks": 6}, 8, 128, 1, "fused", False, marks=SLOW),
    ({"d_model": 384, "n_blocks": 4}, 1, 16, 0, "foreach", False),  # the optimizer step peaks: 20 bytes a parameter
    pytest.param({"d_model": 384, "n_blocks": 4}, 1, 16, 1, "fused", False, marks=SLOW),  # 16 (over a CPU second)
    pytest.param({"d_model": 384, "n_blocks": 4}, 2, 64, 0, "fused", True, marks=SLOW),  # bf16 copies of the
    # weights kept for the backward (1.1 CPU s; the first case keeps the check in the fast tier)
    pytest.param({"d_model": 384, "n_blocks": 4}, 2, 64, 1, "fused", True, marks=SLOW),  # ... and with checkpointing
    # only in the forward (over a second: tests/durations.json)
]


@pytest.mark.parametrize(("fields", "batch", "seq", "ac_every", "impl", "bf16"), PHASE_CASES)
def test_the_phase_plan_is_within_10_percent_of_torchs_storage_tracker(fields, batch, seq, ac_every, impl, bf16):
    """Each phase's bytes and the peak against MemTracker (torch's tracker of tensor storages, not RSS), over two
    training steps of the real model with AdamW; the plan also names the phase that peaks."""
    cfg = ModelConfig(vocab_size=256, n_heads=4, n_kv_heads=2, max_seq_len=seq, **fields)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    apply_ac(model, ac_every)
    optimizer = build_optimizer(model, OptimConfig(implementation=impl))
    ids = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    step = TrainStep(model, optimizer, autocast=autocast)
    measured = measure_phases(step, lambda: (ids[:, :-1], ids[:, 1:]))
    plan = estimate_memory(cfg, batch, seq, ac_every, optim_impl=impl, bf16_autocast=bf16)
    assert plan["total"] == pytest.approx(max(measured.values()), rel=0.10)
    assert measured[plan["peak_phase"]] == pytest.approx(max(measured.values()), rel=0.02)  # the peak phase too
    for phase in ("forward", "backward", "optimizer"):
        assert plan["phases"][phase] == pytest.approx(measured[phase], rel=0.10), phase


# run.weights=bfloat16 (bf16 weights and gradients, torchao's AdamW with stochastic rounding), with float32 or
# 8-bit moments: (model fields, batch, seq, ac_every, optim.state)
BF16_WEIGHT_CASES = [
    # parameter-heavy: the optimizer step or backward peaks (over a second: tests/durations.json)
    pytest.param({"d_model": 384, "n_blocks": 4}, 1, 16, 0, "float32", marks=SLOW),
    pytest.param({"d_model": 384, "n_blocks": 4}, 1, 16, 0, "8bit", marks=SLOW),
    pytest.param({"d_model": 128, "n_blocks": 6}, 8, 128, 1, "float32", marks=SLOW),  # activation-heavy, checkpointed
]


@pytest.mark.parametrize(("fields", "batch", "seq", "ac_every", "state"), BF16_WEIGHT_CASES)
def test_the_phase_plan_for_bf16_weights_is_within_10_percent_of_torchs_storage_tracker(fields, batch, seq, ac_every,
                                                                                       state, monkeypatch):
    pytest.importorskip("torchao")
    from keel.config import RunConfig
    from keel.train.step import hold_bf16_weights

    cfg = ModelConfig(vocab_size=256, n_heads=4, n_kv_heads=2, max_seq_len=seq, **fields)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    hold_bf16_weights(model, RunConfig(weights="bfloat16", dtype="bfloat16"), torch.device("cpu"))
    apply_ac(model, ac_every)
    optimizer = build_optimizer(model, OptimConfig(state=state))
    ids = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    step = TrainStep(model, optimizer, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    # torchao compiles its step into one fused kernel, which Dynamo refuses under a tracking dispatch mode: here
    # the step runs eagerly, and each parameter's update then makes float32 temporaries of its size (p, grad,
    # moments, intermediates) that the compiled step does not. The plan is the compiled step's.
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    measured = measure_phases(step, lambda: (ids[:, :-1], ids[:, 1:]))
    plan = estimate_memory(cfg, batch, seq, ac_every, bf16_autocast=True, state=state, weights="bfloat16")
    for phase in ("forward", "backward"):
        assert plan["phases"][phase] == pytest.approx(measured[phase], rel=0.10), phase
    eager_temporaries = 12 * 4 * max(p.numel() for p in model.parameters())
    assert plan["phases"]["optimizer"] * 0.9 <= measured["optimizer"] <= plan["phases"]["optimizer"] + eager_temporaries
    if plan["peak_phase"] != "optimizer":
        assert plan["total"] == pytest.approx(max(measured["forward"], measured["backward"]), rel=0.10)
    # half of float32 weights' plan for the same parameters and gradients
    plain = estimate_memory(cfg, batch, seq, ac_every, bf16_autocast=True, state=state)
    assert (plan["params"], plan["grads"]) == (plain["params"] // 2, plain["grads"] // 2)


@pytest.mark.parametrize("ac_every", [1, 2])
def test_a_keel_block_handing_on_its_sum_keeps_one_tensor_per_boundary_and_the_root_two_more(ac_every):
    """Compiled under AC, a Keel block hands on alpha*x + h (keel.scale.fused_junction.SumHandoff) and the root
    norms the
    last one (NormOfSum): the plan counts that norm's input and output, and nothing else changes. Measured on the
    eager model with the same modules swapped in (what the compiled one runs, without compiling)."""
    from keel.scale.fused_junction import apply_fused_junction
    from keel.scale.memory import hands_on_sum

    cfg = ModelConfig(n_blocks=4, d_model=64, n_heads=4, max_seq_len=32)
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    model = TransformerLM(cfg)
    # the two norms composed as autograd's chain, as the plan counts them: the one-pass pair (NormPair) keeps three
    # fewer (B, T, d) tensors per junction in an eager block, while Inductor's compiled blocks keep the same either way
    assert apply_fused_junction(model, "composed", compiled=True, checkpointed=True, one_pass=False) == 6
    apply_ac(model, ac_every)
    measured = saved_activation_bytes(model, x, y)
    plain = TransformerLM(cfg)
    apply_ac(plain, ac_every)
    # the norm's input and output, (B, T, d) float32 each, and its (B, T) rstd
    assert measured - saved_activation_bytes(plain, x, y) == (2 * 64 + 1) * 2 * 32 * 4
    assert hands_on_sum(cfg, ac_every, compiled=True) and not hands_on_sum(cfg, ac_every, compiled=False)
    assert activation_bytes(cfg, 2, 32, ac_every, recompute=False, compiled=True) == pytest.approx(measured, rel=0.02)
