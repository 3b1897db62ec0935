"""Activation checkpointing and regional compilation (keel.scale.parallel) against the plain model."""

import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from keel.model.architecture import ModelConfig
from keel.model.transformer import TransformerLM
from keel.scale.parallel import apply_ac, apply_compile


def config(n_blocks: int, **kw) -> ModelConfig:
    return ModelConfig(n_blocks=n_blocks, d_model=32, n_heads=2, max_seq_len=16, **kw)


def loss_and_grads(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, 17), generator=g)
    _, loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.detach(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}


def model(cfg, ac_every=0):
    torch.manual_seed(0)
    m = TransformerLM(cfg)
    apply_ac(m, ac_every)
    return m


@pytest.mark.parametrize("ac_every", [1, 2])
@pytest.mark.parametrize("scheme", ["keel", "pre_ln"])
def test_activation_checkpointing_gives_the_plain_gradients(ac_every, scheme):
    cfg = config(4, scheme=scheme, dropout=0.1)  # dropout: the recomputation must replay the same masks
    torch.manual_seed(5)
    plain_loss, plain = loss_and_grads(model(cfg))
    torch.manual_seed(5)
    ac_model = model(cfg, ac_every)
    assert sum("CheckpointWrapper" in type(b).__name__ for b in ac_model.blocks) == 4 // ac_every
    ac_loss, ac = loss_and_grads(ac_model)
    assert torch.equal(ac_loss, plain_loss)
    for name, grad in plain.items():
        torch.testing.assert_close(ac[name], grad, rtol=1e-6, atol=1e-8, msg=name)
    assert ac_model.state_dict().keys() == model(cfg).state_dict().keys()  # checkpoints stay interchangeable


def compiled_graphs(n_blocks: int, ac_every: int = 0, **kw) -> int:
    torch._dynamo.reset()
    counters.clear()
    m = model(config(n_blocks, **kw), ac_every)
    apply_compile(m, backend="eager")  # Dynamo's tracing and guards, without code generation
    loss_and_grads(m)
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
@pytest.mark.parametrize("ac_every", [0, 1])
def test_compiling_blocks_compiles_a_constant_number_of_graphs_whatever_the_depth(ac_every):
    # Keel v2: block 0 (no alpha, no LN_out on attention) and every later block: two graphs
    assert compiled_graphs(2, ac_every) == compiled_graphs(12, ac_every) == 2
    assert compiled_graphs(12, ac_every, first_layer="none") == 1
    assert compiled_graphs(12, ac_every, scheme="mix_ln", mix_ln_fraction=0.5) == 2


@pytest.mark.slow  # Inductor's C++ build: 15 s on a cold cache (a fresh machine), on a loaded 2-core one
@pytest.mark.parametrize("n_kv_heads", [1, None], ids=["one-kv-head", "multi-head"])
def test_inductor_compiled_blocks_match_eager(n_kv_heads):
    """One K/V head: the shape of tests/test_compile.py's later Keel blocks (4 blocks, alpha 8, 2 x 16 tokens), so
    in one test session the second to compile them loads them from Inductor's caches. Multi-head (the default,
    attention without enable_gqa): a graph of its own, compiled here."""
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler for inductor's CPU backend")
    cfg = config(4, first_layer="none", n_kv_heads=n_kv_heads)
    eager_loss, eager = loss_and_grads(model(cfg))
    compiled = model(cfg)
    apply_compile(compiled)
    try:
        loss, grads = loss_and_grads(compiled)
    except Exception as err:  # the toolchain is there but cannot build inductor's kernels
        if "InductorError" in type(err).__name__ or "CppCompileError" in str(err):
            pytest.skip(f"inductor cannot compile here: {str(err).splitlines()[0]}")
        raise
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for name, grad in eager.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow  # a Python that imports torch
def test_fused_junction_values_and_default_are_written_once_and_importing_them_is_light():
    import inspect
    import subprocess
    import sys

    from keel.config import schema as config
    from keel.scale import fused_junction as junction
    from keel.scale import parallel

    assert config.FUSED_JUNCTION is parallel.FUSED_JUNCTION
    defaults = {inspect.signature(f).parameters["fused_junction" if f is parallel.parallelize else "mode"].default
                for f in (parallel.parallelize, junction.apply_fused_junction)}
    assert defaults == {config.RunConfig().fused_junction} == {"auto"}
    # the config reads these values: importing them must not import the kernel module (and triton)
    code = ("import sys, keel.config, keel.scale.parallel\n"
            "print(sorted(m for m in ('triton', 'keel.kernels.junction') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
