"""`run.compile=true` (keel.scale.parallel.apply_compile through build_model): once warmed up, training and
validation compile nothing new, for Keel and Pre-LN, and the compiled model computes what the eager one does.

Dynamo counts every graph it compiles in `counters["stats"]["unique_graphs"]`; a recompile (a guard that
failed: a changed shape, dtype, grad mode, module flag or python constant) is one more graph.
"""

from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

from keel.config import OptimConfig, RunConfig
from keel.model.architecture import ModelConfig
from keel.scale.fused_junction import fused_junctions
from keel.train.optim import build_optimizer
from keel.train.step import TrainStep, build_model

CONFIG = ModelConfig(n_blocks=4, d_model=32, n_heads=2, n_kv_heads=1, max_seq_len=16)


def batches(vocab: int, n: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, 2, 17), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in ids]


def train_and_validate(step: TrainStep, data, device) -> list[float]:
    """Train on each batch, then one validation pass (eval mode, no grad): what a run does between evals."""
    losses = [step(lambda b=b: tuple(t.to(device) for t in b), 1e-3).loss for b in data]
    step.model.eval()
    with torch.no_grad():
        step.model(*(t.to(device) for t in data[0]))
    step.model.train()
    return losses


def graphs_after_warmup(scheme: str, backend: str, device: str = "cpu", fused: str = "off", **run) -> tuple[int, int]:
    """(graphs compiled by the end of warm-up, graphs compiled after it), for a fresh Dynamo."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    dev = torch.device(device)
    run = RunConfig(device=device, compile=True, fused_junction=fused, **run)
    model = build_model(replace(CONFIG, scheme=scheme), run, dev, compile_backend=backend)
    if fused == "on":
        assert fused_junctions(model) > 0
    step = TrainStep(model, build_optimizer(model, OptimConfig(lr=1e-3, warmup_steps=0)),
                     autocast=lambda: torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"))
    data = batches(CONFIG.vocab_size, 5)
    train_and_validate(step, data[:2], dev)  # warm-up: train and eval graphs
    warm = counters["stats"]["unique_graphs"]
    train_and_validate(step, data[2:], dev)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    return warm, counters["stats"]["unique_graphs"] - warm


@pytest.mark.slow  # over a second in tests/durations.json
@pytest.mark.parametrize("ac_every", [0, 1])
@pytest.mark.parametrize("scheme", ["keel", "pre_ln"])
def test_no_recompiles_after_warmup_dynamo_only(scheme, ac_every):
    warm, later = graphs_after_warmup(scheme, "eager", ac_every=ac_every)
    # Keel (first_layer v2): block 0 and the rest, each in train and in eval mode; Pre-LN: one block shape
    assert warm == (4 if scheme == "keel" else 2)
    assert later == 0


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["keel", "pre_ln"])
def test_no_recompiles_after_warmup_inductor(scheme):
    """The path `run.compile=true` takes: Inductor's generated kernels (a C++ compiler on CPU)."""
    warm, later = graphs_after_warmup(scheme, "inductor")
    assert warm > 0 and later == 0


