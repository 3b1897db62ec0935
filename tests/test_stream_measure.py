"""The stream-precision measurement (keel.experiments.stream): a bf16 sum worked out by hand, the rounding hooks on
every shortcut sum and the stream, and a declared stream study's arithmetic table from written-out profiles."""

import statistics

import pytest
import torch

from keel import TransformerLM, tiny
from keel.experiments import stream


def test_bf16_sum_keeps_only_what_bf16_resolves():
    # bf16 has 8 significant bits: between 256 and 512 its spacing is 2, so 256 + 0.5 rounds back to 256 (nothing
    # survives) and 256 + 1.5 rounds up to 258 (the update arrives as 2: 4/3 of it)
    ax = torch.full((4, 8), 256.0)
    assert stream.survival(ax, torch.full((4, 8), 0.5)) == (0.0, 1.0)
    share, err = stream.survival(ax, torch.full((4, 8), 1.5))
    assert share == pytest.approx(2 / 1.5) and err == pytest.approx(0.5 / 1.5)
    assert stream.survival(torch.ones(3), torch.full((3,), 0.5)) == (1.0, 0.0)  # 1.5 is exact in bf16


def test_bf16_stream_rounds_every_shortcut_sum_and_the_stream():
    torch.manual_seed(0)
    model = TransformerLM(tiny(n_blocks=3, d_model=32, n_heads=2))
    x = torch.randint(0, 256, (2, 16))
    plain, _ = model(x)
    handles = stream.round_stream(model)
    seen = []
    for s in model.sublayers():
        res = model.get_submodule(s.path)
        res.register_forward_pre_hook(lambda m, args: seen.append(args[0]))  # after round_stream's own hook
        if res.norm_out is not None:
            res.norm_out.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    rounded, _ = model(x)
    assert len(seen) > 6 and all(torch.equal(t, t.to(torch.bfloat16).float()) for t in seen)
    assert not torch.allclose(plain, rounded, atol=1e-6)
    for h in handles:
        h.remove()
    seen.clear()
    again, _ = model(x)
    assert torch.equal(again, plain)


def test_a_stream_study_reports_the_median_share_past_the_first_two_sublayers(tmp_path, monkeypatch):
    """Profiles written out per point (no training): the table's share is the median over sub-layers 2.. (the first
    two left out), mean ± SD over seeds, for the float32 arm at init (4 and 8 sub-layers) and trained, and the bf16 arm
    trained; the bf16 arm has no init rows; the tests compare bf16 with float32 seed by seed."""
    from keel.experiments import declared

    def profile(n, level):
        return {"share": [9.0, 9.0, *(level + k / 100 for k in range(n - 2))], "rel_err": [0.5] * n,
                "f_over_ax": [1e-4] * n}
    made = []

    def fake_point(study, arm, cell, hp, seed):
        made.append((arm, seed))
        return {"seed": seed, "diverged": False, "select_loss": 1.0, "n_sublayers": 4, "evals": {"step": [1], "loss": [
            2.0]}, "report_loss": 2.0 + 0.01 * seed * (arm == "bf16"), "survival": profile(4, 0.8 + 0.1 * seed)}

    def fake_init(config):
        return profile(config.model.n_sublayers, 0.01 * config.run.seed)
    monkeypatch.setattr(declared, "point", fake_point)
    monkeypatch.setattr(stream, "init_point", fake_init)
    doc = {"base": {"data": {"source": "stdlib"}},
           "arms": {"f32": {"model.scheme": "keel"}, "bf16": {"model.scheme": "keel"}},
           "stream": {"bf16": ["bf16"], "init_blocks": [2, 4]}, "seeds": [0, 1, 2], "compare": [["bf16", "f32"]],
           "curve_every": 1}
    results = declared.run(declared.read(doc, "test"), tmp_path, "test")
    assert sorted(k for k in results["points"] if k.startswith("init-")) == [
        f"init-f32-n_blocks{n}-seed{s}" for n in (2, 4) for s in (0, 1, 2)]
    # init at 8 sub-layers, seed s: sub-layers 2..7 hold 0.01 s + 0.00 .. 0.05, median 0.01 s + 0.025
    assert results["arithmetic"]["f32-8-init"] == pytest.approx([0.025, 0.035, 0.045])
    assert results["arithmetic"]["f32-4-init"] == pytest.approx([0.005, 0.015, 0.025])
    assert results["arithmetic"]["bf16-4-trained"] == pytest.approx([0.805, 0.905, 1.005])
    assert "bf16-4-init" not in results["arithmetic"]
    mean, sd = statistics.fmean([0.805, 0.905, 1.005]), statistics.stdev([0.805, 0.905, 1.005])
    report = (tmp_path / "report.md").read_text()
    assert f"| bf16 | 4 | trained (bfloat16 stream) | {mean:.3f} ± {sd:.3f} (n=3) |" in report
    assert "| f32 | 8 | init | 0.035 ± 0.010 (n=3) |" in report
    assert results["tests"][0]["mean"] == pytest.approx(0.01)
