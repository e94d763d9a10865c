"""--speculative-config: vLLM's JSON, parsed and checked."""

from __future__ import annotations

import json
from dataclasses import dataclass

from jaxserve.config.flags import ConfigError

SPECULATIVE_METHODS = ("mtp", "dspark")
# The most drafts a step: MTP runs its block once a draft; a DSpark block drafts them all in one forward (the
# release trains blocks of dspark_block_size = 5; vLLM's recipe asks for 7; some ports refuse fewer than 5, jaxserve
# takes any count, a shorter block drafting fewer).
MAX_SPECULATIVE_TOKENS = {"mtp": 3, "dspark": 8}


@dataclass(frozen=True)
class SpeculativeConfig:
    """--speculative-config (vLLM's JSON): draft `num_speculative_tokens` tokens a step with the model's MTP block
    ("mtp") or the DSpark drafter of V4 0731 / 0813 ("dspark") and verify them in one forward
    (jaxserve.runner.speculative)."""

    method: str
    num_speculative_tokens: int

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_config.method={self.method!r}: jaxserve drafts with the checkpoint's own drafter "
                f"(its MTP block, or the DSpark drafter of V4 0731 / 0813); use one of {SPECULATIVE_METHODS}"
            )
        k, most = self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS[self.method]
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= most:
            raise ConfigError(
                f"speculative_config.num_speculative_tokens={k!r}: must be an integer in 1..{most} for method "
                f"{self.method!r}"
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
