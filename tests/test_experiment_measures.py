"""The experiments' measurements and verdicts against written-out equations: gradient flow, the probes, the
held-out split, the unigram level, max-lr's rules and the curves' crossing (regime's rule). (The max-lr detector's
own tests, with false-positive and miss rates, are in test_detect.py; a study file's choices and Holm,
test_declared_study.py.)"""

import contextlib
import math
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch

from keel import TransformerLM, tiny
from keel.config import TrainConfig
from keel.data import DataConfig
from keel.evals.surgery import branches_off, removed, residual_sizes
from keel.experiments.common import fixed_batches, mean_sd, pm, splits, unigram_loss
from keel.experiments.detect import FailureRules
from keel.experiments.maxlr import judge, ratio_verdict, references, verdict
from keel.experiments.stats import crossing
from keel_studies.gradflow import measure


def rmsnorm(x):
    return x / x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()


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
    assert len(m["grad_stream"]) == len(m["rms"]) == len(m["factor"]) == 6


class Echo(torch.nn.Module):
    """A branch whose output is its input: F(u) = u."""

    def forward(self, u, *args, **kwargs):
        return u


def test_shortcut_factor_matches_the_equation_when_the_branch_echoes_its_input():
    """F = u: Post-LN's sum is 2x, factor rms(x)/rms(2x) = 1/2; Keel's u = LN_in(x) = x (x leaves an LN with
    gain 1), so the factor is L / (L + 1); Pre-LN has no norm_out, so no factor."""
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 16))
    for scheme, want in (("post_ln", 0.5), ("keel", 8 / 9), ("pre_ln", None)):
        model = TransformerLM(tiny(n_blocks=4, scheme=scheme))
        for block in model.blocks:
            block.attn, block.ffn = Echo(), Echo()
        factors = measure(model, x, x)["factor"]
        for f in factors[2:]:
            assert (f is None) if want is None else f == pytest.approx(want, rel=1e-3)


def test_residual_sizes_see_what_enters_norm_out():
    torch.manual_seed(0)
    model = TransformerLM(tiny(n_blocks=2, scheme="keel")).eval()
    x = torch.randint(0, 256, (2, 16))
    seen = []
    res = model.blocks[1].ffn_res
    hook = res.norm_out.register_forward_pre_hook(lambda m, a: seen.append(a[0].pow(2).mean().sqrt().item()))
    sizes = residual_sizes(model, x)
    hook.remove()
    assert sizes["rms_sum"][3] == pytest.approx(seen[-1], rel=1e-5)
    assert sizes["rms_ax"][3] == pytest.approx(4.0 * 1.0, rel=1e-2)  # alpha = L = 4 times a unit-rms stream


def test_removing_every_sublayer_leaves_embedding_to_head():
    torch.manual_seed(0)
    model = TransformerLM(tiny(n_blocks=2, scheme="pre_ln")).eval()
    x = torch.randint(0, 256, (1, 8))
    with removed(model, 0), removed(model, 1), removed(model, 2), removed(model, 3):  # every sub-layer of both blocks
        logits, _ = model(x)
    expected = model.lm_head(model.final_norm(model.embed(x)))
    torch.testing.assert_close(logits, expected)
    full, _ = model(x)  # restored afterwards
    assert not torch.allclose(full, expected)


def test_all_keel_branches_off_is_the_head_on_the_normalised_embedding():
    """Every F = 0 in Keel (v2): x, then LN(x), then LN(L * LN(x)) = LN(LN(x)) at unit gains (the second LN
    only removes the eps shrinkage of the first, which normalised the std-0.02 embedding)."""
    torch.manual_seed(0)
    model = TransformerLM(tiny(n_blocks=3, scheme="keel")).eval()
    x = torch.randint(0, 256, (1, 8))
    with torch.no_grad(), branches_off(model, range(6)):
        logits, _ = model(x)
        expected = model.lm_head(rmsnorm(rmsnorm(model.embed(x))))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    with torch.no_grad(), branches_off(model, [5]):  # branch only: LN_out(alpha x) = LN_out(x) still applied
        one_off, _ = model(x)
    with torch.no_grad(), removed(model, 5):
        whole, _ = model(x)
    assert not torch.allclose(one_off, whole)


def test_the_probe_measures_the_lower_half_on_at_any_depth():
    """At 6 sub-layers (not a power of two) the probe also cuts at k = 3, the lower half on, which a declared study's
    probe table reads: the loss with branches 3..5 switched off."""
    from keel.experiments.budget import probe
    from keel.experiments.common import loss_on

    torch.manual_seed(0)
    model = TransformerLM(tiny(n_blocks=3, scheme="keel"))
    batches = [(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))]
    off = probe(model, batches, contextlib.nullcontext)["loss_branches_above_k_off"]
    assert sorted(map(int, off)) == [0, 1, 2, 3, 4, 6]
    with branches_off(model, range(3, 6)):
        assert off["3"] == pytest.approx(loss_on(model, batches), rel=1e-6)


