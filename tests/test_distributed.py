"""Two processes on CPU (gloo) against one: FSDP2 gradients, sharded checkpoints, torchrun training and resume."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from keel.cli import main
from keel.config import OptimConfig, load_config
from keel.model.architecture import ModelConfig
from keel.model.transformer import TransformerLM
from keel.runs import checkpoint
from keel.scale import distributed
from keel.scale.parallel import parallelize
from keel.train.evaluate import evaluate
from keel.train.optim import build_optimizer
from keel.train.trainer import Trainer

CONFIG = ModelConfig(n_blocks=4, d_model=32, n_heads=2, max_seq_len=16)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=0)
GLOBAL_BATCH = 4
# 3 validation windows of 16 tokens, evaluated one at a time: the ranks take 2 and 1 (and run one uncounted)
EVAL_TOKENS = torch.randint(0, CONFIG.vocab_size, (3 * CONFIG.max_seq_len + 1,),
                            generator=torch.Generator().manual_seed(2)).numpy()
TIMEOUT = 120

pytestmark = pytest.mark.distributed


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.max_seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def _worker(rank: int, port: int, world: int, out: str) -> None:
    """One rank: an FSDP2 (+ activation checkpointing) step on its half of the global batch, a sharded
    checkpoint, and a bf16 forward whose residual stream is recorded."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = parallelize(TransformerLM(CONFIG), ac_every=1, fsdp=True, fsdp_group=2)
        x, y = global_batch()
        mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        _, loss = model(x[mine], y[mine])
        loss.backward()
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
        grads = {clean(n): p.grad.full_tensor() for n, p in model.named_parameters()}
        optimizer = build_optimizer(model, OPTIM)
        optimizer.step()
        weights = {clean(n): p.full_tensor() for n, p in model.named_parameters()}
        val = evaluate(model, EVAL_TOKENS, CONFIG.max_seq_len, 1, 3, torch.device("cpu"),
                       world=distributed.World(rank, world), replica=rank, replicas=world)
        checkpoint.save_sharded(Path(out) / "run", 1, model, optimizer, {"marker": torch.tensor(7)}, {"draws": 1},
                                keep=2, main=rank == 0)

        torch.manual_seed(0)
        bf16 = parallelize(TransformerLM(CONFIG), fsdp=True, param_dtype=torch.bfloat16)
        stream, branch = [], []
        for block in bf16.blocks:
            block.register_forward_hook(lambda m, args, output: stream.append((args[0].dtype, output.dtype)))
            block.attn.register_forward_hook(lambda m, args, output: branch.append((m.wq.weight.dtype, output.dtype)))
        _, bf16_loss = bf16(x[mine], y[mine])
        if rank == 0:
            torch.save({"loss": loss.detach(), "grads": grads, "weights": weights, "stream": stream, "val": val,
                        "bf16_loss": bf16_loss.detach(), "branch": branch},
                       Path(out) / "rank0.pt")
        dist.barrier()  # every rank done before any tears its group down
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, spawn):
    out = tmp_path_factory.mktemp("two_ranks")
    spawn(_worker, 2, str(out), nprocs=2, timeout=TIMEOUT, forkserver=True)
    return out, torch.load(out / "rank0.pt", weights_only=False)


