"""What only CUDA shows. Marked `gpu`: skipped without a GPU (tests/conftest.py), run by `pytest -m gpu`."""

import json
import os
import subprocess
import sys

import pytest
import torch

from keel.config import load_config
from keel.model import ModelConfig, TransformerLM
from keel.runs.run_dir import RunDir
from keel.runtime import autocast_for
from keel.scale.parallel import parallelize
from keel.train.trainer import Trainer

pytestmark = pytest.mark.gpu


def small(scheme="keel", **kw) -> ModelConfig:
    return ModelConfig(vocab_size=256, d_model=64, n_blocks=4, n_heads=4, n_kv_heads=2, max_seq_len=64,
                       scheme=scheme, **kw)


def test_bf16_autocast_keeps_the_stream_float32_on_cuda():
    torch.manual_seed(0)
    model = TransformerLM(small()).cuda()
    seen = []
    for block in model.blocks:
        block.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    head = []
    model.lm_head.register_forward_hook(lambda m, i, o: head.append(o.dtype))
    x = torch.randint(0, 256, (2, 32), device="cuda")
    with autocast_for(torch.device("cuda"), "auto")():  # auto on CUDA = bf16
        _, loss = model(x, x)
    loss.backward()
    assert set(seen) == {torch.float32} and head == [torch.bfloat16]
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_cuda_rng_state_in_checkpoints_resumes_exactly(args, tmp_path):
    """Dropout draws from the CUDA generator: a resumed run only repeats the straight run's masks (and so its
    losses) if the checkpoint carried that generator's state. Other masks would move the loss by ~1e-2; the
    tolerance only absorbs the ~1e-6 run-to-run noise of CUDA kernels that accumulate with atomics."""
    common = ("run.device=cuda", "run.dtype=float32", "model.dropout=0.2",
              "run.ckpt_every=5", "run.eval_every=0")
    Trainer(load_config(args(*common, name="straight"), preset="tiny")).run()

    class Killed(Exception):
        pass

    def kill(trainer, step):
        if step == 7:
            raise Killed
    with pytest.raises(Killed):
        Trainer(load_config(args(*common, name="killed"), preset="tiny"), callbacks=[kill]).run()
    killed = RunDir.open(tmp_path / "runs" / "killed")
    config = killed.resume_config(["run.progress=false"])
    Trainer(config).run(killed.latest_checkpoint())
    straight = RunDir.open(killed.parent / "straight")

    def losses(run):
        return [(r["step"], r["loss"]) for r in run.metrics() if "loss" in r and "event" not in r]
    assert [s for s, _ in losses(killed)] == [s for s, _ in losses(straight)] == list(range(1, 21))
    assert [v for _, v in losses(killed)] == pytest.approx([v for _, v in losses(straight)], rel=1e-5, abs=1e-6)


def test_compile_on_cuda_matches_eager():
    torch.manual_seed(0)
    eager = TransformerLM(small()).cuda()
    compiled = TransformerLM(small()).cuda()
    compiled.load_state_dict(eager.state_dict())
    parallelize(compiled, compile=True)
    x = torch.randint(0, 256, (2, 32), device="cuda")
    _, a = eager(x, x)
    _, b = compiled(x, x)
    a.backward()
    b.backward()
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_one_fsdp2_step_with_nccl_on_one_gpu(args, tmp_path):
    """torchrun with one process: FSDP2 over NCCL, sharded checkpoint; float32 losses equal a plain run's."""
    common = ("run.device=cuda", "run.dtype=float32", "run.steps=3", "run.eval_every=0", "run.progress=false")
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--standalone",
                          "-m", "keel.cli", "train", "--preset", "tiny", *args(*common, name="fsdp")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    Trainer(load_config(args(*common, name="plain"), preset="tiny")).run()
    runs = tmp_path / "runs"
    fsdp = json.loads((runs / "fsdp" / "summary.json").read_text())
    assert fsdp["world_size"] == 1 and (RunDir(runs / "fsdp").latest_checkpoint() / ".metadata").is_file()

    def losses(name):
        return [r["loss"] for r in RunDir(runs / name).metrics() if "loss" in r]
    assert losses("fsdp") == pytest.approx(losses("plain"), rel=1e-4)
