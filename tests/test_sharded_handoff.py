"""The sum handoff between compiled blocks (keel.scale.fused_junction.SumHandoff) kept under FSDP2 and pipeline stages:
two gloo ranks train as one process does, and pipeline stages hand sums on inside a stage but not across one."""

import pytest
import torch
import torch.distributed as dist

from keel.config import OptimConfig
from keel.model.architecture import ModelConfig
from keel.model.transformer import TransformerLM
from keel.scale.fused_junction import NormOfSum, SumHandoff, fused_junctions, handed_norms, junctions
from keel.scale.parallel import parallelize
from keel.train.optim import build_optimizer

CONFIG = ModelConfig(n_blocks=4, d_model=32, n_heads=2, n_kv_heads=1, max_seq_len=16, vocab_size=64)
OPTIM = OptimConfig(lr=3e-3, warmup_steps=0)
GLOBAL_BATCH, STEPS = 4, 20


def batches() -> torch.Tensor:
    """(STEPS, GLOBAL_BATCH, T + 1) token ids: four batches, each seen five times, so the loss falls."""
    ids = torch.randint(0, CONFIG.vocab_size, (4, GLOBAL_BATCH, CONFIG.max_seq_len + 1),
                        generator=torch.Generator().manual_seed(1))
    return ids.repeat(STEPS // 4, 1, 1)


def clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def train(model, rank: int = 0, world: int = 1) -> list[float]:
    """STEPS steps of AdamW, each rank on its share of the global batch; the loss averaged over ranks."""
    optimizer = build_optimizer(model, OPTIM)
    losses = []
    for ids in batches():
        mine = ids[rank * GLOBAL_BATCH // world:(rank + 1) * GLOBAL_BATCH // world]
        _, loss = model(mine[:, :-1], mine[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def _worker(rank: int, port: int, out: str) -> None:
    """One of two ranks: compiled blocks under AC and FSDP2 (parallelize's order), the junctions handed on as sums."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = parallelize(TransformerLM(CONFIG), compile=True, compile_backend="aot_eager", ac_every=1, fsdp=True)
        handed = handed_norms(model)
        units = {id(n._get_fsdp_state()) for n in handed}
        blocks = {id(b._get_fsdp_state()) for b in model.blocks}
        layout = {"fused": fused_junctions(model), "final": type(model.final_norm).__name__,
                  "handed": len(handed), "one_unit": len(units) == 1 and not units & blocks,
                  "sums": sum(isinstance(getattr(m, "junction", None), SumHandoff) for m in model.modules())}
        losses = train(model, rank, 2)
        weights = {clean(n): p.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save({"layout": layout, "losses": losses, "weights": weights}, out)
        dist.barrier()  # every rank done before any tears its group down
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_fsdp2_on_two_ranks_keeps_the_handoff_and_trains_as_one_process(spawn, tmp_path):
    """The norms a block applies to the sum the block before it handed on (and the final norm's) are one FSDP2 unit
    of their own, gathered for the step: two ranks give the losses of one plain process over 20 steps, and the
    same weights at the end, those norms' gains included (their gradients reduced over the ranks)."""
    spawn(_worker, str(tmp_path / "rank0.pt"), nprocs=2, timeout=300, forkserver=True)
    got = torch.load(tmp_path / "rank0.pt")
    # every junction fused, the 3 between blocks as sums, and the last sub-layer's sum normalised at the root
    assert got["layout"] == {"fused": 2 * CONFIG.n_blocks - 2, "final": "NormOfSum", "handed": CONFIG.n_blocks,
                             "one_unit": True, "sums": CONFIG.n_blocks}
    torch.manual_seed(0)
    model = TransformerLM(CONFIG)
    losses = train(model)
    assert losses[-1] < losses[0] - 0.3  # it learns
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=0, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["weights"][name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)


class _Plan:
    """A PipelinePlan without a process group: two stages of CONFIG (blocks 0-1 and 2-3), both this rank's."""

    dp_size = 1
    spans = [range(0, 2), range(2, 4)]

    def cut(self, model):
        from keel.scale.pipeline import Stage  # noqa: PLC0415
        return {s: Stage(model, span, first=s == 0, last=s == 1) for s, span in enumerate(self.spans)}

    def assemble(self, model, stages):
        return stages


@pytest.mark.slow  # 1.3 CPU s in the fast tier
def test_pipeline_stages_hand_sums_on_inside_a_stage_but_not_across_one():
    """A stage's first block cannot normalise a sum the previous stage handed on (that norm lives on another rank):
    every junction is fused but the one into the second stage, the stages chain to the plain model's logits, and
    each stage's handed-on norms are its own."""
    torch.manual_seed(0)
    model = TransformerLM(CONFIG)
    x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.max_seq_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(x)[0]
    stages = parallelize(model, compile=True, compile_backend="eager", pipeline=_Plan())
    cut = [(a.path, b.path) for a, b in zip(model.sublayers(), model.sublayers()[1:]) if b.block == 2 and a.block == 1]
    assert cut == [("blocks.1.ffn_res", "blocks.2.attn_res")]
    assert fused_junctions(model) == len(junctions(model)) - 1 == 2 * CONFIG.n_blocks - 3
    assert model.blocks[1].ffn_res.junction is None and model.blocks[2].attn_res.incoming is None
    assert isinstance(model.blocks[0].ffn_res.junction, SumHandoff) and isinstance(stages[1].final_norm, NormOfSum)
    for stage in stages.values():
        inside = set(stage.modules())
        assert handed_norms(stage) and all(n in inside for n in handed_norms(stage))
    with torch.no_grad():
        torch.testing.assert_close(stages[1](stages[0](x)), plain, rtol=1e-5, atol=1e-6)
