"""The paper's experiments as commands: `keel experiment <name> [--quick] [key=value ...]`.

`NAMES` needs no torch, so the command's usage errors answer at once; `EXPERIMENTS` imports every experiment
(and torch) on first use."""

import importlib

# name -> (module, config class, run function); each run writes results.json, PNG plots and report.md
_REGISTRY = {
    "gradflow": ("gradflow", "GradflowConfig", "run"),
    "max-lr": ("maxlr", "MaxLRConfig", "run"),
    "depth": ("scaling", "DepthConfig", "run_depth"),
    "lr-sweep": ("scaling", "LRSweepConfig", "run_lr_sweep"),
    "deep-vs-wide": ("scaling", "DeepWideConfig", "run_deep_vs_wide"),
    "ablations": ("ablations", "AblationConfig", "run"),
    "redundancy": ("redundancy", "RedundancyConfig", "run"),
    "regime": ("regime", "RegimeConfig", "run"),
    "stream-precision": ("precision", "PrecisionConfig", "run"),
    "frontier": ("frontier", "FrontierConfig", "run"),
    "downstream": ("downstream", "DownstreamConfig", "run"),
    "downstream-end": ("downstream_end", "DownstreamEndConfig", "run"),
    "tuned": ("tuned", "TunedConfig", "run"),
    "depth-pilot": ("pilot", "PilotConfig", "run"),
    "depth-sweep": ("depth_sweep", "DepthSweepConfig", "run"),
    "equal-tuning": ("equal_tuning", "EqualTuningConfig", "run"),
}
NAMES = tuple(_REGISTRY)


def __getattr__(name: str):
    if name == "EXPERIMENTS":  # name -> (config class, run function), loaded once
        modules = {m: importlib.import_module(f"keel.experiments.{m}") for m, _, _ in _REGISTRY.values()}
        experiments = {n: (getattr(modules[m], c), getattr(modules[m], r)) for n, (m, c, r) in _REGISTRY.items()}
        globals()["EXPERIMENTS"] = experiments
        return experiments
    raise AttributeError(f"module 'keel.experiments' has no attribute {name!r}")