@pytest.fixture(scope="module")
def one_process():
    """The same step in one process, on the whole global batch, without FSDP or checkpointing."""
    torch.manual_seed(0)
    model = TransformerLM(CONFIG)
    x, y = global_batch()
    _, loss = model(x, y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer(model, OPTIM)
    optimizer.step()
    return loss.detach(), grads, model, optimizer


def test_fsdp_on_two_ranks_gives_the_loss_and_gradients_of_one_process(two_ranks, one_process):
    _, got = two_ranks
    loss, grads, _, _ = one_process
    torch.testing.assert_close(got["loss"], loss, rtol=1e-6, atol=1e-6)
    assert got["grads"].keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_evaluation_on_two_ranks_splits_the_windows_of_one_process(two_ranks):
    """`keel eval` and the trainer's validation: the same windows as one process, split over the ranks."""
    _, got = two_ranks
    model = TransformerLM(CONFIG)
    model.load_state_dict(got["weights"])
    one = evaluate(model, EVAL_TOKENS, CONFIG.max_seq_len, 1, 3, torch.device("cpu"))
    assert got["val"]["val_tokens"] == one["val_tokens"] == 3 * CONFIG.max_seq_len
    assert got["val"]["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6)


def test_sharded_checkpoint_from_two_ranks_loads_in_one_process(two_ranks, one_process, tmp_path):
    out, got = two_ranks
    _, _, reference, reference_optimizer = one_process
    path = checkpoint.latest_valid(out / "run")
    assert checkpoint.is_sharded(path) and checkpoint.verify(path) is None
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json",
                                                      "meta.json", "state.pt"]
    model = TransformerLM(CONFIG)
    optimizer = build_optimizer(model, OPTIM)
    state, meta = checkpoint.load_sharded(path, model, optimizer)
    assert state["marker"].item() == 7 and meta == {"step": 1, "draws": 1}
    for name, p in model.named_parameters():
        assert torch.equal(p, got["weights"][name]), name  # exactly what the two ranks held
        torch.testing.assert_close(p, dict(reference.named_parameters())[name], rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(optimizer.state[p]["exp_avg"], reference_optimizer.state[q]["exp_avg"],
                                   rtol=1e-4, atol=1e-8)
    exported = checkpoint.export_safetensors(path, TransformerLM(CONFIG), tmp_path / "model.safetensors")
    from safetensors.torch import load_file
    flat = load_file(exported)
    assert flat.keys() == got["weights"].keys()
    assert all(torch.equal(flat[n], w) for n, w in got["weights"].items())


def test_a_damaged_shard_is_caught_by_the_manifest(two_ranks, tmp_path):
    out, _ = two_ranks
    path = shutil.copytree(checkpoint.latest_valid(out / "run"), tmp_path / "step_00000001")
    shard = path / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert checkpoint.verify(path) == "__1_0.distcp does not match its checksum"


def test_bf16_fsdp_keeps_the_residual_stream_float32(two_ranks):
    _, got = two_ranks
    # the branches compute with the all-gathered bf16 weights ...
    assert got["branch"] and all(d == (torch.bfloat16, torch.bfloat16) for d in got["branch"])
    # ... while every block takes and returns a float32 stream (FSDP2 would cast it by default)
    assert got["stream"] and all(d == (torch.float32, torch.float32) for d in got["stream"])
    assert abs(got["bf16_loss"].item() - got["loss"].item()) < 0.05


# ---- `keel train` under torchrun --------------------------------------------------------------------

def common(tmp_path: Path, corpus: Path) -> list[str]:
    return [f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}", f"run.out_dir={tmp_path / 'runs'}",
            "run.batch_size=2", "run.steps=8", "run.ckpt_every=4", "run.eval_every=4", "run.eval_batches=3",
            "run.ac_every=2", "run.curves=false"]  # curves.png: not what is compared


def losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r and "event" not in r]


def val_losses(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "val_loss" in r]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, corpus, torchrun):
    """One `keel train` of 2 ranks x 2 sequences under torchrun (8 steps, checkpoints and validation at 4 and 8),
    and the same global batch of 4 in one process (Trainer.run): the tests below read both (copy a run before
    changing it). One run of each serves both tests: each torchrun start is three processes importing torch."""
    tmp = tmp_path_factory.mktemp("ranks")
    out = torchrun("keel.cli", "train", "--preset", "tiny", *common(tmp, corpus), "run.name=straight", timeout=TIMEOUT)
    config = load_config([*common(tmp, corpus), "run.batch_size=4", "run.name=single"], preset="tiny")
    with pytest.MonkeyPatch.context() as patch:  # as conftest's no_curves: its curves.png is not what is compared
        patch.setattr(Trainer, "draw_curves", lambda self, quiet=False: None)
        Trainer(config, tmp / "runs" / "single").run()
    return tmp, out, config


