"""The paper's experiments as commands: `keel experiment <name> [--quick] [key=value ...]`."""

from keel.experiments import ablations, downstream, frontier, gradflow, maxlr, precision, redundancy, regime, scaling

# name -> (config class, run function); each run writes results.json, PNG plots and report.md
EXPERIMENTS = {
    "gradflow": (gradflow.GradflowConfig, gradflow.run),
    "max-lr": (maxlr.MaxLRConfig, maxlr.run),
    "depth": (scaling.DepthConfig, scaling.run_depth),
    "lr-sweep": (scaling.LRSweepConfig, scaling.run_lr_sweep),
    "deep-vs-wide": (scaling.DeepWideConfig, scaling.run_deep_vs_wide),
    "ablations": (ablations.AblationConfig, ablations.run),
    "redundancy": (redundancy.RedundancyConfig, redundancy.run),
    "regime": (regime.RegimeConfig, regime.run),
    "stream-precision": (precision.PrecisionConfig, precision.run),
    "frontier": (frontier.FrontierConfig, frontier.run),
    "downstream": (downstream.DownstreamConfig, downstream.run),
}
