"""The paper's studies, each run by `keel experiment <name>` or `keel sweep results/<name>/study.yaml`: the
research this project does with the library (keel.experiments is the engine they run on: points, sweeps,
searches, the statistics). They live beside the package, not in it: a Keel checkout has them, `pip install`
does not.

`STUDIES` needs no torch, so the command's usage errors answer at once."""

# name -> (module, config class, run function); each run writes results.json, PNG plots and report.md
STUDIES = {
    "gradflow": ("gradflow", "GradflowConfig", "run"),
    "frontier": ("frontier", "FrontierConfig", "run"),
    "downstream-end": ("downstream_end", "DownstreamEndConfig", "run"),
    "depth-sweep": ("depth_sweep", "DepthSweepConfig", "run"),
    "equal-tuning": ("equal_tuning", "EqualTuningConfig", "run"),
}
