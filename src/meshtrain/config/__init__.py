"""The torch-free description of a run.

:class:`Config` and its sections (:mod:`.sections`), loaded from defaults, a TOML file and
``--set`` overrides (:mod:`.loading`); the decoder's shape (:mod:`.model`), a layout's degrees
(:mod:`.layout`), the rules every layout obeys (:mod:`.layout_rules`), a model's size from its
config (:mod:`.model_size`), and the runtime's sizing facts the planner prices
(:mod:`.runtime_facts`). Nothing here imports torch, so a laptop without it can plan a run.

``from meshtrain.config import Config, ModelConfig, load_config`` is the public way in.
"""

from meshtrain.config.layout import Layout
from meshtrain.config.loading import (
    apply_mapping,
    config_from_dict,
    default_config_path,
    load_config,
    parse_override,
    set_key,
)
from meshtrain.config.model import ModelConfig
from meshtrain.config.sections import (
    DEVICES,
    GRAD_REDUCE_DTYPES,
    LR_SCHEDULES,
    NONFINITE_POLICIES,
    OUTER_GRAD_DTYPES,
    PRECISIONS,
    SECTION_NAMES,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    ParallelConfig,
    TrainConfig,
)

__all__ = [
    "DEVICES", "GRAD_REDUCE_DTYPES", "LR_SCHEDULES", "NONFINITE_POLICIES", "OUTER_GRAD_DTYPES",
    "PRECISIONS", "SECTION_NAMES", "CheckpointConfig", "Config", "ConfigError", "DataConfig",
    "Layout", "ModelConfig", "ParallelConfig", "TrainConfig", "apply_mapping", "config_from_dict",
    "default_config_path", "load_config", "parse_override", "set_key",
]