def test_select_and_report_halves_split_the_validation_tokens(corpus, tmp_path):
    data = DataConfig(source=str(corpus), cache_dir=str(tmp_path / "cache"))
    halves = splits(data)
    from keel.experiments.common import corpus as prepared

    val = prepared(data).val
    assert len(halves["select"]) + len(halves["report"]) == len(val)
    assert abs(len(halves["select"]) - len(val) / 2) <= 1  # two halves, not any cut
    assert np.array_equal(np.concatenate([halves["select"], halves["report"]]), val)


def test_unigram_loss_is_the_cross_entropy_of_the_token_frequencies():
    train = np.array([0, 0, 0, 1, 2, 2], dtype=np.uint16)
    batches = fixed_batches(np.array([0, 1, 0, 2, 0, 0, 1], dtype=np.uint16), 2, 3, 1)
    counts = Counter(int(t) for t in train)
    total = len(train) + 256  # add-one smoothing over the byte vocabulary
    targets = [int(t) for _, y in batches for t in y.flatten()]
    want = -sum(math.log((counts.get(t, 0) + 1) / total) for t in targets) / len(targets)
    assert unigram_loss(train, batches) == pytest.approx(want)


def test_max_lr_is_the_lr_of_the_evaluation_before_the_failure():
    rules = FailureRules(confirm=4, window=1)
    lrs = [0.001 * (k + 1) for k in range(40)]
    healthy = [2.0] * 40
    collapsed = [2.0] * 20 + [3.3] * 20
    r = {"evals": {"lr": lrs, "loss": collapsed, "step": list(range(40))}, "unigram": 3.3}
    v = verdict(r, rules, 0.05)
    assert v["failed"] and v["rule"] == "collapse" and v["max_lr"] == pytest.approx(lrs[19])
    r["evals"]["loss"] = healthy
    assert verdict(r, rules, 0.05)["max_lr"] == 0.05 and not verdict(r, rules, 0.05)["failed"]  # the peak: a bound


def test_max_lr_a_curve_that_never_learned_has_no_noise_estimate_and_is_unreliable():
    stuck = [5.5 - 0.2 * k for k in range(12)] + [3.35] * 300  # never below the unigram level
    r = {"evals": {"lr": [1e-5 * k for k in range(312)], "loss": stuck, "step": list(range(312))}, "unigram": 3.3}
    v = verdict(r, FailureRules(), 0.05)
    assert v["noise_sd"] is None and not v["reliable"] and not v["learned"] and v["rule"] == "collapse"
    learned = list(2.5 + np.random.default_rng(0).normal(0, 0.02, 312))
    v = verdict(r | {"evals": r["evals"] | {"loss": learned}}, FailureRules(), 0.05)
    assert v["reliable"] and v["learned"] and 0.0 < v["noise_sd"] <= 0.05


def arms(**schemes) -> dict:
    """arm -> TrainConfig: (scheme, grad_clip) each."""
    base = TrainConfig()
    return {arm: replace(base, model=replace(base.model, scheme=scheme), optim=replace(base.optim, grad_clip=clip))
            for arm, (scheme, clip) in schemes.items()}


def test_max_lr_stagnation_references_are_the_other_schemes_arms_that_clip():
    refs = references(arms(post_ln=("post_ln", 1.0), pre_ln=("pre_ln", 1.0), keel=("keel", 1.0),
                           keel_noclip=("keel", 0.0), pre_ln_noclip=("pre_ln", 0.0)))
    assert refs == {"post_ln": ["pre_ln", "keel"], "pre_ln": ["post_ln", "keel"], "keel": ["post_ln", "pre_ln"],
                    "keel_noclip": ["post_ln", "pre_ln"], "pre_ln_noclip": ["post_ln", "keel"]}


