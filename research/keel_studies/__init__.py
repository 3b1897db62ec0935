"""The paper's studies, each run by `keel experiment <name>` or `keel sweep results/<name>/study.yaml`: the
research this project does with the library (keel.experiments is the engine they run on: points, sweeps,
searches, the statistics). They live beside the package, not in it: a Keel checkout has them, `pip install`
does not.

`STUDIES` needs no torch, so the command's usage errors answer at once; `EXPERIMENTS` (name -> (config class, run
function)) imports the modules on first use."""

import importlib

# name -> (module, config class, run function); each run writes results.json, PNG plots and report.md
STUDIES = {
    "gradflow": ("gradflow", "GradflowConfig", "run"),
    "frontier": ("frontier", "FrontierConfig", "run"),
    "downstream-end": ("downstream_end", "DownstreamEndConfig", "run"),
    "depth-sweep": ("depth_sweep", "DepthSweepConfig", "run"),
    "equal-tuning": ("equal_tuning", "EqualTuningConfig", "run"),
}


def __getattr__(name: str):
    if name == "EXPERIMENTS":  # loaded once
        modules = {m: importlib.import_module(f"keel_studies.{m}") for m, _, _ in STUDIES.values()}
        experiments = {n: (getattr(modules[m], c), getattr(modules[m], r)) for n, (m, c, r) in STUDIES.items()}
        globals()["EXPERIMENTS"] = experiments
        return experiments
    raise AttributeError(f"module 'keel_studies' has no attribute {name!r}")
