"""The fast tier stays a minute-scale loop on a shared machine (issue 35.2, docs/development.md#tests)."""

import os


def test_the_test_session_lets_torchs_idle_openmp_threads_sleep():
    """tests/conftest.py sets the `keel` command's launcher environment before torch loads, so OMP_WAIT_POLICY is
    passive (or what the user chose) for
    this process and the tests' subprocesses. Without it (an import reordered), the fast tier took 497 s instead
    of 133 s on 2 cores at load 3 to 4."""
    assert "OMP_WAIT_POLICY" in os.environ
