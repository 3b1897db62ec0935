"""benchmarks/gpu/norm_window.py, the junction-norm window, checked on a CPU: the same command at toy size measures
every arm in every round and writes it all down, a command cut off by its limit still leaves its JSON, the kernel
counts by name reproduce a recorded H100 profile, and by the calibrated model its parts fit their boxes and the
boxes one 8-minute command, as benchmarks/gpu/README.md says."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from norm_window import (
    BOXES,
    HELD_2048,
    MIX_ENV,
    MODELS_1024,
    PARTNERS_2048,
    SLACK,
    TOY_ROUNDS,
    TOY_STEPS,
    reduction_counts,
)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu" / "norm_window.py"


def window(out: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(out), "--toy", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.mark.slow
def test_the_window_at_toy_size_measures_every_arm_in_every_round(tmp_path):
    """The command a GPU runs, at CPU-test size: every part done; each worker under its own Inductor setting; each arm
    built with the junction norms it names (counted on the built model); every model in every round with its timed
    steps, the order reversed each round; every d=1024 model profiled by kernel name; at d=2048 the one-pass Keel
    beside each partner in every round; the ratios summarised and the table written."""
    run = window(tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads((tmp_path / "norm_window.json").read_text())
    assert r["status"] == dict.fromkeys(BOXES, "done")
    assert {w: r["workers"][w][MIX_ENV] for w in r["workers"]} == {"mix_on": "1", "mix_off": "0"}
    if hasattr(torch._inductor.config.triton, "mix_order_reduction"):  # the variable reached Inductor's config
        assert [r["workers"][w]["mix_order_reduction"] for w in ("mix_on", "mix_off")] == [True, False]

    keys = [m.key for m in MODELS_1024]
    assert list(r["models"]["1024"]) == keys and len(set(keys)) == 6
    for m in MODELS_1024:
        pairs = r["models"]["1024"][m.key]["norm_pairs"]
        if m.scheme == "pre_ln":
            assert pairs == {"one_pass": 0, "chained": 0}
        else:  # the arm is what it says: all of its junction norm pairs one-pass, or all chained
            assert pairs[m.junction] > 0 and sum(pairs.values()) == pairs[m.junction]

    settings = r["settings"]  # at toy size: two rounds (the order reversed in the second) of two timed steps
    assert [settings[k] for k in ("rounds", "steps", "rounds_2048", "steps_2048")] == [TOY_ROUNDS, TOY_STEPS] * 2
    rounds = r["rounds"]["1024"]
    assert [row["round"] for row in rounds] == list(range(TOY_ROUNDS)) == [0, 1]
    for row in rounds:
        assert row["order"] == (keys if row["round"] % 2 == 0 else keys[::-1])
        assert all(len(row["times"][k]["times_s"]) == TOY_STEPS for k in keys)
    assert set(r["profile"]) == set(keys)
    assert all(p["by_name"] and set(p["counts"]) >= {"reductions", "norm_backward"} for p in r["profile"].values())

    d2048 = r["rounds"]["2048"]
    assert [row["partner"] for row in d2048] == [p.key for p in PARTNERS_2048 for _ in range(TOY_ROUNDS)]
    for row in d2048:
        assert set(row["times"]) == {HELD_2048.key, row["partner"]}
        assert all(len(t["times_s"]) == TOY_STEPS for t in row["times"].values())
    assert set(r["models"]["2048"]) == {HELD_2048.key} | {p.key for p in PARTNERS_2048}

    ratios = r["summary"]["1024"]["ratios"]
    assert all(f"{m.key} / pre_ln:{m.setting}" in ratios for m in MODELS_1024 if m.scheme == "keel")
    assert len(r["summary"]["2048"]["ratios"]) == len(PARTNERS_2048) + 2
    assert r["summary"]["1024"]["n_steps"] == dict.fromkeys(keys, TOY_ROUNDS * TOY_STEPS)
    table = (tmp_path / "norm_window.md").read_text()
    assert "## d=1024 (measured)" in table and "## d=2048 (measured)" in table and "RMSNorm backward" in table
    assert "PREDICTED" in table
    assert all((tmp_path / f"worker-{w}.log").exists() for w in ("mix_on", "mix_off"))


@pytest.mark.slow
def test_a_window_cut_off_by_its_limit_keeps_its_json_and_ends_in_time(tmp_path):
    """A limit too short for the window: the command still ends (exit 0) within the limit and the workers' grace,
    every part has a status, and the JSON holds whatever was measured."""
    # well short of the whole toy window (about 20 CPU s in two workers: 10 s or more on 2 idle cores; at 12 s it
    # once ran to the end, 2026-12-08): on idle cores the workers start and build within it; under load they may
    # not start, and then every part reads "not run"
    limit = 6
    start = time.monotonic()
    run = window(tmp_path, "--seconds", str(limit))
    assert run.returncode == 0, run.stderr[-3000:]
    assert time.monotonic() - start < limit + 20 + 30  # the limit, the workers' grace, Python starting
    r = json.loads((tmp_path / "norm_window.json").read_text())
    assert set(r["status"]) == set(BOXES) and r["status"] != dict.fromkeys(BOXES, "done")


def test_kernel_counts_by_name_reproduce_the_recorded_h100_profile():
    """The reduction counts on kernel names as torch.profiler recorded them on one H100 (2026-11-26, d=1024, 32k
    tokens, compiled default): Keel 126 RMSNorm backwards a step against Pre-LN's 64, forwards 128 each, as
    benchmarks/gpu/h100-2026-11-26-c.md reads the same table."""
    recorded = json.loads((REPO / "benchmarks" / "gpu" / "h100-2026-11-26-c" / "window-profile-tokens512.json")
                          .read_text())["profile"]["schemes"]
    counts = {s: reduction_counts(recorded[s]["by_name"]) for s in ("keel", "pre_ln")}
    assert {s: (c["reductions"], c["norm_forward"], c["norm_backward"], c["other_sums"]) for s, c in counts.items()} \
        == {"keel": (254, 128, 126, 0), "pre_ln": (192, 128, 64, 0)}
    # a gain's gradient summed alone (mix-order reduction off) and a host operator
    assert reduction_counts({"triton_red_fused__to_copy_mul_sum": {"count": 2, "ms": 1.0},
                             "aten::mm": {"count": 5, "ms": 1.0}}) == {
        "reductions": 2, "norm_forward": 0, "norm_backward": 0, "other_sums": 2, "kernels": 7}


@pytest.mark.slow
def test_the_window_fits_one_8_minute_command_by_the_calibrated_model_and_the_readme_says_so():
    from norm_window import plan, plan_markdown

    p = plan()
    assert all(part["predicted_s"] <= part["box_s"] for part in p["parts"].values())
    assert p["seconds"] == sum(BOXES.values()) + SLACK <= 480 - 15  # inside `timeout 480` with room to end
    readme = (REPO / "benchmarks" / "gpu" / "README.md").read_text()
    assert plan_markdown(p) in readme
    assert "timeout 480 python3 benchmarks/gpu/norm_window.py $OUT" in readme
