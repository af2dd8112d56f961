"""Experiment configuration: what a run is (`experiment`), and checking builder options (`options`)."""

from swarm.config.experiment import (
    ConfigError,
    ExperimentConfig,
    LinkConfig,
    LinkOverride,
    OptimizerConfig,
    config_from_text,
    load_config,
)

__all__ = [
    "ConfigError",
    "ExperimentConfig",
    "LinkConfig",
    "LinkOverride",
    "OptimizerConfig",
    "config_from_text",
    "load_config",
]
