"""Property-based: whatever dotted overrides or YAML a user gives `keel train --dry-run`, the answer is exit 0 or
one line with exit 2, never a traceback, and an existing run is never touched."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keel.cli import main
from keel.config import TrainConfig

pytestmark = pytest.mark.slow

KEYS = ["model.n_blocks", "model.d_model", "model.n_heads", "model.n_kv_heads", "model.scheme", "model.alpha",
        "model.first_layer", "model.norm_eps", "model.dropout", "model.vocab_size", "optim.lr", "optim.beta1",
        "optim.beta2", "optim.eps", "optim.weight_decay", "optim.warmup_steps", "optim.schedule", "optim.grad_clip",
        "guard.policy", "guard.spike_window", "guard.spike_min_history", "guard.spike_factor", "guard.spike_min_rise",
        "guard.loss_ceiling",
        "run.steps", "run.batch_size", "run.seq_len", "run.seed", "run.device", "run.dtype", "run.name",
        "run.grad_accum", "run.ac_every", "run.fused_junction", "data.val_fraction", "scheme", "steps", "bogus",
        "model", "run", "run.name.deeper"]
VALUES = st.one_of(
    st.integers(-10, 10**4).map(str), st.sampled_from(["inf", "-inf", "nan", "1e309", str(2**70), "-0", "1e-30"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr), st.booleans().map(str).map(str.lower),
    st.sampled_from(["keel", "pre_ln", "L", "sqrtL", "v2", "cuda", "cpu", "bfloat16", "rollback", "[1, 2]",
                     "{a: 1}", "null", "", "..", "a/b", "'quoted'", "é", "\t", "${oops}"]),
    st.text(max_size=8),
)
OVERRIDES = st.lists(st.tuples(st.sampled_from(KEYS), VALUES).map("=".join), max_size=4)


def snapshot(root: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def existing(tmp_path_factory):
    from keel.config import to_yaml

    root = tmp_path_factory.mktemp("fuzz")
    run = root / "runs" / "kept"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(TrainConfig()))
    return root


# derandomized: CI sees the same examples every run, so a failure is reproducible, not flaky
FUZZ = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings(max_examples=150, **FUZZ)
@given(overrides=OVERRIDES, resume=st.booleans())
def test_fuzzed_overrides_exit_0_or_2_and_touch_nothing(overrides, resume, existing, capsys):
    before = snapshot(existing)
    extra = [f"resume={existing / 'runs' / 'kept'}"] if resume else []
    code = main(["train", "--preset", "tiny", "--dry-run", f"run.out_dir={existing / 'runs'}", *extra, *overrides])
    err = capsys.readouterr().err
    assert code in (0, 2)
    if code == 2:
        lines = err.strip().splitlines()
        assert lines and lines[-1].startswith("keel: error: "), err
    assert snapshot(existing) == before


@settings(max_examples=80, **FUZZ)
@given(text=st.one_of(st.text(max_size=60), st.binary(max_size=60).map(lambda b: b.decode("latin-1")),
                      st.sampled_from(["model: 5", "- a", "run: {steps: -1}", "optim:\n  lr: .inf", "[", "run:\n  x: 1",
                                       "model: {scheme: keel, alpha: 0}", "data: null", "a: !!python/object {}"])))
def test_fuzzed_yaml_exits_0_or_2(text, existing, tmp_path_factory, capsys):
    path = tmp_path_factory.mktemp("yaml") / "c.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    before = snapshot(existing)
    code = main(["train", "--preset", "tiny", "--dry-run", "--config", str(path), f"run.out_dir={existing / 'runs'}"])
    err = capsys.readouterr().err
    assert code in (0, 2), err
    if code == 2:
        assert err.strip().splitlines()[-1].startswith("keel: error: "), err
    assert snapshot(existing) == before