@pytest.mark.slow
def test_compiled_training_matches_eager():
    # the model a sweep point of tests/test_experiments.py compiles (4 sub-layers, d=16, 2 x 16 tokens): the same
    # graphs, which a CI run compiles once and loads from Inductor's on-disk caches in the second test to need them
    config = replace(CONFIG, n_blocks=2, d_model=16)

    def losses(compile: bool) -> list[float]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model(config, RunConfig(device="cpu", compile=compile), torch.device("cpu"))
        step = TrainStep(model, build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=0)))
        return train_and_validate(step, batches(config.vocab_size, 4), torch.device("cpu"))

    # three optimiser steps later, the compiled model (another summation order) still follows the eager one
    torch.testing.assert_close(losses(True), losses(False), rtol=1e-4, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_recompiles_after_warmup_on_cuda_with_the_fused_junction():
    """bf16 autocast, Inductor's Triton code and the fused junction's custom op in one compiled block (Pre-LN
    compiled on CUDA: tests/test_gpu.py)."""
    pytest.importorskip("triton")
    warm, later = graphs_after_warmup("keel", "inductor", device="cuda", fused="on")
    assert warm == 4 and later == 0  # block 0 and the rest (the last one too), in train and in eval mode


@pytest.mark.slow  # over a second in tests/durations.json
@pytest.mark.parametrize("n_blocks", [4, pytest.param(16, marks=pytest.mark.slow)])  # flat in depth: with 16, in CI
def test_compiled_keel_fuses_every_junction_across_blocks_with_graphs_flat_in_depth(n_blocks):
    """On CPU, `run.compile=true` (fused_junction auto): each block hands on its sum (`SumHandoff`) and the next
    block's graph applies LN_out and its LN_in, so the junction between two blocks is one compiled graph's work.
    It computes what the plain eager model does, and the number of compiled graphs does not grow with depth:
    block 0 (first-layer rule) and every other block (a sum in and out): the last block's last sub-layer also
    hands on its sum, which the final norm normalises, so that it compiles to the middle blocks' graph."""
    torch._dynamo.reset()
    counters.clear()
    config = replace(CONFIG, n_blocks=n_blocks)
    ids = batches(config.vocab_size, 1)[0]
    out, keys = {}, {}
    for compiled in (True, False):
        torch.manual_seed(0)
        model = build_model(config, RunConfig(compile=compiled, fused_junction="auto" if compiled else "off"),
                            torch.device("cpu"), compile_backend="aot_eager")
        # Keel v2: sub-layer 0 has no LN_out, the last one no successor: junctions 1-2, ..., (L-2)-(L-1)
        assert fused_junctions(model) == (2 * n_blocks - 2 if compiled else 0)
        keys[compiled] = list(model.state_dict())
        _, loss = model(*ids)
        loss.backward()
        out[compiled] = [loss.detach()] + [p.grad for p in model.parameters()]
    assert counters["stats"]["unique_graphs"] == 2
    assert keys[True] == keys[False]  # the last junction's norm copy is not registered: checkpoints unchanged
    assert sum(counters["graph_break"].values()) == 0
    for a, b in zip(out[True], out[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # over a second in tests/durations.json
def test_the_final_norm_of_the_handed_on_sum_moves_and_casts_with_the_model():
    # the stack's last sub-layer hands on its sum so that the last block compiles to the middle blocks' graph, and
    # the final norm normalises it with that sub-layer's norm_out, which it holds unregistered: .to() must reach it
    # (as it must the kernel's unregistered norm copy on CUDA: tests/test_compile.py's CUDA test counts the graphs)
    from keel.scale.fused_junction import NormOfSum

    torch._dynamo.reset()
    counters.clear()
    model = build_model(CONFIG, RunConfig(compile=True), torch.device("cpu"), compile_backend="eager")
    model.to(torch.float64)
    assert isinstance(model.final_norm, NormOfSum) and model.final_norm.incoming.norm.weight.dtype == torch.float64
    ids = batches(CONFIG.vocab_size, 1)[0]
    model(*ids)[1].backward()
    assert counters["stats"]["unique_graphs"] == 2


def test_fused_junction_on_without_compile_on_cpu_says_how():
    from keel.errors import ConfigError

    with pytest.raises(ConfigError, match="fused_junction=on.*run.compile=true"):
        build_model(CONFIG, RunConfig(fused_junction="on"), torch.device("cpu"))
    model = build_model(CONFIG, RunConfig(fused_junction="on", compile=True), torch.device("cpu"),
                        compile_backend="eager")
    assert fused_junctions(model) == 2 * CONFIG.n_blocks - 2


@pytest.mark.slow  # over a second in tests/durations.json
@pytest.mark.parametrize("fused", ["off", "composed"])
def test_compiled_blocks_keep_alpha_a_constant(fused):
    """Block 1 recompiles block 0's code with another alpha (1, then L). Left to Dynamo's automatic dynamic, that
    recompile turns alpha into a symbolic float, a graph input of its own: on CUDA a CPU scalar whose code took
    Inductor 42 s to generate on one H200 (benchmarks/gpu/h200-2026-11-26.md). Every graph must hold alpha as a
    constant and take no symbolic input."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = build_model(CONFIG, RunConfig(compile=True, fused_junction=fused), torch.device("cpu"),
                        compile_backend=backend)
    ids = batches(CONFIG.vocab_size, 1)[0]
    model(ids[0])[0].float().logsumexp(-1).mean().backward()
    assert len(graphs) == 2

    def unspecialized(value) -> bool:  # a python number made an input: a SymInt/SymFloat, or a 0-d tensor
        return isinstance(value, torch.SymFloat | torch.SymInt) or isinstance(value, torch.Tensor) and value.dim() == 0

    placeholders = [n for gm in graphs for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders and all("example_value" in n.meta for n in placeholders)  # what the check below reads
    assert [n.name for n in placeholders if unspecialized(n.meta["example_value"])] == []


@pytest.mark.slow  # over a second in tests/durations.json
def test_scoring_a_compiled_model_at_new_shapes_compiles_nothing():
    """Blocks compile static, and task scoring (keel.evals) feeds every batch at a shape of its own: those run eager
    instead of compiling (and spending the recompile limit training's graphs share)."""
    from keel.evals.scoring import untouched

    step = TrainStep(*_compiled_keel())
    data = batches(CONFIG.vocab_size, 2)
    train_and_validate(step, data, "cpu")
    before = counters["stats"]["unique_graphs"]
    with untouched(step.model, "cpu"):
        for b, t in ((1, 16), (3, 9), (4, 11), (2, 5), (5, 13)):
            step.model(torch.randint(0, CONFIG.vocab_size, (b, t)))
    assert counters["stats"]["unique_graphs"] == before
    train_and_validate(step, data, "cpu")  # training's graphs are still there: nothing new after scoring either
    assert counters["stats"]["unique_graphs"] == before


def _compiled_keel():
    torch._dynamo.reset()
    counters.clear()
    model = build_model(CONFIG, RunConfig(compile=True), torch.device("cpu"), compile_backend="eager")
    return model, build_optimizer(model, OptimConfig())
