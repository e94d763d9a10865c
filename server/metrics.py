"""Prometheus metrics under vLLM's names with a `jaxserve:` prefix and a `model_name` label.

Latency histograms are measured here, per request, from the server's arrival time (so time to first token
includes tokenization and queueing, as in vLLM); the queue time, the token counts of each finished request and the
tokens of each step are observed as the engine reports them (`engine.listeners`, on its thread); gauges, token and
step counters and finished requests by reason are the engine's own counters, read from `engine.stats()` at scrape
time (the logs read the same ones). Each app has
its own registry, so several apps can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.config import STEP_POLICIES
from jaxserve.engine import Engine, EngineStats
from jaxserve.request import FinishReason, Request

if TYPE_CHECKING:
    from jaxserve.server.disaggregation import TransferCounts

prometheus_client.disable_created_metrics()  # the `_created` series only add noise to every counter
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "jaxserve:"

# vLLM's buckets, so dashboards built for it read the same.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

# vLLM's buckets for tokens per engine step when it runs without CUDA graphs (jaxserve has none).
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's, for request_params_n
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value` (its max_model_len)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


# metric name -> (help, its value in an EngineStats); gauges then counters.
ENGINE_GAUGES: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "num_requests_running": ("Requests admitted and unfinished: prefilling or decoding.", lambda s: s.running),
    "num_requests_waiting": ("Requests waiting for admission.", lambda s: s.waiting),
    "kv_cache_usage_perc": ("Fraction of KV cache pages in use (0 to 1).", lambda s: s.kv_usage),
}
ENGINE_COUNTERS: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "prompt_tokens": ("Prompt tokens prefilled.", lambda s: s.prompt_tokens),
    "generation_tokens": ("Tokens generated.", lambda s: s.generation_tokens),
    "prefill_steps": ("Steps that prefilled (mixed steps included).", lambda s: s.steps.prefill),
    "decode_steps": ("Decode-only steps.", lambda s: s.steps.decode),
    "mixed_steps": ("Prefill steps that also advanced every decoding request by one token.", lambda s: s.steps.mixed),
    "forced_decode_steps": ("Decode steps a policy put ahead of waiting prefill work.", lambda s: s.steps.forced_total),
    "prefix_cache_queries": (
        "Prompt tokens looked up in the prefix cache.",
        lambda s: s.prefix_cache.queries,
    ),
    "prefix_cache_hits": ("Prompt tokens found in the prefix cache (never prefilled).", lambda s: s.prefix_cache.hits),
    "num_preemptions": (
        "Requests preempted: always 0, jaxserve never preempts (admission reserves a request's KV pages for its "
        "prompt and max_tokens).",
        lambda s: 0,
    ),
}


def _step_policy_counters() -> dict[str, tuple[str, Callable[[EngineStats], float]]]:
    """Each step policy's forced decodes (interleave_decode_steps, stall_decode_steps), from the registry."""
    return {f"{name}_decode_steps": (STEP_POLICIES[name].metric_help, _forced_by(name)) for name in STEP_POLICIES}


def _forced_by(name: str) -> Callable[[EngineStats], float]:
    return lambda stats: stats.steps.forced[name]


class _EngineCollector:
    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.stats()
        counters = {**ENGINE_COUNTERS, **_step_policy_counters()}
        for families, kind in ((ENGINE_GAUGES, GaugeMetricFamily), (counters, CounterMetricFamily)):
            for name, (doc, value) in families.items():
                family = kind(PREFIX + name, doc, labels=["model_name"])
                family.add_metric([self.model_name], value(stats))
                yield family
        finished = CounterMetricFamily(
            PREFIX + "request_success", "Finished requests, by finish reason.", labels=["model_name", "finished_reason"]
        )
        for reason, count in sorted(stats.finished.items()):
            finished.add_metric([self.model_name, reason], count)
        yield finished
        # vLLM's info gauge of its CacheConfig (a KV page is its block), always 1.
        geometry = self.engine.geometry
        info = {
            "block_size": geometry.page_size,
            "num_gpu_blocks": geometry.num_pages,
            "cache_dtype": geometry.kv_cache_dtype,
            "num_cpu_blocks": None,  # no CPU swap space
            "enable_prefix_caching": self.engine.pages.enabled,
        }
        yield from _draft_families(stats, self.model_name)
        cache = GaugeMetricFamily(PREFIX + "cache_config_info", "The KV cache's configuration.", labels=list(info))
        cache.add_metric([str(value) for value in info.values()], 1)
        yield cache


def _draft_families(stats: EngineStats, model_name: str):
    """Speculative decoding's counters (vLLM's spec_decode_* names; zero without --speculative-config)."""
    drafts = stats.drafts
    for name, doc, value in (
        ("spec_decode_num_drafts", "Verify rows that carried drafts.", drafts.drafts),
        ("spec_decode_num_draft_tokens", "Draft tokens proposed.", drafts.draft_tokens),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", drafts.accepted_tokens),
    ):
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([model_name], value)
        yield family
    per_position = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by their position in the row (0: the first draft).",
        labels=["model_name", "position"],
    )
    for position, count in enumerate(drafts.accepted_per_position):
        per_position.add_metric([model_name, str(position)], count)
    yield per_position


