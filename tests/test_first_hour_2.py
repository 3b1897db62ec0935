"""A user's first hour, continued (issue 35): OpenMP's wait policy for Python users, one line on Ctrl-C, the
step `keel runs` shows for an interrupted run, short runs' plots, lm-eval offline. Each test failed before the
change it covers."""

import os
import subprocess
import sys

import pytest

import keel


# ---- OpenMP's wait policy: `import keel` does what the `keel` command does, while it can -----------------
def _policy_after(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code += "\nimport os\nprint(os.environ.get('OMP_WAIT_POLICY'))"
    return subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], capture_output=True,
                          text=True, timeout=120, env=base | env)


def test_import_keel_before_torch_makes_idle_openmp_threads_sleep():
    run = _policy_after("import keel\nimport torch")
    assert (run.returncode, run.stdout) == (0, "passive\n"), run.stderr[-1500:]


def test_a_wait_policy_the_user_chose_is_kept():
    run = _policy_after("import keel\nimport torch", OMP_WAIT_POLICY="active")
    assert (run.returncode, run.stdout) == (0, "active\n"), run.stderr[-1500:]


def test_with_torch_imported_first_the_policy_is_left_alone_and_a_busy_machine_is_warned(monkeypatch):
    # too late to take effect (OpenMP read the variable when torch loaded): setting it would only make
    # run.json's omp_wait_policy say what did not happen
    assert "torch" in sys.modules
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (5.5, 5.0, 4.0))
    assert keel._passive_openmp() == (
        "keel: torch was imported before keel, so its idle OpenMP threads spin; with load average 5.5 on 2 CPUs "
        "that can make CPU work several times slower: import keel before torch, or set OMP_WAIT_POLICY=passive "
        "before Python starts (OMP_WAIT_POLICY=active: keep spinning, no warning)")
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 1.0))  # an idle machine: nothing to say
    assert keel._passive_openmp() is None
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")  # the user's choice: no warning even when busy
    monkeypatch.setattr(os, "getloadavg", lambda: (5.5, 5.0, 4.0))
    assert keel._passive_openmp() is None


@pytest.mark.parametrize("load, warned", [(0.0, False), (99.0, True)])
def test_importing_keel_after_torch_warns_only_on_a_busy_machine(load, warned):
    code = (f"import os, warnings\nos.getloadavg = lambda: ({load!r}, 0.0, 0.0)\nimport torch\n"
            "with warnings.catch_warnings(record=True) as w:\n    warnings.simplefilter('always')\n    import keel\n"
            "print(len(w), w and w[0].category.__name__, w and os.path.basename(w[0].filename))")
    run = _policy_after(code)
    expected = "1 RuntimeWarning <string>\n" if warned else "0 [] []\n"
    assert (run.returncode, run.stdout) == (0, expected + "None\n"), run.stderr[-1500:]
