"""What every route shares: the engine, the tokenizer, the served name, the metrics, and the checks that come
before a request reaches the engine (model name, availability); the engine itself admits or refuses it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jaxserve.engine import Engine
from jaxserve.server.disaggregation import Disaggregation
from jaxserve.server.errors import APIError
from jaxserve.server.metrics import ServerMetrics
from jaxserve.text.tokenizer import TokenIdOnly, Tokenizer


@dataclass
class ServerState:
    engine: Engine
    tokenizer: Tokenizer | TokenIdOnly
    served_model_name: str
    model_path: str | None = None
    api_key: str | None = None
    disaggregation: Disaggregation | None = None  # a prefill or decode server's side of disaggregated serving
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        counts = None if self.disaggregation is None else self.disaggregation.counts
        self.metrics = ServerMetrics(self.engine, self.served_model_name, counts)

    @property
    def context_limit(self) -> int:
        return self.engine.context_limit

    def unavailable_reason(self) -> str | None:
        if self.engine.failure is not None:
            return f"The engine stopped: {self.engine.failure}"
        if self.engine.is_draining:
            return "The server is shutting down"
        if not self.engine.is_running:
            return "Loading model"
        return None

    def check_available(self) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise APIError(503, reason)

    def check_model(self, name: str | None) -> None:
        # No name, or an empty one, is the served model (vLLM serves both as its default model).
        if name and name != self.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def default_max_tokens(self, prompt_len: int) -> int:
        """max_tokens when a chat request sends none: the rest of the context (the engine refuses a prompt that
        leaves none)."""
        return max(self.context_limit - prompt_len, 1)
