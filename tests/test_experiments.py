"""The experiments: the divergence detector on curves with known answers, and each --quick path end to end."""

import json
import math

import pytest
import torch

from keel import TransformerLM, tiny
from keel.data import DataConfig
from keel.experiments import EXPERIMENTS
from keel.experiments.cli import build
from keel.experiments.detect import DetectorConfig, detect
from keel.experiments.gradflow import measure
from keel.experiments.redundancy import removed

CFG = DetectorConfig(window=5, spike=0.5, min_improvement=0.01, patience=20, silent=0.5, burn_in=10)
N = 200


def decay(t):
    return 2.0 + 3.0 * math.exp(-t / 40)


def test_clean_decay_is_healthy():
    assert detect([decay(t) for t in range(N)], CFG) is None


def test_plateau_is_stagnation_at_its_start():
    curve = [decay(t) if t < 80 else decay(80) for t in range(N)]
    step, why = detect(curve, CFG)
    assert why == "stagnation" and 70 <= step <= 80 + CFG.window // 2  # the running median lags by window/2


def test_unrecovered_spike():
    curve = [decay(t) if t < 120 else decay(120) + 2.0 for t in range(N)]
    step, why = detect(curve, CFG)
    assert why == "unrecovered spike" and 120 <= step <= 124


def test_recovered_spike_is_not_divergence():
    curve = [decay(t) + (3.0 if 100 <= t < 103 else 0.0) for t in range(N)]
    assert detect(curve, CFG) is None  # three bad batches; the running median never moves
    longer = [decay(t) + (2.0 if 100 <= t < 115 else 0.0) for t in range(N)]
    assert detect(longer, CFG) is None  # a real excursion, but the loss comes back


def test_slow_run_is_silent_degradation_against_the_reference():
    reference = [decay(t) for t in range(N)]
    slow = [2.0 + 3.0 * math.exp(-t / 400) for t in range(N)]
    step, why = detect(slow, CFG, reference)
    assert why == "silent degradation" and step >= CFG.burn_in
    assert detect(slow, CFG) is None  # without a reference it is merely slow


def test_non_finite_loss():
    curve = [decay(t) for t in range(50)] + [float("nan")]
    assert detect(curve, CFG) == (50, "non-finite")


def test_gradflow_parameter_gradients_add_up_to_the_total():
    torch.manual_seed(0)
    model = TransformerLM(tiny(n_blocks=3))
    x = torch.randint(0, 256, (2, 16))
    m = measure(model, x, x)
    _, loss = model(x, x)
    loss.backward()
    outside = ("embed.", "lm_head.", "final_norm.")
    expected = sum(p.grad.pow(2).sum() for n, p in model.named_parameters() if not n.startswith(outside))
    assert sum(g * g for g in m["grad_params"]) == pytest.approx(expected.item(), rel=1e-5)
    assert len(m["grad_stream"]) == len(m["rms"]) == 6


def test_removing_every_sublayer_leaves_embedding_to_head():
    torch.manual_seed(0)
    model = TransformerLM(tiny(n_blocks=2, scheme="pre_ln")).eval()
    x = torch.randint(0, 256, (1, 8))
    with removed(model, 0, "block"), removed(model, 1, "block"):
        logits, _ = model(x)
    expected = model.lm_head(model.final_norm(model.embed(x)))
    torch.testing.assert_close(logits, expected)
    full, _ = model(x)  # restored afterwards
    assert not torch.allclose(full, expected)


TINY = ["shape.d_model=16", "shape.n_heads=2", "shape.n_kv_heads=1", "shape.seq_len=16", "shape.batch_size=2"]
QUICK = {
    "gradflow": ["schemes=[post_ln,keel]", "depths=[4]", "steps=3"],
    "max-lr": ["schemes=[pre_ln,keel]", "depths=[4]", "steps=12", "detector.patience=4", "detector.burn_in=2"],
    "depth": ["depths=[2,4]", "steps=3"],
    "lr-sweep": ["depth=4", "steps=3"],
    "deep-vs-wide": ["deep_sublayers=4", "wide_sublayers=2", "wide_d_model=32", "steps=3"],
    "redundancy": ["depth=4", "steps=3"],
}


@pytest.fixture(scope="module")
def corpus_cfg(tmp_path_factory):
    import argparse
    import inspect

    root = tmp_path_factory.mktemp("exp")
    (root / "text.txt").write_text(inspect.getsource(argparse) * 2)
    return [f"data.source={root / 'text.txt'}", f"data.cache_dir={root / 'cache'}"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_quick_experiment_writes_results_plots_and_report(name, corpus_cfg, tmp_path):
    cfg = build(name, True, [*TINY, *QUICK[name], *corpus_cfg])
    assert isinstance(cfg.data, DataConfig)
    out = tmp_path / name
    out.mkdir()
    EXPERIMENTS[name][1](cfg, out, f"keel experiment {name} --quick")
    results = json.loads((out / "results.json").read_text())
    assert results["experiment"] == name and results["machine"]["torch_version"]
    report = (out / "report.md").read_text()
    assert f"keel experiment {name} --quick" in report and "|---" in report
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs and all(f"![{p}]({p})" in report for p in pngs)
    # a second run reuses every finished point instead of training again
    points = {p.name: p.stat().st_mtime_ns for p in (out / "points").glob("*.json")}
    EXPERIMENTS[name][1](cfg, out, f"keel experiment {name} --quick")
    assert {p.name: p.stat().st_mtime_ns for p in (out / "points").glob("*.json")} == points


def test_bad_experiment_override_names_the_key():
    with pytest.raises(ValueError, match="depths"):
        build("depth", True, ["depths=many"])


def test_a_sweep_directory_refuses_points_of_another_configuration(corpus_cfg, tmp_path):
    cfg = build("lr-sweep", True, [*TINY, *QUICK["lr-sweep"], *corpus_cfg])
    EXPERIMENTS["lr-sweep"][1](cfg, tmp_path, "keel experiment lr-sweep --quick")
    longer = build("lr-sweep", True, [*TINY, *QUICK["lr-sweep"], *corpus_cfg, "steps=4"])
    with pytest.raises(ValueError, match="differs in steps"):
        EXPERIMENTS["lr-sweep"][1](longer, tmp_path, "keel experiment lr-sweep --quick steps=4")