def test_torchrun_trains_resumes_and_matches_one_process(ranks, corpus, torchrun, no_curves):
    tmp, out, _ = ranks
    runs = tmp / "runs"
    assert out.stdout.count("memory per process") == 1  # rank 0 alone prints
    straight = losses(runs / "straight")
    assert len(straight) == 8
    # a run stopped after its step-4 checkpoint, resumed under torchrun: the same losses, bit for bit
    # (a resumed run continues with its own config: no --preset with resume=)
    part = shutil.copytree(runs / "straight", runs / "part")
    shutil.rmtree(part / "checkpoints" / "step_00000008")
    torchrun("keel.cli", "train", *common(tmp, corpus), f"resume={part}", timeout=TIMEOUT)
    assert losses(part) == straight
    assert [r["val_loss"] for r in val_losses(part)] == [r["val_loss"] for r in val_losses(runs / "straight")]
    summary = json.loads((runs / "straight" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tokens"] == 8 * 4 * 32
    assert checkpoint.is_sharded(checkpoint.latest_valid(runs / "straight"))

    # one process on the same global batch (2 x 2 = 4 sequences), from scratch and resumed from the
    # two-rank checkpoint at step 4 from the command line, as the README says: only the per-process batch changes
    # (`keel train resume=` is Trainer.run from the run's latest checkpoint)
    assert losses(runs / "single") == pytest.approx(straight, rel=1e-5)
    typed = runs / "typed"
    shutil.copytree(runs / "straight", typed)
    shutil.rmtree(typed / "checkpoints" / "step_00000008")
    assert main(["train", f"resume={typed}", "run.batch_size=4", "run.progress=false"]) == 0
    assert losses(typed) == pytest.approx(straight, rel=1e-5)
    assert main(["train", f"resume={typed}", "run.batch_size=3", "run.steps=9"]) == 2  # another global batch


def test_validation_is_the_global_batchs_in_one_process_under_fsdp_and_under_stages_by_replicas(ranks, torchrun):
    """run.eval_batches x the global batch: the same windows, split over the ranks however the run is laid out.
    A run of 2 ranks x 2 sequences logs the validation loss of one process of 4; `keel eval` gives that loss on its
    checkpoint in one process, on 2 ranks (FSDP2) and on 2 stages x 2 replicas."""
    from keel.train.evaluate import evaluate_run

    tmp, _, config = ranks
    logged = val_losses(tmp / "runs" / "straight")
    assert [r["step"] for r in logged] == [4, 8]
    val = logged[-1]
    single = json.loads((tmp / "runs" / "single" / "summary.json").read_text())["final_val_loss"]
    assert val["val_loss"] == pytest.approx(single, rel=1e-5)
    assert val_losses(tmp / "runs" / "single")[0]["val_loss"] == pytest.approx(logged[0]["val_loss"], rel=1e-5)

    run_dir = shutil.copytree(tmp / "runs" / "straight", tmp / "runs" / "evaluated")  # its config is edited below
    one = evaluate_run(run_dir)
    assert one["val_tokens"] == val["val_tokens"] == 3 * 4 * config.run.seq_len
    assert one["val_loss"] == pytest.approx(val["val_loss"], rel=1e-5)

    def under_torchrun(nproc: int) -> dict:
        torchrun("keel.cli", "eval", str(run_dir), "--json", nproc=nproc, timeout=TIMEOUT)
        return json.loads((run_dir / "eval-step_00000008-val.json").read_text())

    fsdp = under_torchrun(2)
    saved = (run_dir / "config.yaml").read_text()
    assert "  pp: 1\n" in saved and "  pp_microbatches: 4\n" in saved
    (run_dir / "config.yaml").write_text(saved.replace("  pp: 1\n", "  pp: 2\n").replace(
        "  pp_microbatches: 4\n", "  pp_microbatches: 2\n"))
    from keel.runs import trust

    trust.sign(run_dir)  # edited by its own user: its data path is followed again (keel.runs.trust)
    stages_by_replicas = under_torchrun(4)  # 2 stages x 2 replicas, 6 windows each
    for got in (fsdp, stages_by_replicas):
        assert got["val_tokens"] == one["val_tokens"]
        assert got["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
        assert got["val_bits_per_byte"] == pytest.approx(one["val_bits_per_byte"], rel=1e-5)
