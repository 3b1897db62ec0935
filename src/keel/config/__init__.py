"""Configuration: dataclasses for model / data / optimiser / guard / run, and the one merge every command uses
(preset < YAML file < dotted overrides; docs/internals.md#keelconfig)."""

from keel.config.merge import add_config_arguments, load_run_config, merge, to_config, to_yaml
from keel.config.presets import DEFAULT_PRESET, PRESETS, load_config, train_preset
from keel.config.reads import Reads
from keel.config.schema import (
    GUARD_POLICIES,
    SCHEDULES,
    TRACKERS,
    WEIGHTS,
    GuardConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
    optimizer_implementation,
    validate,
    validate_runtime,
)
from keel.data.corpus import DataConfig
from keel.errors import ConfigError

__all__ = ["DEFAULT_PRESET", "GUARD_POLICIES", "PRESETS", "SCHEDULES", "TRACKERS", "WEIGHTS",
           "ConfigError", "DataConfig", "GuardConfig", "OptimConfig", "Reads", "RunConfig", "TrainConfig",
           "add_config_arguments", "load_config", "load_run_config", "merge", "optimizer_implementation", "to_config",
           "to_yaml", "train_preset", "validate", "validate_runtime"]
