"""A request's sampling parameters and the values around them: frozen values that any layer may read (the runner
builds its sampling arrays from them), unlike the live record of jaxserve.request.record."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # grammar.py imports this module (InvalidRequest)
    from jaxserve.request.grammar import Constraint


# The most alternatives a request may ask for at each position (`logprobs` / `prompt_logprobs`): every step
# computes this many on the device when any row asks, whatever each row wants (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# The most (token, bias) pairs a row hands the sampler in a step (SamplingParams.logit_bias_at): every step carries
# this many per row to the device, used or not.
MAX_LOGIT_BIAS = 64
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's


class InvalidRequest(ValueError):
    """A request refused at the door; `param` names the request field at fault (the HTTP layer answers 400 with
    it), and the message starts with that field's name."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def listed(items: Sequence[object], most: int = 8) -> str:
    """'a, b, c' for an error naming every entry at fault, the first `most` of a long list ('..., and 12 more')."""
    shown = ", ".join(str(item) for item in items[:most])
    return shown if len(items) <= most else f"{shown}, and {len(items) - most} more"


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities under the model's raw distribution (the log-softmax of the float32 logits,
    before temperature, top-k or top-p): the token there, its own logprob, and the `k` most likely tokens at that
    position with theirs, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping; the one place their ranges are checked.

    `max_tokens=0` asks for the prompt only ("prefill only"): the request finishes with "length" when its prompt
    is in the cache, having generated nothing (what an evaluator sends for the prompt's logprobs).
    `logprobs=k`: each generated token comes with its logprob and the top k; `prompt_logprobs=k`: so does every
    prompt token after the first (None: not computed). `logit_bias`: (token id, bias) pairs added to those tokens'
    logits before sampling (OpenAI's; logprobs still describe the raw distribution). `min_tokens` (vLLM's): neither
    EOS, nor a stop token, nor a stop string ends the request before it has this many tokens; EOS and the stop
    token ids are not sampled until then. `constraint` (structured outputs): only tokens its grammar allows are
    sampled, and the request ends ("stop") once the grammar admits nothing more. vLLM's penalties act on the raw
    logits before the logit bias: `repetition_penalty` divides the positive logits (multiplies the negative ones)
    of every token in the prompt or the output so far, `frequency_penalty` subtracts itself once per time a token
    came out, `presence_penalty` once for any token that came out. `min_p` drops the tokens less likely than
    min_p times the most likely one (after temperature); `allowed_token_ids` (vLLM's) are the only tokens sampled.

    It also owns the rules its fields imply: when a token ends the request (`stop_reason`, `may_stop`) and what the
    sampler adds to the logits (`logit_bias_at`). `eos_token_ids` is the model's, filled in by the engine at
    submission."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 means off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    constraint: Constraint | None = None  # structured outputs: what the text must match (grammar.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 means off
    min_p: float = 0.0
    allowed_token_ids: tuple[int, ...] | None = None  # None: every token

    def __post_init__(self):
        # Accept any iterable (e.g. a JSON list, a dict of biases) but store tuples, so the params stay hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        low, high = LOGIT_BIAS_RANGE
        checks = {
            "max_tokens": (self.max_tokens >= 0, "must be >= 0"),
            "temperature": (self.temperature >= 0, "must be >= 0"),
            "top_p": (0 < self.top_p <= 1, "must be in (0, 1]"),
            "top_k": (self.top_k == -1 or self.top_k >= 1, "must be -1 (off) or >= 1"),
            "seed": (self.seed is None or 0 <= self.seed < 2**32, "must be in [0, 2**32)"),
            "logprobs": (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            "prompt_logprobs": (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            "min_tokens": (0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            # vLLM's ranges
            "presence_penalty": (-2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            "frequency_penalty": (-2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            "repetition_penalty": (0 < self.repetition_penalty < float("inf"), "must be greater than zero"),
            "min_p": (0 <= self.min_p <= 1, "must be in [0, 1]"),
            "allowed_token_ids": (self.allowed_token_ids != (), "must not be empty"),
        }
        for name, (ok, rule) in checks.items():
            if not ok:
                raise InvalidRequest(name, f"{name}={getattr(self, name)!r}: {rule}")
        if out_of_range := [f"{token}: {bias:g}" for token, bias in self.logit_bias if not low <= bias <= high]:
            raise InvalidRequest(
                "logit_bias", f"logit_bias: biases must be in [{low:g}, {high:g}], got {listed(out_of_range)}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(
                "logit_bias", f"logit_bias: {len(self.logit_bias)} tokens, at most {MAX_LOGIT_BIAS} are allowed"
            )
        if len(self.logit_bias_at(0)) > MAX_LOGIT_BIAS:
            raise InvalidRequest(
                "min_tokens",
                f"min_tokens={self.min_tokens}: holds back the EOS and stop token ids, "
                f"which with logit_bias make more than {MAX_LOGIT_BIAS} tokens",
            )

    def drafting_conflict(self) -> str | None:
        """The first field set that speculative decoding cannot honour (its verify step samples each position with
        temperature, min-p, top-k and top-p only, and returns no logprobs); None when there is none."""
        conflicts = {
            "logprobs": self.logprobs is not None,
            "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "min_tokens": self.min_tokens > 0,
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "repetition_penalty": self.repetition_penalty != 1,
            "response_format": self.constraint is not None,
        }
        return next((name for name, conflict in conflicts.items() if conflict), None)

    @property
    def penalized(self) -> bool:
        """Whether the sampler applies any of the penalties (they need the request's token counts)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def may_stop(self, num_generated: int) -> bool:
        """Whether EOS, a stop token or a stop string may end the request once it has `num_generated` tokens (the
        engine asks for tokens, the text side for stop strings; max_tokens always ends it)."""
        return num_generated >= self.min_tokens

    def stop_reason(
        self, token: int, num_generated: int, complete: bool = False
    ) -> tuple[FinishReason | None, int | None]:
        """(finish reason, stop token) once `token` made `num_generated` output tokens, or (None, None) to go on. EOS
        is reported without a stop token, as vLLM does. `complete`: the structured output is complete, so nothing may
        follow: a stop whatever min_tokens, and like EOS a stop on max_tokens' last token too."""
        if self.may_stop(num_generated):
            if not self.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP, None
            if token in self.stop_token_ids:
                return FinishReason.STOP, token
        if complete:
            return FinishReason.STOP, None
        if num_generated >= self.max_tokens:  # admission kept prompt + max_tokens within the context
            return FinishReason.LENGTH, None
        return None, None

    def logit_bias_at(self, num_generated: int) -> tuple[tuple[int, float], ...]:
        """What the sampler adds to the logits of the token sampled after `num_generated` output tokens: the request's
        logit_bias, and until min_tokens are out, -inf on the EOS ids (unless ignore_eos) and the stop token ids."""
        if num_generated >= self.min_tokens:
            return self.logit_bias
        held = set(self.stop_token_ids) | (set() if self.ignore_eos else set(self.eos_token_ids))
        kept = tuple((token, bias) for token, bias in self.logit_bias if token not in held)
        return kept + tuple((token, float("-inf")) for token in sorted(held))


class FinishReason(enum.StrEnum):
    """Why a request ended: the words OpenAI's and vLLM's APIs use (a str, so it is written into JSON as is)."""

    STOP = "stop"  # EOS, a stop token, a stop string, or a structured output complete
    LENGTH = "length"  # max_tokens (or a prefill-only request's prompt done)
    ABORT = "abort"  # the client went away or asked
    ERROR = "error"  # a step failed, or the engine stopped
