"""DeepSeek-V3 / V3.2 model code (Flax NNX), installed as `jaxspec.models`."""

from .deepseek import DecoderLayer, DeepseekV3, MTPModule
from .mla import MLA
from .moe import MoE, route

__all__ = ["DecoderLayer", "DeepseekV3", "MLA", "MTPModule", "MoE", "route"]
