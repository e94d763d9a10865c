"""--speculative-config: vLLM's JSON, parsed and checked."""

from __future__ import annotations

import json
from dataclasses import dataclass

from jaxserve.config.flags import ConfigError

SPECULATIVE_METHODS = ("mtp",)
MAX_SPECULATIVE_TOKENS = 3


@dataclass(frozen=True)
class SpeculativeConfig:
    """--speculative-config (vLLM's JSON): draft `num_speculative_tokens` tokens a step with the model's MTP block
    and verify them in one forward (jaxserve.runner.speculative)."""

    method: str
    num_speculative_tokens: int

    def __post_init__(self):
        if self.method == "dspark":  # vLLM's method for DeepSeek-V4-Flash-0731 and -Pro-0813's drafter
            raise ConfigError(
                "speculative_config.method='dspark': DSpark drafting is not supported yet; jaxserve serves those "
                "checkpoints' backbone without drafts (leave out --speculative-config)"
            )
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_config.method={self.method!r}: jaxserve drafts with the checkpoint's own MTP block; "
                f"use one of {SPECULATIVE_METHODS}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"speculative_config.num_speculative_tokens={k!r}: must be an integer in 1..{MAX_SPECULATIVE_TOKENS}"
            )


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """'{"method": "mtp", "num_speculative_tokens": 2}' -> SpeculativeConfig; every error names the field."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as bad:
        raise ConfigError(f"speculative_config={text!r}: not JSON ({bad})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"speculative_config={text!r}: must be a JSON object")
    unknown = sorted(set(raw) - {"method", "num_speculative_tokens"})
    if unknown:
        raise ConfigError(
            f"speculative_config: unknown fields {unknown}; jaxserve reads method and num_speculative_tokens"
        )
    for name in ("method", "num_speculative_tokens"):
        if name not in raw:
            raise ConfigError(f"speculative_config: {name} is missing")
    return SpeculativeConfig(raw["method"], raw["num_speculative_tokens"])
