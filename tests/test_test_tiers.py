"""The fast tier stays a minute-scale loop on a shared machine (docs/development.md#tests)."""

import os

import pytest


def test_the_test_session_lets_torchs_idle_openmp_threads_sleep():
    """tests/conftest.py sets the `keel` command's launcher environment before torch loads, so OMP_WAIT_POLICY is
    passive (or what the user chose) for
    this process and the tests' subprocesses. Without it (an import reordered), the fast tier took 497 s instead
    of 133 s on 2 cores at load 3 to 4."""
    assert "OMP_WAIT_POLICY" in os.environ


def test_every_test_file_is_collected_under_a_name_of_its_own():
    """pytest finds tests under testpaths recursively (tests/hostile/ included) and imports each file as a
    top-level module named after the file, so two files of one name in different folders would clash; each file
    here also has a row in docs/development.md's file map (tests/test_layout.py)."""
    import tomllib
    from collections import Counter
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    options = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["testpaths"] == ["tests"]
    files = sorted((root / "tests").rglob("test_*.py"))
    assert any(p.parent.name == "hostile" for p in files)
    assert not list((root / "tests").rglob("__init__.py"))  # rootdir-relative packages would rename modules
    twice = [name for name, n in Counter(p.name for p in files).items() if n > 1]
    assert not twice, twice


def test_no_fast_tier_test_took_a_second_in_the_committed_durations(request):
    """tests/durations.json (benchmarks/cpu/suite_durations) holds every test that took a second or more in the
    last measured CPU run; this session's collection says which of them are still in the fast tier (no `slow`,
    `distributed` or `gpu` marker). The limit is a second on a core of one's own: the run's seconds are divided by
    the machine's share per process (load average over cores, at least 1), as the suite ran on shared cores."""
    import json
    from pathlib import Path

    from conftest import COLLECTED

    data = json.loads((Path(__file__).parent / "durations.json").read_text())
    measured = data["measured"]
    share = max(1.0, measured["load_average"]["mean"] / measured["cores"])
    collected = request.config.stash[COLLECTED]
    if len(collected) < 1000:
        pytest.skip("needs the whole suite collected: `python -m pytest -q` (the fast tier) or CI's run")
    seen = {t: s for t, s in data["tests_over_1s"].items() if t in collected}
    fast = {t: round(s / share, 2) for t, s in seen.items() if not collected[t] and s / share > 1.0}
    assert not fast, f"fast-tier tests over a second (mark them slow or make them cheaper): {fast}"
    assert len(seen) >= 0.8 * len(data["tests_over_1s"]), "tests/durations.json is stale: measure again"
