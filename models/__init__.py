"""DeepSeek-V3 / V3.2 / V4 model code (Flax NNX), installed as `jaxspec.models`."""

from .deepseek import DecoderLayer, DeepseekV3, MTPModule
from .deepseek import layer_runs as _v3_layer_runs
from .deepseek_v4 import DeepseekV4
from .deepseek_v4 import layer_runs as _v4_layer_runs
from .mla import MLA
from .moe import MoE, route


def model_class(config) -> type:
    """The model class for a `ModelConfig`: `DeepseekV4` for model_type deepseek_v4, else `DeepseekV3`."""
    return DeepseekV4 if config.is_v4 else DeepseekV3


def layer_runs(config) -> tuple:
    """Where the decoder layers of a `ModelConfig`'s model are: its `models.stack.LayerRun`s, in
    layer order (a layer's parameters are row r of the stack `run.locate(layer)` names)."""
    return _v4_layer_runs(config) if config.is_v4 else _v3_layer_runs(config)


__all__ = ["DecoderLayer", "DeepseekV3", "DeepseekV4", "MLA", "MTPModule", "MoE", "layer_runs", "model_class", "route"]