class PromptChoices:
    """The engine requests one prompt of an HTTP request fans out to (its n choices, or best_of candidates): vLLM's
    request_max_num_generation_tokens, the most tokens any of them generated, is observed when the last finishes."""

    def __init__(self, metrics: ServerMetrics, size: int):
        self._metrics = metrics
        self._left = size
        self._most = 0

    def finished(self, tokens: int) -> None:
        self._most = max(self._most, tokens)
        self._left -= 1
        if self._left == 0:
            self._metrics.max_generation_tokens.observe(self._most)


class RequestTimer:
    """One engine request's timing as its client sees it, fed by its Generation (see generation.Observer)."""

    def __init__(self, metrics: ServerMetrics, arrival: float, choices: PromptChoices):
        self._metrics = metrics
        self._arrival = arrival
        self._choices = choices
        self._last: float | None = None
        self._tokens = 0

    def on_tokens(self, count: int, now: float) -> None:
        if self._last is None:
            self._metrics.ttft.observe(now - self._arrival)
        else:
            self._metrics.itl.observe((now - self._last) / count)
        self._last = now
        self._tokens += count

    def on_finish(self, reason: FinishReason, now: float) -> None:
        self._metrics.e2e.observe(now - self._arrival)
        self._choices.finished(self._tokens)


class _TransferCollector:
    """A disaggregated server's transfers (jaxserve.server.disaggregation.TransferCounts)."""

    FAMILIES = (
        (
            "disaggregation_transfers",
            "Sequence states moved: offered here (prefill) or arrived here (decode).",
            "transfers",
        ),
        ("disaggregation_transfer_bytes", "Bytes of the states moved (page-bucket padding included).", "bytes"),
        (
            "disaggregation_transfer_failures",
            "States that did not arrive (decode side): the request failed.",
            "failures",
        ),
        (
            "disaggregation_prefill_wait_seconds",
            "Seconds waiting for prefill servers' answers (decode side).",
            "prefill_wait_s",
        ),
        (
            "disaggregation_transfer_seconds",
            "Seconds from a prefill server's answer to its state here, checked.",
            "transfer_s",
        ),
    )

    def __init__(self, counts: TransferCounts, model_name: str):
        self.counts, self.model_name = counts, model_name

    def collect(self):
        for name, doc, attribute in self.FAMILIES:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], getattr(self.counts, attribute))
            yield family


class ServerMetrics:
    def __init__(self, engine: Engine, model_name: str, transfers: TransferCounts | None = None):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        if transfers is not None:
            self.registry.register(_TransferCollector(transfers, model_name))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(
                model_name
            )

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between consecutive tokens of a request.", ITL_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS)
        # Measured by the engine (engine.listeners), as vLLM's engine measures them.
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Time a request waited for admission: from its submission to the engine (after tokenization) until "
            "its KV pages and slot were reserved. Requests that finished before admission are not counted.",
            E2E_BUCKETS,
        )
        token_buckets = buckets_1_2_5(engine.max_model_len)
        self.prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of each finished request.", token_buckets
        )
        self.generation_tokens = histogram(
            "request_generation_tokens", "Tokens generated for each finished request.", token_buckets
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens per engine step (prefill and decode rows).", ITERATION_TOKENS_BUCKETS
        )
        # A finished request's phases, from the engine's record: admitted -> first token -> last token.
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "Time in the prefill phase: from admission to the first token.", E2E_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "Time in the decode phase: from the first token to the last.", E2E_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds", "Time running: from admission to the last token.", E2E_BUCKETS
        )
        self.request_tpot = histogram(
            "request_time_per_output_token_seconds",
            "Each request's decode time over its tokens after the first.",
            ITL_BUCKETS,
        )
        # What clients ask for.
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of each finished request.", token_buckets
        )
        self.params_n = histogram("request_params_n", "The n of each prompt a client sent.", N_BUCKETS)
        self.max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "The most tokens any choice (or best_of candidate) of a prompt generated, once all finished.",
            token_buckets,
        )
        self.registry.register(_EngineCollector(engine, model_name))
        engine.listeners.append(self)

    def on_step(self, num_tokens: int) -> None:  # engine thread
        self.iteration_tokens.observe(num_tokens)

    def on_finish(self, request: Request) -> None:  # engine thread
        self.prompt_tokens.observe(request.prompt_len)
        self.generation_tokens.observe(len(request.output_ids))
        if request.queue_time is not None:
            self.queue_time.observe(request.queue_time)
        self.params_max_tokens.observe(request.sampling.max_tokens)
        prefill, decode = request.prefill_time, request.decode_time
        if prefill is not None and decode is not None:
            self.prefill_time.observe(prefill)
            self.decode_time.observe(decode)
            self.inference_time.observe(prefill + decode)
            if len(request.output_ids) > 1:
                self.request_tpot.observe(decode / (len(request.output_ids) - 1))

    def prompt_choices(self, engine_requests: int) -> PromptChoices:
        """One prompt a client sent, served by `engine_requests` engine requests (its n choices, or best_of)."""
        return PromptChoices(self, engine_requests)

    def submitted(self, n: int, prompts: int) -> None:
        """An HTTP request's `prompts` prompts, `n` choices each, were all admitted."""
        for _ in range(prompts):
            self.params_n.observe(n)

    def timer(self, arrival: float, choices: PromptChoices) -> RequestTimer:
        return RequestTimer(self, arrival, choices)

    def exposition(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)
