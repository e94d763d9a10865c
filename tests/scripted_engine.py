"""A scripted stand-in for the Engine, for HTTP tests of the text layer (chat encoding, output parsing, SSE).

It compiles no model: each submitted request is answered with the next scripted list of token ids, one token per
TokenEvent through the real RequestHandle, then EOS (or "length" at max_tokens). It records the prompts it was
given, so a test can check what the server rendered. Only what the server reads of an Engine is here; the
engine's fake runner can replace this file wholesale.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from jaxserve.engine import RequestHandle, TokenEvent
from jaxserve.scheduler import SamplingParams
from jaxserve.server.metrics import ENGINE_COUNTERS, ENGINE_GAUGES


class ScriptedEngine:
    def __init__(self, vocab_size: int, eos_id: int, max_model_len: int = 4096, page_size: int = 16):
        self.config = SimpleNamespace(log_stats_interval=0)
        self.model_config = SimpleNamespace(vocab_size=vocab_size, eos_token_id=eos_id)
        self.geometry = SimpleNamespace(num_pages=max_model_len // page_size, page_size=page_size)
        self.max_model_len = max_model_len
        self.is_running, self.is_draining = True, False
        self.scripts: deque[list[int]] = deque()
        self.prompts: list[list[int]] = []
        self.aborted: list[str] = []

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> RequestHandle:
        if not self.scripts:
            raise AssertionError("the test scripted no answer for this request")
        self.prompts.append(list(prompt_ids))
        handle = RequestHandle(request_id, list(prompt_ids))
        tokens = self.scripts.popleft()[:sampling.max_tokens]
        for token in tokens[:-1]:
            handle._push(TokenEvent((token,)))
        if len(tokens) < sampling.max_tokens:  # room left: the model ends its turn
            handle._push(TokenEvent((*tokens[-1:], self.model_config.eos_token_id), finish_reason="stop"))
        else:
            handle._push(TokenEvent(tuple(tokens[-1:]), finish_reason="length"))
        return handle

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self.aborted.append(request_id)

    def stats(self) -> dict:
        return {key: 0 for key in (*ENGINE_GAUGES, *ENGINE_COUNTERS)}
