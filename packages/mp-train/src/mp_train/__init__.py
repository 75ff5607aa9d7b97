"""mp-train: the run's configuration, initialization and Megatron's training loop.

RunConfig (one dataclass tree, Megatron's names), the argument parser and
YAML loader, `mp-train estimate` (theoretical memory and FLOPs), setup_run
and pretrain().
"""

from mp_train.configuration.arguments import ArgumentGroupFactory, build_parser, parse_config
from mp_train.configuration.config import (
    GPTConfig,
    LoggingConfig,
    RunConfig,
    TrainingConfig,
    validate,
)
from mp_train.configuration.pipeline_segments import pipeline_segments
from mp_train.configuration.yaml_config import load_yaml_config
from mp_train.entry_point import load_config
from mp_train.errors import ConfigError, launch_rank, report
from mp_train.estimate import estimate
from mp_train.loop.cpu_scheduling import batch_scheduling
from mp_train.loop.evaluation import evaluate
from mp_train.loop.microbatches import MicroBatchCalculator
from mp_train.loop.setup import Initialized, Run, TrainState, initialize, setup_run
from mp_train.loop.signals import TrainingShutdown
from mp_train.loop.training import pretrain
from mp_train.observability.timers import Timers

__all__ = [
    "ArgumentGroupFactory",
    "ConfigError",
    "GPTConfig",
    "Initialized",
    "LoggingConfig",
    "MicroBatchCalculator",
    "Run",
    "RunConfig",
    "Timers",
    "TrainState",
    "TrainingConfig",
    "TrainingShutdown",
    "batch_scheduling",
    "build_parser",
    "estimate",
    "evaluate",
    "initialize",
    "launch_rank",
    "load_config",
    "load_yaml_config",
    "parse_config",
    "pipeline_segments",
    "pretrain",
    "report",
    "setup_run",
    "validate",
]
