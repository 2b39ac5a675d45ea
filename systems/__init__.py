"""LLM training-systems workbook library (CS336 systems): models, harnesses, kernels, parallelism."""

from systems.config import PRESETS, ModelConfig, get_config

__all__ = ["ModelConfig", "PRESETS", "get_config"]
