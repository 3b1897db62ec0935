"""The fused Keel junction inside a model (keel.scale.fused_junction.apply_fused_junction)
against the plain composition.

The fused path needs triton's interpreter on CPU, which must be on before triton is first imported, so the fused
models train in one child process started with TRITON_INTERPRET=1 (this file run as a script); this process
trains the same models unfused and compares loss and every gradient.
"""

import inspect
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from keel.config import OptimConfig, RunConfig
from keel.errors import ConfigError
from keel.kernels.junction import available
from keel.model.architecture import ModelConfig
from keel.model.layers import RMSNorm
from keel.model.transformer import Residual, TransformerLM
from keel.scale.fused_junction import (
    FusedResidual,
    NormOfSum,
    StreamOfPair,
    apply_fused_junction,
    fused_junctions,
    junctions,
)
from keel.scale.parallel import apply_ac
from keel.train.optim import build_optimizer
from keel.train.step import TrainStep, build_model

# d=48 is not a power of two, so the kernel's masked lanes take part
BASE = ModelConfig(n_blocks=3, d_model=48, n_heads=2, n_kv_heads=1, max_seq_len=16)
# (name, config, RunConfig fields, bf16: None, "autocast" or "weights" (the whole model in bf16, as FSDP2's mixed
# precision and run.weights=bfloat16 have it), compile backend, fused junctions expected)
CASES = [
    ("keel-v2", BASE, {}, None, None, 4),  # sub-layer 0 has no LN_out: junctions 1-2, 2-3, 3-4, 4-5
    ("keel-first-none", replace(BASE, first_layer="none"), {}, None, None, 5),
    ("keel-ac", BASE, {"ac_every": 1}, None, None, 2),  # under AC inside blocks only: 2-3, 4-5
    ("keel-compiled", BASE, {"compile": True}, None, "aot_eager", 4),
    ("keel-bf16-autocast", BASE, {"dtype": "bfloat16"}, "autocast", None, 4),
    ("keel-bf16-weights", BASE, {}, "weights", None, 4),
    ("pre-ln", replace(BASE, scheme="pre_ln"), {}, None, None, 0),
    # 2 blocks applied twice: 5 of the 6 residuals fused (block 0's first attention has no LN_out); the residual
    # that ends the stack also feeds the second pass, so the head takes the stream from its pair
    ("keel-looped", replace(BASE, n_blocks=4, loop_blocks=2), {}, None, None, 5),
    ("keel-looped-one-block", replace(BASE, n_blocks=3, loop_blocks=1), {}, None, None, 3),
]
IDS = [c[0] for c in CASES]


def loss_and_grads(index: int, fused: str, device: str = "cpu", backend: str | None = None) -> dict:
    name, config, fields, bf16, case_backend, _ = CASES[index]
    torch.manual_seed(0)
    torch._dynamo.reset()
    counters.clear()
    plain = TransformerLM(config).to(torch.bfloat16 if bf16 == "weights" else torch.float32)
    model = build_model(config, RunConfig(device=device, fused_junction=fused, **fields), torch.device(device),
                        model=plain, compile_backend=backend or case_backend or "inductor")
    u_dtypes = set()  # the dtypes of the branch inputs u that fused junctions hand on
    hooks = [] if case_backend else [m.register_forward_pre_hook(
        lambda m, args: u_dtypes.add(str(args[0][1].dtype)) if isinstance(args[0], tuple) else None)
        for m in model.modules() if isinstance(m, FusedResidual)]
    # 2 x 8 tokens: 16 rows, each a program of the interpreted forward kernel (the backward's 4 programs loop over 4)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16 == "autocast"):
        _, loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    for h in hooks:
        h.remove()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.float().cpu() for n, p in model.named_parameters()}
    return {"loss": loss.detach().cpu(), "grads": grads, "fused": fused_junctions(model), "u_dtypes": u_dtypes,
            "graph_breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"]}


