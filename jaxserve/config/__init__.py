"""Configuration, split by what it configures: the model (model.py: config.json, presets' fields), the engine's
knobs (engine.py: one field per CLI flag), speculative decoding (speculative.py), the multi-process group
(group.py), and how a field declares its flag (flags.py). Everything is importable from here."""

from jaxserve.config.engine import (
    COMPILE_CACHE_ENV,
    DEFAULT_COMPILE_CACHE,
    KV_CACHE_DTYPES,
    LOG_LEVELS,
    MIXED_HELP,
    SCHEDULING_POLICIES,
    STEP_POLICIES,
    EngineConfig,
    check_kv_cache_dtype,
    step_policy_options,
)
from jaxserve.config.flags import ConfigError, Flag, check_memory_fraction, flag, parse_bytes, parse_fraction
from jaxserve.config.group import GroupConfig
from jaxserve.config.model import (
    CSA,
    FP8_WEIGHT_BLOCK,
    HCA,
    QUANTIZATION_MODES,
    SUPPORTED_DTYPES,
    SWA,
    DSparkConfig,
    ModelConfig,
    YarnConfig,
    config_from_dict,
    load_config,
    to_hf_dict,
)
from jaxserve.config.speculative import (
    MAX_SPECULATIVE_TOKENS,
    SPECULATIVE_METHODS,
    SpeculativeConfig,
    parse_speculative_config,
)

__all__ = [
    "COMPILE_CACHE_ENV",
    "CSA",
    "DEFAULT_COMPILE_CACHE",
    "FP8_WEIGHT_BLOCK",
    "HCA",
    "KV_CACHE_DTYPES",
    "LOG_LEVELS",
    "MAX_SPECULATIVE_TOKENS",
    "MIXED_HELP",
    "QUANTIZATION_MODES",
    "SCHEDULING_POLICIES",
    "STEP_POLICIES",
    "SPECULATIVE_METHODS",
    "SUPPORTED_DTYPES",
    "SWA",
    "ConfigError",
    "DSparkConfig",
    "EngineConfig",
    "Flag",
    "GroupConfig",
    "ModelConfig",
    "SpeculativeConfig",
    "YarnConfig",
    "check_kv_cache_dtype",
    "check_memory_fraction",
    "step_policy_options",
    "config_from_dict",
    "flag",
    "load_config",
    "parse_bytes",
    "parse_fraction",
    "parse_speculative_config",
    "to_hf_dict",
]
