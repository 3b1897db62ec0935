"""Pipeline parallelism on CPU (gloo): two stages against one process give the same loss, gradients, clipped
update and logits for every schedule; so do 2 stages x 2 data-parallel replicas (4 processes, FSDP2 within each
stage) on the same global batch; checkpoints written by the stages load in one process; `keel train run.pp=2`
under torchrun matches one process and resumes in one."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from keel.config import OptimConfig, RunConfig, load_config
from keel.errors import ConfigError
from keel.model import ModelConfig, TransformerLM
from keel.runs import checkpoint
from keel.scale import distributed
from keel.scale.memory import measured_bytes, pipeline_memory
from keel.scale.pipeline import SCHEDULES, split_blocks
from keel.train.evaluate import evaluate
from keel.train.optim import build_optimizer
from keel.train.pipeline_step import PipelineStep
from keel.train.step import TrainStep, build_model
from keel.train.trainer import Trainer

CONFIG = ModelConfig(n_blocks=4, d_model=32, n_heads=2, max_seq_len=16, init_std=0.1)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=0)
BATCH = 8  # sequences; micro-batches of 2 (4 per batch) or 1 (grad_accum=2: 8 per step)
CLIP = 0.05  # below the gradient norm, so the clipped update shows whether the norm spans both stages
TIMEOUT = 300


def batches(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (n, BATCH, CONFIG.max_seq_len + 1), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in ids]


def run_settings(schedule: str, grad_accum: int = 1):
    return RunConfig(pp=2, pp_schedule=schedule, pp_microbatches=4, batch_size=BATCH, grad_accum=grad_accum,
                     ac_every=1 if schedule == "gpipe" else 0, fused_junction="off")


def one_step(step, grad_accum: int):
    """One step on the first `grad_accum` batches: (loss, grad_norm, gradients before clipping)."""
    grads, data = {}, iter(batches(grad_accum))
    step.after_backward = lambda model: grads.update(
        {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()})
    result = step(lambda: next(data), OPTIM.lr)
    return result, grads


CASES = [(name, 1) for name in SCHEDULES] + [("1f1b", 2)]


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        got = {}
        for name, accum in CASES:
            torch.manual_seed(0)
            model = build_model(CONFIG, run_settings(name, accum), torch.device("cpu"))
            optimizer = build_optimizer(model, OPTIM)
            step = PipelineStep(model, optimizer, grad_accum=accum, grad_clip=CLIP)
            result, grads = one_step(step, accum)
            with torch.no_grad():
                logits, _ = model(batches(1)[0][0])
            named = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}
            got[f"{name}/{accum}"] = {"loss": result.loss, "grad_norm": result.grad_norm, "grads": grads,
                                      "exp_avg": {n: optimizer.state[p]["exp_avg"] for n, p in named.items()},
                                      "logits": logits}
            if (name, accum) == ("1f1b", 1):
                checkpoint.save_sharded(Path(out) / "run", 1, model, optimizer, {}, {"draws": 1}, keep=1,
                                        main=rank == 0)
        torch.save(got, Path(out) / f"rank{rank}.pt")
        dist.barrier()  # every rank done before any tears its group down
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory, spawn):
    out = tmp_path_factory.mktemp("two_stages")
    spawn(_worker, str(out), nprocs=2, timeout=TIMEOUT, forkserver=True)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def one_process(grad_accum: int):
    torch.manual_seed(0)
    model = TransformerLM(CONFIG)
    optimizer = build_optimizer(model, OPTIM)
    result, grads = one_step(TrainStep(model, optimizer, grad_accum=grad_accum, grad_clip=CLIP), grad_accum)
    with torch.no_grad():
        logits, _ = model(batches(1)[0][0])
    return result, grads, model, optimizer, logits


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name,accum", CASES)
def test_two_stages_give_the_loss_gradients_and_update_of_one_process(two_stages, name, accum):
    _, ranks = two_stages
    result, grads, model, optimizer, logits = one_process(accum)
    stages = [r[f"{name}/{accum}"] for r in ranks]
    for got in stages:  # every rank reports the whole batch's loss and the norm over both stages
        assert got["loss"] == pytest.approx(result.loss, rel=1e-6)
        assert got["grad_norm"] == pytest.approx(result.grad_norm, rel=1e-5)
        assert result.grad_norm > 2 * CLIP  # the update was clipped
        torch.testing.assert_close(got["logits"], logits, rtol=1e-4, atol=1e-4)  # after the AdamW step
    held = [set(got["grads"]) for got in stages]
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == set(grads)  # each parameter on one stage
    state = {n: optimizer.state[p]["exp_avg"] for n, p in model.named_parameters()}
    for got in stages:
        for n, g in got["grads"].items():
            torch.testing.assert_close(g, grads[n], rtol=1e-4, atol=1e-6, msg=n)
            # AdamW's first moment holds the clipped gradient: clipped by the norm over both stages
            torch.testing.assert_close(got["exp_avg"][n], state[n], rtol=1e-4, atol=1e-8, msg=n)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_checkpoint_of_two_stages_loads_in_one_process(two_stages):
    out, _ = two_stages
    _, _, reference, reference_optimizer, _ = one_process(1)
    path = checkpoint.latest_valid(out / "run")
    model = TransformerLM(CONFIG)
    optimizer = build_optimizer(model, OPTIM)
    checkpoint.load_sharded(path, model, optimizer)
    assert_same_first_step(model, optimizer, reference, reference_optimizer)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [OPTIM.weight_decay, 0.0]


def assert_same_first_step(model, optimizer, reference, reference_optimizer):
    """A checkpoint loaded into `model` holds the parameters and AdamW state one process reached in one step.

    AdamW's first step moves each parameter by lr * g / (|g| + eps) (its bias-corrected moments are g and g^2):
    about lr * sign(g) for any gradient above eps, so a gradient near zero whose sum ran in another order (other
    processes, other reductions) can move its parameter by up to 2 lr, and a fixed atol then passes or fails with
    the machine. The moments are compared tightly; each parameter may differ by what its own step's difference
    explains, lr * |u - u_ref| with u computed from each side's moments, plus float32 rounding."""
    beta1, beta2 = OPTIM.beta1, OPTIM.beta2
    eps = OPTIM.eps

    def update(state):  # the first step's update direction, from the moments AdamW kept
        return (state["exp_avg"] / (1 - beta1)) / ((state["exp_avg_sq"] / (1 - beta2)).sqrt() + eps)

    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        mine, theirs = optimizer.state[p], reference_optimizer.state[q]
        torch.testing.assert_close(mine["exp_avg"], theirs["exp_avg"], rtol=1e-4, atol=1e-8, msg=n)
        torch.testing.assert_close(mine["exp_avg_sq"], theirs["exp_avg_sq"], rtol=1e-4, atol=1e-12, msg=n)
        explained = OPTIM.lr * (update(mine) - update(theirs)).abs()
        excess = ((p - q).abs() - explained - 1e-6 - 1e-5 * q.abs()).max().item()
        assert excess <= 0, f"{n}: parameters differ by {excess:.3g} more than their AdamW steps explain"


