"""A pytest plugin: each test's CPU seconds (this process's and its waited-for children's, setup to teardown), which
a shared machine's load inflates far less than the wall seconds `--durations` reports. Written as JSON at the end:

    PYTHONPATH=benchmarks/cpu/suite_durations CPU_PER_TEST=cpu.json OMP_NUM_THREADS=1 \\
        python -m pytest -q -p no:cacheprovider -p cpu_per_test

gives {"tests": {nodeid: CPU seconds}, "process_cpu": the pytest process's own CPU seconds at the end}. The first
test to load a module (torch's Dynamo, matplotlib) or to make a module fixture carries that cost. One process only
(not under pytest-xdist, whose workers would each write the file).
"""

from __future__ import annotations

import json
import os
import resource
import time

import pytest

SECONDS: dict[str, float] = {}


def _cpu() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = _cpu()
    yield
    SECONDS[item.nodeid] = _cpu() - start


def pytest_sessionfinish(session):
    if out := os.environ.get("CPU_PER_TEST"):
        with open(out, "w") as f:
            json.dump({"tests": SECONDS, "process_cpu": time.process_time()}, f, indent=0)