def graphs_per_phase(fused: str) -> list[int]:
    """Graphs Dynamo compiles in each of two rounds of (two training steps, one validation pass): the second
    round must compile none."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = build_model(BASE, RunConfig(device="cpu", compile=True, fused_junction=fused), torch.device("cpu"),
                        compile_backend="aot_eager")
    step = TrainStep(model, build_optimizer(model, OptimConfig(lr=1e-3, warmup_steps=0)))
    ids = torch.randint(0, BASE.vocab_size, (4, 2, 9), generator=torch.Generator().manual_seed(2))
    counts = []
    for phase in (ids[:2], ids[2:]):
        for batch in phase:
            step(lambda b=batch: (b[:, :-1], b[:, 1:]), 1e-3)
        model.eval()
        with torch.no_grad():
            model(phase[0][:, :-1])
        model.train()
        counts.append(counters["stats"]["unique_graphs"] - sum(counts))
    return counts


def interpreted_child(results_path: str) -> None:
    results = [loss_and_grads(i, "on") for i in range(len(CASES))]
    try:
        apply_fused_junction(TransformerLM(replace(BASE, norm="layernorm")), "on")
        refused = None
    except ConfigError as err:
        refused = str(err)
    torch.save({"cases": results, "layernorm_on": refused, "graphs_per_phase": graphs_per_phase("on"),
                "auto_under_interpreter": apply_fused_junction(TransformerLM(BASE), "auto")}, results_path)


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    pytest.importorskip("triton")
    path = tmp_path_factory.mktemp("fused_model") / "results.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, str(path)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(path)


@pytest.mark.slow  # the interpreted child process takes ~20 s
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_fused_model_trains_like_the_plain_composition(fused, index):
    check_against_plain(fused["cases"][index], loss_and_grads(index, "off"), index)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_fused_model_on_cuda_trains_like_the_plain_composition(index):
    """The compiled case through Inductor here, which runs the kernel as an opaque call in generated code."""
    pytest.importorskip("triton")
    got = loss_and_grads(index, "on", "cuda", backend="inductor")
    # GPU reductions (and Inductor's) are ordered differently again: float32 agreement to 1e-4 of the scale
    check_against_plain(got, loss_and_grads(index, "off", "cuda", backend="inductor"), index, rel_float32=1e-4)


def check_against_plain(got: dict, plain: dict, index: int, rel_float32: float = 1e-5) -> None:
    name, _, _, bf16, backend, expected = CASES[index]
    assert plain["fused"] == 0 and got["fused"] == expected
    if expected and backend is None:  # u in the dtype the next branch computes in: autocast's, else its weights'
        assert got["u_dtypes"] == {"torch.bfloat16" if bf16 in ("weights", "autocast") else "torch.float32"}
    # Relative to each tensor's scale. float32: the kernel sums in another order than PyTorch, so results agree to
    # float32 rounding, grown through a few sub-layers. bf16 autocast: a last-bit difference in a branch input can
    # flip its bf16 rounding, one bf16 step (2^-8) that the branches carry on; 2e-2 is a few such steps (bf16
    # weights: their gradients are bf16 too, and the interpreter truncates u to bf16 where PyTorch rounds).
    rel = 2e-2 if bf16 else rel_float32
    torch.testing.assert_close(got["loss"], plain["loss"], rtol=rel, atol=0)
    assert got["grads"].keys() == plain["grads"].keys()  # the hook registers nothing: state dicts are unchanged
    for key, grad in plain["grads"].items():
        torch.testing.assert_close(got["grads"][key], grad, rtol=rel, atol=rel * grad.abs().max().item(), msg=key)
    if backend is not None:  # the custom op stays in the compiled block's graph
        assert got["graph_breaks"] == 0
        assert got["graphs"] == 2  # block 0 (tensor in), every other block (pair in and out, the last one too)


@pytest.mark.slow
def test_fused_compiled_training_compiles_nothing_after_warmup(fused):
    # block 0 and the rest, in train and in eval mode; then nothing new
    assert fused["graphs_per_phase"] == [4, 0]


@pytest.mark.slow
def test_fused_refusals_and_auto_under_the_interpreter(fused):
    assert "RMSNorm" in fused["layernorm_on"]
    assert fused["auto_under_interpreter"] == 0  # auto never fuses on CPU, not even where the interpreter could


def test_auto_does_not_fuse_on_cpu_and_on_says_why():
    if available(torch.zeros(1, 8)):
        pytest.skip("triton's interpreter is on in this process")
    cpu = torch.device("cpu")
    assert fused_junctions(build_model(BASE, RunConfig(fused_junction="auto"), cpu)) == 0
    assert fused_junctions(build_model(BASE, RunConfig(fused_junction="off"), cpu)) == 0
    with pytest.raises(ConfigError, match="fused_junction=on.*cannot run on cpu"):
        build_model(BASE, RunConfig(fused_junction="on"), cpu)
    # nothing to fuse is not an error
    assert fused_junctions(build_model(replace(BASE, scheme="pre_ln"), RunConfig(fused_junction="on"), cpu)) == 0


def pairs(config: ModelConfig, across_blocks: bool = True) -> list[tuple[int, int]]:
    """Junctions as (sub-layer, next sub-layer) indices; in a looped model the first sub-layer each residual
    computes."""
    model = TransformerLM(config)
    index = {}
    for s in model.sublayers():
        index.setdefault(id(model.get_submodule(s.path)), s.index)
    return sorted((index[id(a)], index[id(b)]) for a, b in junctions(model, across_blocks))


def test_junctions_are_a_norm_out_followed_by_a_norm_in():
    assert pairs(BASE) == [(1, 2), (2, 3), (3, 4), (4, 5)]
    assert pairs(BASE, across_blocks=False) == [(2, 3), (4, 5)]  # under FSDP: inside a block only
    assert pairs(replace(BASE, first_layer="v1")) == [(2, 3), (3, 4), (4, 5)]
    assert pairs(replace(BASE, scheme="pre_ln")) == pairs(replace(BASE, scheme="post_ln")) == []
    assert pairs(replace(BASE, scheme="peri_ln")) == []  # its second norm is on the branch, not the stream
    mix = replace(BASE, n_blocks=4, scheme="mix_ln", mix_ln_fraction=0.5)
    assert pairs(mix) == [(3, 4)]  # the one Post-LN to Pre-LN boundary
    # looped, 2 blocks x 2 passes: block 1's FFN (sub-layers 3 and 7) always precedes block 0's later-pass
    # attention (its own residual, sub-layer 4), or ends the stack
    assert pairs(replace(BASE, n_blocks=4, loop_blocks=2)) == [(1, 2), (2, 3), (3, 4), (4, 5), (5, 2)]
    # ... where the head can take the stream of a pair (`StreamOfPair`, in place of an identity final norm); a
    # final norm could not, so the residual that ends the stack would not be fused
    looped = TransformerLM(replace(BASE, n_blocks=4, loop_blocks=2))
    looped.final_norm = RMSNorm(BASE.d_model)
    assert len(junctions(looped)) == 4


def test_the_models_residual_is_the_papers_equation_with_no_junction_path():
    """The fused junction lives outside the model (keel.scale.fused_junction swaps modules in): the model's own
    sub-layer and stack know nothing of pairs."""
    assert not hasattr(Residual, "junction")
    source = inspect.getsource(Residual) + inspect.getsource(TransformerLM.run_blocks)
    assert "tuple" not in source and ".junction" not in source


def loss_and_grads_of(model: TransformerLM) -> tuple[torch.Tensor, dict]:
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    _, loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def structure(model: nn.Module) -> list[tuple[str, str]]:
    return [(name, type(m).__name__) for name, m in model.named_modules()]


# The compiler's fusion ("composed", for a model about to be compiled) swaps the same modules as the kernel and
# needs no triton, so these run eagerly in this process: it computes exactly the plain composition.
@pytest.mark.parametrize("config", [BASE, replace(BASE, n_blocks=4, loop_blocks=2), replace(BASE, loop_blocks=1)],
                         ids=["keel", "keel-looped", "keel-looped-one-block"])
def test_swapping_in_the_junction_keeps_parameters_state_dict_and_numbers(config):
    torch.manual_seed(0)
    model = TransformerLM(config)
    keys, params = list(model.state_dict()), list(model.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    plain_loss, plain_grads = loss_and_grads_of(model)
    plain_structure = structure(model)

    n = apply_fused_junction(model, "composed", compiled=True)
    assert n == len(junctions(model)) == fused_junctions(model) > 0
    # both sub-layers of every junction are swapped, the others stay plain
    names = {id(m): name for name, m in model.named_modules()}
    assert {name for name, m in model.named_modules() if isinstance(m, FusedResidual)} == {
        names[id(m)] for pair in junctions(model) for m in pair}
    assert list(model.state_dict()) == keys  # checkpoints load either way
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))  # the optimizer's own Parameters
    assert all(a is b for a, b in zip(optimizer.param_groups[0]["params"], model.parameters(), strict=True))
    loss, grads = loss_and_grads_of(model)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-6 * grad.abs().max().item(), msg=name)
    # the residual that ends the stack also hands something on, so that the last block compiles to the middle
    # blocks' graph: a plain model's its sum (SumHandoff), which the final norm normalises with its norm_out; a
    # looped one's a pair, which also feeds the next pass: the head takes its stream
    assert isinstance(model.final_norm, StreamOfPair if config.loop_blocks else NormOfSum)

    fused_structure = structure(model)
    assert apply_fused_junction(model, "composed", compiled=True) == n  # again: the same modules, nothing stacked
    assert structure(model) == fused_structure and list(model.state_dict()) == keys
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))

    twin = TransformerLM(config)
    twin.load_state_dict(model.state_dict())  # a fused model's checkpoint into a plain one
    torch.testing.assert_close(loss_and_grads_of(twin)[0], plain_loss, rtol=1e-6, atol=0)

    assert apply_fused_junction(model, "off") == 0
    assert structure(model) == plain_structure  # plain Residuals and final norm again, of exactly their types
    assert type(model.final_norm) is nn.Identity
    assert all(type(m) is Residual for m in model.modules() if isinstance(m, Residual))
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    torch.testing.assert_close(loss_and_grads_of(model)[0], plain_loss, rtol=1e-6, atol=0)


def test_turning_the_junction_off_reaches_inside_checkpoint_wrappers():
    """Tools that hook single sub-layers turn the junction off on a model built for training, AC included."""
    model = TransformerLM(BASE)
    assert apply_fused_junction(model, "composed", across_blocks=False, compiled=True) == 2
    apply_ac(model, 1)
    assert sum(isinstance(m, FusedResidual) for m in model.modules()) == 4  # 2 pairs, one per block past block 0
    apply_fused_junction(model, "off")
    assert not any(isinstance(m, FusedResidual) for m in model.modules())
    assert [type(b).__name__ for b in model.blocks] == ["CheckpointWrapper"] * BASE.n_blocks


FSDP_CONFIG = replace(BASE, n_blocks=4, d_model=32)


def fsdp_batch() -> torch.Tensor:
    return torch.randint(0, FSDP_CONFIG.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))


def _fsdp_worker(rank: int, port: int, out: str) -> None:
    """One of two ranks: the swapped-in junction (inside blocks), AC and FSDP2 in parallelize's order, one
    forward and backward on this rank's half of the batch."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    from keel.scale.parallel import apply_fsdp  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = TransformerLM(FSDP_CONFIG)
        fused = apply_fused_junction(model, "composed", across_blocks=False, compiled=True)
        apply_ac(model, 1)
        apply_fsdp(model, init_device_mesh("cpu", (2,)), group=2)
        ids = fsdp_batch()[rank * 2:rank * 2 + 2]
        _, loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
        grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor()
                 for n, p in model.named_parameters()}
        if rank == 0:
            torch.save({"loss": loss.detach(), "grads": grads, "fused": fused}, out)
        dist.barrier()  # every rank done before any tears its group down
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_swapped_junction_under_ac_and_fsdp2_on_two_ranks_matches_one_process(spawn, tmp_path):
    spawn(_fsdp_worker, str(tmp_path / "rank0.pt"), nprocs=2, timeout=120)
    got = torch.load(tmp_path / "rank0.pt")
    torch.manual_seed(0)
    model = TransformerLM(FSDP_CONFIG)
    ids = fsdp_batch()
    _, loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert got["fused"] == FSDP_CONFIG.n_blocks - 1  # inside blocks only; block 0 has no junction
    torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-5, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-5, atol=1e-5 * p.grad.abs().max().item(),
                                   msg=name)


if __name__ == "__main__":
    interpreted_child(*sys.argv[1:])