def test_max_lr_stagnation_is_judged_against_the_other_schemes_only():
    rules = FailureRules()
    n = 300
    steps, lrs = [2 * k + 1 for k in range(n)], [1e-5 * (2 * k + 2) for k in range(n)]
    learning = [2.2 + 3.3 * math.exp(-k / 30) for k in range(n)]
    plateau = [max(2.9, v) for v in learning]

    def point(loss):
        return {"evals": {"step": steps, "lr": lrs, "loss": loss}, "unigram": 3.3}
    results = {"pre_ln": point(plateau), "keel": point(learning), "keel_noclip": point(plateau)}
    refs = references(arms(pre_ln=("pre_ln", 1.0), keel=("keel", 1.0), keel_noclip=("keel", 0.0)))
    peaks = dict.fromkeys(results, lrs[-1])
    v = judge(results, refs, rules, peaks)
    gap_from = next(k for k in range(n) if plateau[k] - learning[k] > rules.stagnation_gap)
    assert v["pre_ln"]["rule"] == "stagnation" and v["pre_ln"]["reference"] == "keel"
    assert abs(v["pre_ln"]["at_step"] - steps[gap_from]) <= 2 * (rules.window // 2 + 1)
    assert not v["keel"]["failed"]
    # keel_noclip is judged against pre_ln only, never against keel (its own scheme): no stagnation
    assert not v["keel_noclip"]["failed"]
    alone = judge({"keel": point(plateau)}, {"keel": []}, rules, peaks)
    assert not alone["keel"]["failed"]  # nothing to compare with


def test_max_lr_ratio_verdict_rules():
    def v(lr, failed=True, learned=True):
        return {"max_lr": lr, "failed": failed, "learned": learned, "noise_sd": 0.03}
    keel = [v(1.0e-2), v(1.1e-2), v(0.95e-2)]
    pre = [v(7.6e-3), v(8.0e-3), v(7.4e-3)]
    r = ratio_verdict(keel, pre, 1.32)
    assert r["verdict"] == "agrees" and r["test"]["p"] < 0.05 and r["paper_ratio_vs_ci"] == "within the 95% CI"
    logs = [math.log(a["max_lr"] / b["max_lr"]) for a, b in zip(keel, pre)]
    assert r["ratio"] == pytest.approx(math.exp(sum(logs) / 3))
    assert ratio_verdict(pre, keel, 1.32)["verdict"] == "disagrees"
    # the same values with one seed a bound: a bound that could have made the verdict leaves it inconclusive
    bound = "inconclusive (a bound in the direction of the claim)"
    pre_never_failed = pre[:2] + [v(7.4e-3, failed=False)]  # X's max LR a lower bound: X could be higher
    keel_never_learned = keel[:2] + [v(0.95e-2, learned=False)]  # Keel's an upper bound: Keel could be lower
    assert ratio_verdict(keel, pre_never_failed, 1.32)["verdict"] == bound
    assert ratio_verdict(keel_never_learned, pre, 1.32)["verdict"] == bound
    # ... and the reverse for "disagrees"; a bound against the verdict's direction leaves it standing
    assert ratio_verdict(pre[:2] + [v(7.4e-3, failed=False)], keel, 1.32)["verdict"] == bound
    assert ratio_verdict(pre, keel[:2] + [v(0.95e-2, learned=False)], 1.32)["verdict"] == bound
    assert ratio_verdict(keel[:2] + [v(0.95e-2, failed=False)], pre, 1.32)["verdict"] == "agrees"
    noisy = keel[:2] + [{**v(0.95e-2), "noise_sd": 0.2}]
    assert ratio_verdict(noisy, pre, 1.32)["verdict"] == ("inconclusive (a curve noisier than the detector's "
                                                        "tested range)")
    censored = [v(7.6e-3), v(8.0e-3), v(5e-2, failed=False)]  # a Pre-LN seed never failed: a lower bound
    assert ratio_verdict([v(5e-2), v(5.5e-2), v(4.5e-2)], censored, 1.32)["verdict"].startswith("inconclusive")
    assert ratio_verdict(keel, [v(7.6e-3), v(1.1e-2), v(6e-3)], 1.32)["verdict"] == "inconclusive"


def test_crossing_regimes_rule():
    steps = list(range(10))
    keel = np.array([[5, 4, 3.5, 3, 2.6, 2.4, 2.2, 2.1, 2.0, 1.9]] * 2) + np.array([[0.0], [0.01]])
    pre = np.array([[4.5, 3.8, 3.2, 2.9, 2.7, 2.5, 2.3, 2.2, 2.1, 2.05]] * 2)
    v = crossing(keel, pre, steps, 0.1)
    assert v["starts_slower"] is True and v["cross_step"] == 4


def test_mean_sd():
    assert mean_sd([1.0, 3.0]) == (2.0, pytest.approx(math.sqrt(2)))
    assert mean_sd([1.0, None, float("nan")]) == (1.0, 0.0)
    # a table cell: one value is shown without an SD (0.000 would claim no spread)
    assert (pm([1.0, 3.0]), pm([1.0, None]), pm([None])) == ("2.000 ± 1.414 (n=2)", "1.000 (n=1)", "-")