def test_stages_are_contiguous_and_balanced_by_cost():
    deep = ModelConfig(n_blocks=32, d_model=64, n_heads=4, vocab_size=4096)
    spans = split_blocks(deep, 4)
    assert [s.start for s in spans] == [0, *[s.stop for s in spans[:-1]]] and spans[-1].stop == 32
    # the embedding and the head weigh ~4.9 blocks each here (4096 x 64 against ~53k parameters a block), so
    # the end stages hold fewer blocks: costs 10.9, 10, 10, 10.9
    assert [len(s) for s in spans] == [6, 10, 10, 6]
    assert [len(s) for s in split_blocks(replace_vocab(deep, 256), 4)] == [8, 8, 8, 8]
    assert [len(s) for s in split_blocks(replace_vocab(deep, 1 << 17), 4)] == [1, 15, 15, 1]  # never empty


def replace_vocab(config: ModelConfig, vocab: int) -> ModelConfig:
    return replace(config, vocab_size=vocab)


@pytest.mark.parametrize("override, needle", [
    ("run.pp=0", "run.pp: got 0"),
    ("run.pp_schedule=nope", "run.pp_schedule: got 'nope'"),
    ("run.pp_microbatches=3", "does not divide run.batch_size"),
    ("model.loop_blocks=1", "a looped model"),
    ("model.tie_embeddings=true", "tied embeddings"),
    ("model.n_blocks=1", "need at least as many blocks"),
])
def test_settings_a_pipeline_cannot_take_are_refused(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(["run.pp=2", "run.batch_size=4", override], preset="tiny")


def test_pp_outside_torchrun_is_refused():
    config = load_config(["run.pp=2", "run.batch_size=4"], preset="tiny")
    with pytest.raises(ConfigError, match="launch with torchrun --nproc_per_node=2"):
        build_model(config.model, config.run, torch.device("cpu"))


# ---- `keel train run.pp=2` under torchrun --------------------------------------------------------------------

def common(tmp_path: Path, corpus: Path) -> list[str]:
    return [f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}", f"run.out_dir={tmp_path / 'runs'}",
            "run.batch_size=4", "run.steps=6", "run.ckpt_every=3", "run.eval_every=3", "run.pp_microbatches=2",
            "run.curves=false"]


