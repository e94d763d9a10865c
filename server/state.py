"""What every route shares: the engine, the tokenizer, the served name, the metrics, and the admission checks
that come before a request reaches the engine (model name, availability, context length)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jaxserve.engine import Engine
from jaxserve.server.errors import APIError
from jaxserve.server.metrics import ServerMetrics


@dataclass
class ServerState:
    engine: Engine
    tokenizer: object  # jaxserve.tokenizer.Tokenizer or TokenIdOnly
    served_model_name: str
    model_path: str | None = None
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.metrics = ServerMetrics(self.engine, self.served_model_name)

    @property
    def context_limit(self) -> int:
        """Prompt + completion tokens one request may have: max_model_len, or less if the KV pool is smaller."""
        geometry = self.engine.geometry
        return min(self.engine.max_model_len, geometry.num_pages * geometry.page_size)

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    def unavailable_reason(self) -> str | None:
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
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def completion_budget(self, prompt_len: int, max_tokens: int | None, prompt_field: str) -> int:
        """max_tokens (None: the rest of the context) after the context-length check, in the wording clients
        match on ("This model's maximum context length is ...")."""
        limit = self.context_limit
        completion = max(limit - prompt_len, 1) if max_tokens is None else max_tokens
        if prompt_len + completion > limit:
            param, value = ("max_tokens", completion) if prompt_len < limit else (prompt_field, prompt_len)
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt_len + completion} tokens ({prompt_len} in the messages, {completion} in the "
                                "completion). Please reduce the length of the messages or completion. "
                                f"(parameter={param}, value={value})", param)
        return completion
