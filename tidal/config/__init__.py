"""Typed configs per component and the flag machinery that builds ``--help`` groups from them."""

from tidal.config.args import Checked, ConfigError, add_config_group, arg, config_from_args
from tidal.config.checkpoint import CheckpointConfig
from tidal.config.data import DatasetConfig, PromptDataConfig
from tidal.config.distributed import DistributedConfig
from tidal.config.model import ModelConfig
from tidal.config.training import OptimConfig, TrainConfig

__all__ = [
    "CheckpointConfig",
    "Checked",
    "DatasetConfig",
    "ConfigError",
    "DistributedConfig",
    "ModelConfig",
    "OptimConfig",
    "PromptDataConfig",
    "TrainConfig",
    "add_config_group",
    "arg",
    "config_from_args",
]