def losses(run_dir: Path, key: str = "loss") -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in records if key in r and "event" not in r]


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_pp_trains_like_one_process_and_resumes_in_one(tmp_path, corpus, torchrun, no_curves):
    def train(*overrides):  # a resumed run continues with its own config: no --preset with resume=
        preset = [] if any(o.startswith("resume=") for o in overrides) else ["--preset", "tiny"]
        torchrun("keel.cli", "train", *preset, *common(tmp_path, corpus), "run.pp=2", *overrides, timeout=TIMEOUT)
    runs = tmp_path / "runs"
    train("run.name=piped")
    piped = losses(runs / "piped")
    assert len(piped) == 6
    summary = json.loads((runs / "piped" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tokens"] == 6 * 4 * 32  # both stages read the same batch
    # one process, the same global batch: the same losses and validation losses
    config = load_config([*common(tmp_path, corpus), "run.name=single"], preset="tiny")
    Trainer(config, runs / "single").run()
    assert losses(runs / "single") == pytest.approx(piped, rel=1e-5)
    assert losses(runs / "single", "val_loss") == pytest.approx(losses(runs / "piped", "val_loss"), rel=1e-5)
    # the stages' step-3 checkpoint resumed in one process, and under the pipeline again
    for name, resume in (("resumed", lambda d: Trainer(config, d).run(resume_from=d / "checkpoints" / "step_00000003")),
                         ("piped-again", lambda d: train(f"resume={d}"))):
        part = shutil.copytree(runs / "piped", runs / name)
        shutil.rmtree(part / "checkpoints" / "step_00000006")
        resume(part)
        assert losses(part) == pytest.approx(piped, rel=1e-5), name


@pytest.mark.distributed
@pytest.mark.slow
def test_the_pipeline_benchmark_writes_its_tables(tmp_path, torchrun):
    torchrun("benchmarks.cpu.pipeline.timing", "--out", str(tmp_path), "--n-blocks", "4", "--d-model", "32",
             "--batch-size", "4", "--seq-len", "16", "--steps", "1", "--schedules", "1f1b,zbv", timeout=TIMEOUT)
    result = json.loads((tmp_path / "bench.json").read_text())
    assert [r["schedule"] for r in result["records"]] == ["1f1b", "zbv"]
    assert all(r["pipeline_s"] > 0 and r["one_process_s"] > 0 and r["one_process_threads"] == 2
               for r in result["records"])
    assert result["records"][1]["split"] == [[0, 1], [1, 2], [2, 3], [3, 4]]  # two stages per rank
    assert "load_average_before" in result and result["machine"]["torch_version"] == torch.__version__
    assert all(r["one_thread_s"] > 0 for r in result["records"])
    assert "| zbv | 1, 1, 1, 1 |" in (tmp_path / "bench.md").read_text()


# ---- 2 stages x 2 data-parallel replicas (FSDP2 over the replicas) against one process -----------------------

DP_CASES = ["1f1b", "zbv"] if "zbv" in SCHEDULES else ["1f1b"]
# 3 validation windows of 16 tokens, evaluated one at a time: the replicas take 2 and 1 (and run one uncounted)
EVAL_TOKENS = torch.randint(0, CONFIG.vocab_size, (3 * CONFIG.max_seq_len + 1,),
                            generator=torch.Generator().manual_seed(2)).numpy()


def full(named) -> dict[str, torch.Tensor]:
    """Whole tensors from FSDP2's shards (a collective over the dp group), by full-model name."""
    return {n.replace("_checkpoint_wrapped_module.", ""): t.full_tensor() for n, t in named}


def _dp_worker(rank: int, port: int, out: str) -> None:
    """One of 4 ranks on the ("pp", "dp") mesh: its replica's half of the global batch (rows by dp coordinate),
    one clipped step per schedule; gradients, optimiser state and logits gathered whole."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    try:
        x, y = batches(1)[0]
        replica = rank % 2  # pp outermost: ranks 0, 1 hold the first stage, 2, 3 the second
        mine = (x[replica * BATCH // 2:(replica + 1) * BATCH // 2], y[replica * BATCH // 2:(replica + 1) * BATCH // 2])
        got = {}
        for name in DP_CASES:
            torch.manual_seed(0)
            run = replace(run_settings(name), pp_microbatches=2, batch_size=BATCH // 2)
            model = build_model(CONFIG, run, torch.device("cpu"))
            assert (model.pp_rank, model.dp_rank, model.dp_size) == (rank // 2, replica, 2)
            optimizer = build_optimizer(model, OPTIM)
            step = PipelineStep(model, optimizer, grad_clip=CLIP, world=distributed.World(rank, 4))
            grads = {}
            step.after_backward = lambda m, into=grads: into.update(full((n, p.grad) for n, p in m.named_parameters()))
            result = step(lambda: mine, OPTIM.lr)
            exp_avg = full((n, optimizer.state[p]["exp_avg"]) for n, p in model.named_parameters())
            weights, held = full(model.named_parameters()), measured_bytes(model, optimizer)  # before a forward
            with torch.no_grad():  # (unshards the stages: without a backward they stay so)
                logits, _ = model(x)
            val = evaluate(model, EVAL_TOKENS, CONFIG.max_seq_len, 1, 3, torch.device("cpu"),
                           world=distributed.World(rank, 4), replica=model.dp_rank, replicas=model.dp_size)
            got[name] = {"loss": result.loss, "grad_norm": result.grad_norm, "grads": grads, "exp_avg": exp_avg,
                         "logits": logits, "val": val, "weights": weights, "bytes": held}
            if name == "1f1b":
                checkpoint.save_sharded(Path(out) / "run", 1, model, optimizer, {}, {"draws": 1}, keep=1,
                                        main=rank == 0)
        torch.save(got, Path(out) / f"rank{rank}.pt")
        dist.barrier()  # every rank done before any tears its group down
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def stages_and_replicas(tmp_path_factory, spawn):
    out = tmp_path_factory.mktemp("stages_and_replicas")
    spawn(_dp_worker, str(out), nprocs=4, timeout=TIMEOUT, forkserver=True)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", DP_CASES)
def test_two_stages_by_two_replicas_give_the_loss_gradients_and_update_of_one_process(stages_and_replicas, name):
    _, ranks = stages_and_replicas
    result, grads, model, optimizer, logits = one_process(1)  # the whole batch of 8: each replica had 4
    state = {n: optimizer.state[p]["exp_avg"] for n, p in model.named_parameters()}
    held = []
    for got in (r[name] for r in ranks):  # the global batch's loss, and the norm over both stages and shards
        assert got["loss"] == pytest.approx(result.loss, rel=1e-6)
        assert got["grad_norm"] == pytest.approx(result.grad_norm, rel=1e-5)
        assert result.grad_norm > 2 * CLIP  # the update was clipped
        torch.testing.assert_close(got["logits"], logits, rtol=1e-4, atol=1e-4)  # after the AdamW step
        held.append(set(got["grads"]))
        for n, g in got["grads"].items():
            torch.testing.assert_close(g, grads[n], rtol=1e-4, atol=1e-6, msg=n)
            torch.testing.assert_close(got["exp_avg"][n], state[n], rtol=1e-4, atol=1e-8, msg=n)
    # `keel eval`'s windows split over the replicas: the loss of one process on the same windows and weights
    same = TransformerLM(CONFIG)
    same.load_state_dict(ranks[0][name]["weights"] | ranks[2][name]["weights"])
    one = evaluate(same, EVAL_TOKENS, CONFIG.max_seq_len, 1, 3, torch.device("cpu"))
    assert one["val_tokens"] == 3 * CONFIG.max_seq_len
    for got in (r[name]["val"] for r in ranks):
        assert got["val_tokens"] == one["val_tokens"]
        assert got["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
    # the memory plan's states per rank: each stage's, halved over the two replicas (FSDP2's shards)
    plan = pipeline_memory(CONFIG, BATCH // 2, CONFIG.max_seq_len, world_size=4, pp=2, pp_schedule=name,
                           pp_microbatches=2)
    for rank, got in enumerate(r[name] for r in ranks):
        tensors = sum(1 for n in got["grads"])
        assert got["bytes"]["params"] == pytest.approx(plan[rank // 2]["grads"], rel=0.05)
        assert got["bytes"]["optimizer"] - 4 * tensors == pytest.approx(plan[rank // 2]["optimizer"] - 4 * tensors,
                                                                        rel=0.05)
    for pp_rank in (0, 1):
        pair = [ranks[2 * pp_rank + r][name]["bytes"] for r in (0, 1)]
        assert sum(b["params"] for b in pair) == 2 * plan[pp_rank]["grads"]
    # ranks 0, 1 (pp coordinate 0) hold one set of parameters, ranks 2, 3 the rest
    assert held[0] == held[1] and held[2] == held[3] and held[0].isdisjoint(held[2])
    assert held[0] | held[2] == set(grads)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_checkpoint_of_two_stages_by_two_replicas_loads_in_one_process(stages_and_replicas):
    out, _ = stages_and_replicas
    _, _, reference, reference_optimizer, _ = one_process(1)
    model = TransformerLM(CONFIG)
    optimizer = build_optimizer(model, OPTIM)
    checkpoint.load_sharded(checkpoint.latest_valid(out / "run"), model, optimizer)
    assert_same_first_step(model, optimizer, reference, reference_optimizer)


def test_pp_with_processes_not_a_multiple_of_the_stages_is_refused(tmp_path):
    config = load_config(["run.pp=2", "run.batch_size=4"], preset="tiny")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="launch a multiple of 2"):
            build_model(config.model, config.run, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


# ---- one builder: keel.scale.parallel.parallelize decides the pipeline's stages too --------------------------

class _Plan:
    """A PipelinePlan without a process group: two stages of CONFIG, both this rank's."""

    dp_size = 1

    def __init__(self):
        self.spans, self.seen = split_blocks(CONFIG, 2), None

    def cut(self, model):
        from keel.scale.pipeline import Stage
        self.seen = [type(b).__name__ for b in model.blocks]
        return {s: Stage(model, span, first=s == 0, last=s == 1) for s, span in enumerate(self.spans)}

    def assemble(self, model, stages):
        return stages


def test_parallelize_builds_stages_after_the_junction_checkpointing_and_compile(monkeypatch):
    import keel.kernels.junction as kernel
    from keel.scale.fused_junction import fused_junctions, junctions
    from keel.scale.parallel import parallelize
    monkeypatch.setattr(kernel, "can_fuse", lambda device, width: True)  # as on a GPU; never called here
    torch.manual_seed(0)
    model, plan = TransformerLM(CONFIG), _Plan()
    stages = parallelize(model, fused_junction="on", ac_every=2, pipeline=plan)
    assert sorted(stages) == [0, 1]
    assert plan.seen == ["CheckpointWrapper", "Block", "CheckpointWrapper", "Block"]  # AC before the cut
    # within blocks only (Keel's block 0 has none): never across a stage boundary
    assert fused_junctions(model) == len(junctions(model, across_blocks=False)) == CONFIG.n_blocks - 1


def test_stages_run_the_models_own_pieces_and_chain_to_its_logits():
    torch.manual_seed(0)
    model = TransformerLM(CONFIG)
    stages = _Plan().cut(model)
    x, y = batches(1)[0]
    with torch.no_grad():
        logits, loss = model(x, y)
        assert torch.equal(stages[1](stages[0](x)), logits)
    assert {n for s in stages.values() for n, _ in s.named_parameters()} >= {"embed.weight", "lm_head.weight"}
    assert not any("_model" in n for s in stages.values() for n, _ in s.named_modules())  # the model not registered


def test_train_step_clips_by_the_norm_its_grad_norm_hook_gives():
    """A model split over ranks clips by its own norm (PipelineModel.grad_norm): TrainStep calls the hook."""
    from keel.train.step import total_grad_norm
    x, y = batches(1)[0]
    updates = {}
    for factor in (1.0, 4.0):
        torch.manual_seed(0)
        model = TransformerLM(CONFIG)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        step = TrainStep(model, optimizer, grad_clip=CLIP, grad_norm=lambda m, f=factor: f * total_grad_norm(m))
        result = step(lambda: (x, y), 1.0)
        updates[factor] = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())])
        assert result.grad_norm > 4 * CLIP
    # clipped to CLIP by the norm the hook reports: four times that norm, a quarter of the step
    assert updates[1.0].norm().item() == pytest.approx(CLIP, rel=1e-3)
    assert updates[4.0].norm().item() == pytest.approx(CLIP / 4, rel=1e-3)
