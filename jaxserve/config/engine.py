"""EngineConfig: every engine knob, one field per CLI flag, and the choices and help texts of those flags."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxserve.config.flags import ConfigError, check_memory_fraction, flag, parse_bytes, parse_fraction
from jaxserve.config.model import QUANTIZATION_MODES, SUPPORTED_DTYPES
from jaxserve.config.registry import Registry
from jaxserve.config.speculative import SpeculativeConfig, parse_speculative_config
from jaxserve.kernels.table import KERNEL_CHOICES, check_choice

LOG_LEVELS = ("debug", "info", "warning", "error")
DISAGGREGATION_MODES = ("null", "prefill", "decode")  # --disaggregation-mode, SGLang's words

# --scheduling-policy: the order waiting requests are admitted in; each order registers itself in
# jaxserve.scheduler.queue_order.
SCHEDULING_POLICIES: Registry = Registry("--scheduling-policy", "jaxserve.scheduler.queue_order")
# The step policies a flag turns on (--decode-interleave-every, --max-decode-stall-ms, ...), by name; each declares its
# option, an EngineConfig.step_policies key (jaxserve.scheduler.policy).
STEP_POLICIES: Registry = Registry("step policy", "jaxserve.scheduler.policies")


def step_policy_options() -> dict[str, Any]:
    """Each registered step policy's class by its option."""
    return {STEP_POLICIES[name].option: STEP_POLICIES[name] for name in STEP_POLICIES}


# --kv-cache-dtype (as vLLM's): how the window rings, compressed entries and indexer keys are stored; `auto` is the
# model's dtype, `fp8` e4m3 codes with block scales (jaxserve.model.cache).
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8")


def check_kv_cache_dtype(value: str) -> None:
    if value not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype={value!r}: must be one of {KV_CACHE_DTYPES}")


ENGRAM_PLACEMENTS = ("device", "host")
COMPILE_CACHE_ENV = "JAXSERVE_COMPILE_CACHE"  # a folder, or "" to switch the persistent cache off
DEFAULT_COMPILE_CACHE = Path.home() / ".cache" / "jaxserve" / "xla"

MIXED_HELP = (
    "Put one token of every running request into each prefill step (a mixed step), the chunk shortened by that many "
    "tokens so the step costs what a pure chunk does: running requests advance every step, so their longest wait is "
    "about one step. Default: on, unless a step policy is set (--decode-interleave-every, --max-decode-stall-ms: "
    "those keep their own semantics over pure prefill steps; add --mixed-batches to combine). With "
    "--speculative-config the decode rows are verify rows (drafts and all). --no-mixed-batches without a step policy: "
    "prefill-first"
)


@dataclass(frozen=True)
class EngineConfig:
    """Every engine knob, one field per CLI flag, each declared in its field's metadata (`flag`); the HTTP server's
    are jaxserve.server.config's ServerConfig."""

    model: str | None = field(
        default=None,
        metadata=flag(
            str,
            "checkpoint folder (safetensors, or an orbax conversion); default: the embedded tiny DeepSeek-V4",
            metavar="PATH",
        ),
    )
    dtype: str = field(default="bfloat16", metadata=flag(str, "weights and activations", choices=SUPPORTED_DTYPES))
    quantization: str = field(
        default="auto",
        metadata=flag(
            str,
            "auto: keep the weights as the checkpoint ships them (DeepSeek's FP8 projections and FP4 experts stay FP8 "
            "/ FP4 on the devices, with their block scales, and are decoded inside each matmul); none: dequantize them"
            " to --dtype at load",
            choices=QUANTIZATION_MODES,
        ),
    )
    engram_placement: str = field(
        default="device",
        metadata=flag(
            str,
            "where DeepSeek-V4.1's Engram tables live (about 100 GB each in the release): device: split over the "
            "devices' memory like the vocabulary; host: in the host's pinned memory, each step gathering the rows its "
            "tokens hash to there and copying only those to the devices. Ignored by models without an Engram",
            choices=ENGRAM_PLACEMENTS,
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=flag(
            str,
            "how the KV cache stores the window and compressed entries: auto: --dtype; fp8: e4m3 with a power-of-two "
            "scale per 64 dims, the RoPE dims in bfloat16, indexer keys e4m3 with a float32 scale each (about 0.56x "
            "bfloat16's bytes per token)",
            choices=KV_CACHE_DTYPES,
        ),
    )
    kernels: str = field(
        default="auto",
        metadata=flag(
            str,
            "which implementation runs the kernel-worthy operations (grouped expert matmul, FP8 block-scaled matmul, "
            "sparse attention): reference: the pure-JAX references; pallas: the Pallas kernels (interpreted on CPU: "
            "for tests); auto: Pallas where it compiles for the devices (GPUs), the references elsewhere",
            choices=KERNEL_CHOICES,
        ),
    )
    batch_invariant: bool = field(
        default=False,
        metadata=flag(
            bool,
            "a request's tokens and logprobs do not depend on its batch (the other requests, chunk sizes, mixed "
            "steps, a prefix-cache hit): every row-wise computation of a step runs in fixed tiles of rows and every "
            "query attends to its keys by itself, in one order (same model, layout, build and flags; see the README "
            "for what it costs and covers). DeepSeek-V4 without speculative decoding",
        ),
    )
    device_memory: int | None = field(
        default=None,
        metadata=flag(
            parse_bytes,
            "memory of one device (80GiB, 141GB, 24e9) to check the model against before loading it, of which the "
            "--gpu-memory-utilization share is usable (default: what the device reports; none on CPU: no check)",
            metavar="BYTES",
        ),
    )
    gpu_memory_utilization: float | None = field(
        default=None,
        metadata=flag(
            parse_fraction,
            "the share of each device's memory, in (0, 1], this process may use for weights, step temporaries and the "
            "KV cache (as vLLM's): JAX's GPU allocator is given it before it starts, and the fit check counts it of "
            "--device-memory (default: $XLA_CLIENT_MEM_FRACTION, or its older name $XLA_PYTHON_CLIENT_MEM_FRACTION, "
            "else JAX's 0.75)",
            metavar="FRACTION",
        ),
    )
    seed: int = field(
        default=0, metadata=flag(int, "base of the per-request sampling seeds of requests that bring none")
    )
    tensor_parallel_size: int = field(
        default=1, metadata=flag(int, "devices that split attention heads and the vocabulary")
    )
    expert_parallel_size: int = field(
        default=1, metadata=flag(int, "devices that split the routed experts (with the tensor axis)")
    )
    # Defaults sized so the embedded default starts quickly on a small CPU: every step shape the buckets imply is
    # compiled at start (2 x 3 prefill, 4 decode and 2 x 2 mixed shapes).
    max_num_seqs: int = field(
        default=8, metadata=flag(int, "requests running at once (KV slots), also the largest decode batch")
    )
    max_model_len: int | None = field(
        default=None,
        metadata=flag(int, "prompt + completion tokens of one request (default: the model's, at most 16384)"),
    )
    chunked_prefill_size: int = field(default=256, metadata=flag(int, "prompt tokens in one prefill step"))
    max_prefill_rows: int = field(default=2, metadata=flag(int, "prompts in one prefill step"))
    num_kv_pages: int | None = field(
        default=None,
        metadata=flag(int, "KV cache pages (default: enough for --max-num-seqs requests of --max-model-len)"),
    )
    page_size: int = field(
        default=128, metadata=flag(int, "tokens per KV page; a multiple of every compress rate of the model")
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=flag(
            bool,
            "share the KV pages of prompts that start alike: a request whose prompt begins with pages already in the "
            "cache (and a snapshot of the sequence state where they end) prefills only the rest (as vLLM's)",
        ),
    )
    prefix_cache_snapshots: int | None = field(
        default=None,
        metadata=flag(
            int,
            "sequence-state snapshots the prefix cache keeps (the window ring and compressor state where a cached "
            "prefix ends, what a hit starts from; each costs one sequence's fixed state; default: --max-num-seqs)",
        ),
    )
    max_queued_requests: int = field(
        default=256, metadata=flag(int, "requests waiting for admission; more are refused (HTTP 429)")
    )
    # Each step policy's option and its value, e.g. {"decode_interleave_every": 8}: one flag each
    # (--decode-interleave-every), declared by the policy (jaxserve.scheduler.policies); unset, 0 or less: off.
    step_policies: Mapping[str, float] = field(default_factory=dict, hash=False)
    mixed_batches: bool | None = field(default=None, metadata=flag(bool, MIXED_HELP))
    scheduling_policy: str = field(
        default="fcfs",
        metadata=flag(
            str,
            "the order waiting requests are admitted in, one of %(choices)s (each registered in "
            "jaxserve.scheduler.queue_order): fcfs, first come, first served; priority, by each request's `priority` "
            "field, lower first, first come, first served among equals. Requests already running are never preempted",
            choices=SCHEDULING_POLICIES,
        ),
    )
    compilation_cache_dir: str | None = field(
        default=None,
        metadata=flag(
            str,
            f"XLA's persistent compilation cache (default: ${COMPILE_CACHE_ENV}, else {DEFAULT_COMPILE_CACHE}; an "
            f"empty "
            "string turns it off)",
            metavar="DIR",
        ),
    )
    async_scheduling: bool = field(
        default=True,
        metadata=flag(
            bool,
            "keep one step in flight: the host schedules and dispatches the next step while the device runs this one, "
            "and reads this one's tokens meanwhile (as vLLM's --async-scheduling)",
        ),
    )
    speculative_config: SpeculativeConfig | None = field(
        default=None,
        metadata=flag(
            parse_speculative_config,
            'speculative decoding, as vLLM\'s: \'{"method": "mtp", "num_speculative_tokens": K}\' (K in 1..3) drafts K '
            "tokens a step with the checkpoint's MTP block and verifies them in one forward of K+1 tokens a row "
            "(greedy rows keep exactly the model's tokens, sampled rows its distribution, by rejection sampling). "
            "Requests may not ask for logprobs, penalties, logit_bias, allowed_token_ids, min_tokens or a structured "
            "output",
            metavar="JSON",
        ),
    )
    disaggregation_mode: str = field(
        default="null",
        metadata=flag(
            str,
            "prefill/decode disaggregation (SGLang's flag): prefill: this server prefills prompts a decode server asks "
            "for and hands their state over; decode: every request's prompt is prefilled by a prefill server (the one "
            "`jaxserve router` names) and its state moved here, reusing the pages this server already holds; null: "
            "both here",
            choices=DISAGGREGATION_MODES,
        ),
    )
    disaggregation_transfer_host: str = field(
        default="127.0.0.1",
        metadata=flag(
            str, "the address this server's state transfers listen on (its peers must reach it)", metavar="HOST"
        ),
    )
    disaggregation_transfer_timeout: float = field(
        default=10.0,
        metadata=flag(
            float,
            "seconds a request's state may take to arrive once its prefill server offered it (a prefill server keeps "
            "an unclaimed offer as long): past it the request fails",
        ),
    )
    disaggregation_checksum: bool = field(
        default=False,
        metadata=flag(
            bool,
            "a decode server checks every transferred byte against the prefill server's checksums; a mismatch fails "
            "the request",
        ),
    )
    decode_log_interval: int = field(default=50, metadata=flag(int, "log one decode step in this many"))
    log_level: str = field(
        default="info",
        metadata=flag(
            str,
            "the log's threshold; below debug, the libraries' own INFO chatter (absl, orbax, JAX) is left out",
            choices=LOG_LEVELS,
        ),
    )

    def __post_init__(self):
        positive = (
            "max_num_seqs",
            "chunked_prefill_size",
            "max_prefill_rows",
            "page_size",
            "max_queued_requests",
            "tensor_parallel_size",
            "expert_parallel_size",
            "decode_log_interval",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r}: must be a positive integer")
        for name in ("max_model_len", "num_kv_pages", "device_memory", "prefix_cache_snapshots"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"{name}={value!r}: must be a positive integer")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}: must be one of {SUPPORTED_DTYPES}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ConfigError(f"quantization={self.quantization!r}: must be one of {QUANTIZATION_MODES}")
        if self.gpu_memory_utilization is not None:
            check_memory_fraction(self.gpu_memory_utilization, "gpu_memory_utilization")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level={self.log_level!r}: must be one of {LOG_LEVELS}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_choice(self.kernels)
        if self.batch_invariant and self.speculative_config is not None:
            raise ConfigError(
                "batch_invariant: speculative decoding is not batch-invariant yet (its drafter's block attends as a "
                "block); serve without --speculative-config, or without --batch-invariant"
            )
        if self.engram_placement not in ENGRAM_PLACEMENTS:
            raise ConfigError(f"engram_placement={self.engram_placement!r}: must be one of {ENGRAM_PLACEMENTS}")
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ConfigError(
                f"disaggregation_mode={self.disaggregation_mode!r}: must be one of {DISAGGREGATION_MODES}"
            )
        if self.disaggregation_mode != "null" and self.mixed_batches:
            raise ConfigError(
                f"mixed_batches: a server of --disaggregation-mode {self.disaggregation_mode} runs one kind of step "
                "only, so there is nothing to mix"
            )
        if not self.disaggregation_transfer_timeout > 0:
            raise ConfigError(
                f"disaggregation_transfer_timeout={self.disaggregation_transfer_timeout!r}: must be positive"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"scheduling_policy={self.scheduling_policy!r}: must be one of {SCHEDULING_POLICIES.names()}"
            )
        options = step_policy_options()
        for option, value in self.step_policies.items():
            if option not in options:
                raise ConfigError(
                    f"step_policies: {option!r} is no step policy's option; the options: {sorted(options)}"
                )
            number = (int,) if options[option].flag.type is int else (int, float)
            if value is not None and (isinstance(value, bool) or not isinstance(value, number)):
                raise ConfigError(f"{option}={value!r}: must be {'an integer' if number == (int,) else 'a number'}")

    @property
    def draft_tokens(self) -> int:
        """Tokens drafted a step (0: no speculative decoding)."""
        return 0 if self.speculative_config is None else self.speculative_config.num_speculative_tokens

    @property
    def drafter(self) -> str | None:
        """The drafter speculative decoding runs (SPECULATIVE_METHODS), None without it."""
        return None if self.speculative_config is None else self.speculative_config.method

    @property
    def overlapped(self) -> bool:
        """Whether a step is dispatched before the one before it returns (--async-scheduling); with drafting too, as
        the device keeps where each sequence is (jaxserve.runner.speculative)."""
        return self.async_scheduling

    @property
    def active_step_policies(self) -> dict[str, float]:
        """The step policies' options that turn theirs on (a positive value), in the registry's order."""
        return {
            option: value
            for option in step_policy_options()
            if (value := self.step_policies.get(option)) is not None and value > 0
        }

    @property
    def num_prefix_snapshots(self) -> int:
        """Snapshot rows of the sequence state the cache holds beside the live slots (0: no prefix caching)."""
        if not self.enable_prefix_caching:
            return 0
        return self.max_num_seqs if self.prefix_cache_snapshots is None else self.prefix_cache_snapshots

    @property
    def mixed_steps(self) -> bool:
        """Whether prefill steps carry decode rows: --mixed-batches as given, else on unless a step policy is on
        (each keeps its own semantics, over pure prefill steps)."""
        if self.disaggregation_mode != "null":  # a prefill server never decodes, a decode server never prefills
            return False
        if self.mixed_batches is not None:
            return self.mixed_batches
        return not self.active_step_policies
