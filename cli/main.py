"""The `jaxserve` command: `serve` (the default: plain `jaxserve` is `jaxserve serve`), `generate`, `convert`.

Every flag fills one field of EngineConfig (the engine) or of ServerConfig (the HTTP server, `serve` only), is
named as in vLLM/SGLang and has the field's default; as with vLLM, `jaxserve serve MODEL` is `--model MODEL` and
--trust-remote-code is accepted (it changes nothing). `python -m jaxserve` is the same command. `serve` binds its
port first (a taken port is an error at once), loads the weights, starts answering HTTP (503 until ready), compiles
the step shapes that serve one request at a time, prints one stable line, `jaxserve ready on http://HOST:PORT`, that
scripts can wait for, and compiles the others on a thread of their own while serving.

Exit status: 0 after a clean shutdown (SIGTERM or Ctrl-C once serving: drain, then stop); 1 when serving fails or
start-up is interrupted; 2 for bad flags, configs or checkpoints. Never a signal's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import gc
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any, NoReturn

import jax

from jaxserve.checkpoints.load import LoadedModel, load_model, model_config
from jaxserve.checkpoints.orbax_io import convert_checkpoint
from jaxserve.cli.interrupts import Interrupted, Interrupts
from jaxserve.config import (
    COMPILE_CACHE_ENV,
    DEFAULT_COMPILE_CACHE,
    QUANTIZATION_MODES,
    SUPPORTED_DTYPES,
    ConfigError,
    EngineConfig,
    Flag,
    GroupConfig,
    ModelConfig,
    step_policy_options,
)
from jaxserve.engine import Engine
from jaxserve.model.cache import cache_nbytes, storage_dtype
from jaxserve.model.sharding import make_mesh, vocab_padding_line
from jaxserve.request import SamplingParams
from jaxserve.runner import ModelRunner, build_runner
from jaxserve.runner.group import CompiledEverywhere, GroupLost, ProcessGroup, join
from jaxserve.runner.mirror import CallLog, Follower
from jaxserve.runner.plan import (
    Plan,
    StepCompileError,
    give_the_allocator,
    make_plan,
    memory_share,
    node_layout,
    plan_devices,
    prepare_for_target,
    usable_memory,
)
from jaxserve.runner.targets import TARGETS, TargetError, target_devices, tune_xla_cpu
from jaxserve.runner.targets import target as gpu_target
from jaxserve.server.config import DEFAULT_SERVED_NAME, ServerConfig
from jaxserve.text.generation import Generation

log = logging.getLogger("jaxserve.cli")

EXIT_FAILED = 1
EXIT_USAGE = 2
DEFAULT_METAVARS: dict[Callable, str] = {int: "N", float: "SECONDS"}
# Libraries that log every step of their own work at INFO (orbax: ~60 absl lines per checkpoint restore; JAX: every
# backend it probes and does not find, `Unable to initialize backend 'tpu'`): WARNING and up only, unless the log
# level is debug. orbax logs through absl's logger.
CHATTY_LIBRARIES = ("absl", "orbax", "jax")


def config_flags(config: type) -> list[tuple[str, Any, Flag]]:
    """(field name, default, flag) of every field of `config` (EngineConfig or ServerConfig) that declares a flag."""
    return [(f.name, f.default, f.metadata["flag"]) for f in dataclasses.fields(config) if "flag" in f.metadata]


def flag_value(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` with our ConfigError turned into argparse's error, so the message (exit 2) says the flag and why;
    other errors keep argparse's wording (`invalid int value`: wraps keeps the name it quotes)."""

    @functools.wraps(parse)
    def parsed(text: str) -> Any:
        try:
            return parse(text)
        except ConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parsed


class TrustRemoteCode(argparse.Action):
    """vLLM's --trust-remote-code, accepted so vLLM command lines run unchanged: jaxserve reads a checkpoint's JSON
    and tensors only and never runs code from it, so there is nothing to trust; one line says so. It sets nothing."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(
            "jaxserve: --trust-remote-code accepted; it changes nothing: jaxserve never runs code from a checkpoint",
            file=sys.stderr,
        )


def add_flags(parser: argparse.ArgumentParser, server: bool) -> None:
    """The flags of EngineConfig, and with `server` those of ServerConfig and GroupConfig too; and vLLM's
    --trust-remote-code."""
    parser.add_argument(
        "--trust-remote-code",
        action=TrustRemoteCode,
        help="accepted, as vLLM's; jaxserve never runs code from a checkpoint, so it changes nothing",
    )
    for config in (EngineConfig, ServerConfig, GroupConfig) if server else (EngineConfig,):
        for field, default, flag in config_flags(config):
            _add_flag(parser, field, default, flag)
        if config is EngineConfig:  # each step policy's option (EngineConfig.step_policies), declared by the policy
            for option, policy in step_policy_options().items():
                _add_flag(parser, option, None, policy.flag)


def _add_flag(parser: argparse.ArgumentParser, field: str, default: Any, flag: Flag) -> None:
    """`--field-name`, parsed into `field`."""
    name = "--" + field.replace("_", "-")
    if flag.type is bool:
        parser.add_argument(
            name,
            dest=field,
            action=argparse.BooleanOptionalAction,
            default=default,
            help=flag.help + ("" if default is None else " (default: %(default)s)"),
        )
        return
    metavar = None if flag.choices else flag.metavar or DEFAULT_METAVARS[flag.type]
    parser.add_argument(
        name,
        dest=field,
        type=flag_value(flag.type),
        default=default,
        choices=flag.choices,
        metavar=metavar,
        help=flag.help + (" (default: %(default)s)" if default is not None else ""),
    )


def filled(config: type, args: argparse.Namespace, **fields: Any):
    """The `config` (EngineConfig or ServerConfig) the parsed flags describe, and `fields`; fields without a flag in
    this command keep their default."""
    flagged = {field: getattr(args, field) for field, _, _ in config_flags(config) if hasattr(args, field)}
    return config(**flagged, **fields)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    options = {option: getattr(args, option, None) for option in step_policy_options()}
    return filled(EngineConfig, args, step_policies={option: v for option, v in options.items() if v is not None})


def server_config(args: argparse.Namespace) -> ServerConfig:
    return filled(ServerConfig, args)


def device_memory(cfg: EngineConfig) -> int | None:
    """Usable bytes per device: JAX's share of --device-memory, or the smallest memory limit the devices' allocators
    report (that share already taken; CPUs report none)."""
    if cfg.device_memory is not None:
        return usable_memory(cfg.device_memory, cfg.gpu_memory_utilization)
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in jax.local_devices()]
    known = [limit for limit in limits if limit]
    return min(known) if limits and len(known) == len(limits) else None


def check_fit(cfg: EngineConfig, model_cfg: ModelConfig, mesh) -> None:
    """Refuse, before loading anything, a model that will not fit the devices (the plan's reason)."""
    memory = device_memory(cfg)
    if memory is None:
        log.info("devices report no memory limit and --device-memory is unset: not checking that the model fits")
        return
    plan = make_plan(model_cfg, cfg, mesh, memory)
    if not plan.fits:
        raise ValueError(
            f"the model does not fit {mesh.size} device(s) of {memory / 1e9:.1f} GB: {plan.reason} "
            "(see `jaxserve plan`)"
        )
    log.info("fit check: %s", plan.reason)


def load_runner(
    cfg: EngineConfig, show_progress: bool = False, skip_tokenizer: bool = False
) -> tuple[ModelRunner, LoadedModel]:
    """Check the model fits, load the checkpoint onto the mesh (this process's shards of it) and build its runner."""
    mesh = make_mesh(cfg.tensor_parallel_size, cfg.expert_parallel_size)
    check_fit(cfg, model_config(cfg.model, cfg.dtype, cfg.quantization, cfg.drafter, cfg.engram_placement), mesh)
    loaded = load_model(
        cfg.model,
        mesh,
        cfg.dtype,
        show_progress=show_progress,
        skip_tokenizer=skip_tokenizer,
        quantization=cfg.quantization,
        drafter=cfg.drafter,
        engram_placement=cfg.engram_placement,
    )
    return build_runner(cfg, loaded.config, loaded.weights, mesh), loaded


def build_engine(cfg: EngineConfig, show_progress: bool = False) -> tuple[Engine, LoadedModel]:
    """Check the model fits, load the checkpoint onto the mesh and make the engine (not started: start() compiles
    the step shapes)."""
    runner, loaded = load_runner(cfg, show_progress)
    tokenizer = loaded.tokenizer
    grammars = tokenizer.grammar_compiler(loaded.config.vocab_size)
    return Engine(cfg, loaded.config, runner, tokenizer.eos_ids, grammars), loaded


# ---- start-up ------------------------------------------------------------------------------------------------------


def configure_logging(level_name: str) -> None:
    """The process's log at `level_name` (--log-level), the chatty libraries at WARNING unless that is debug."""
    level = logging.getLevelNamesMapping()[level_name.upper()]
    # force: a library imported before this (absl, say) may already have given the root logger a bare handler.
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    for name in CHATTY_LIBRARIES:
        logging.getLogger(name).setLevel(level if level <= logging.DEBUG else max(level, logging.WARNING))


def _prepare(cfg: EngineConfig, group: ProcessGroup | None) -> None:
    """The log, JAX's allocator share and compilation cache, then one line on the devices (which starts JAX's
    backend)."""
    configure_logging(cfg.log_level)
    give_the_allocator(cfg.gpu_memory_utilization)  # before the first jax.devices() below starts the backend
    cache = cfg.compilation_cache_dir
    if cache is None:
        cache = os.environ.get(COMPILE_CACHE_ENV, str(DEFAULT_COMPILE_CACHE))
    if cache:
        # Every step shape is compiled at start; the persistent cache makes the next start with the same flags fast.
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    where = (
        ""
        if group is None
        else f" (process {group.process_id} of {group.num_processes}, {jax.local_device_count()} here)"
    )
    print(
        f"jaxserve {version('jaxserve')} on {len(jax.devices())} {jax.devices()[0].platform} device(s){where}; XLA "
        f"compilation cache: {cache or 'off'}",
        flush=True,
    )


def _setup(cfg: EngineConfig, group: ProcessGroup | None = None) -> tuple[Engine, LoadedModel]:
    _prepare(cfg, group)
    print(f"loading weights from {cfg.model or 'the embedded default checkpoint'}", flush=True)
    started = time.perf_counter()
    engine, loaded = build_engine(cfg, show_progress=True)
    print(f"loaded weights in {time.perf_counter() - started:.1f} s", flush=True)
    runner = engine.runner
    assert isinstance(runner, ModelRunner)  # build_engine's: the Engine sees it only as a StepRunner
    if (padding := vocab_padding_line(loaded.config, runner.mesh)) is not None:
        print(padding, flush=True)
    print(capacity_line(engine), flush=True)
    print(prefix_cache_line(engine), flush=True)
    print(f"kernels ({cfg.kernels}): {runner.kernels.describe()}", flush=True)
    return engine, loaded


def capacity_line(engine: Engine) -> str:
    geometry = engine.geometry
    per_request = geometry.num_pages // geometry.max_pages_per_seq
    concurrency = min(per_request, geometry.num_slots)
    stored = storage_dtype(geometry.kv_cache_dtype, engine.model_config)
    return (
        f"KV cache ({stored}): {geometry.num_pages} pages x {geometry.page_size} tokens = "
        f"{geometry.num_pages * geometry.page_size} tokens; max concurrency at max_model_len "
        f"({engine.max_model_len} tokens): {concurrency} requests"
    )


def prefix_cache_line(engine: Engine) -> str:
    geometry = engine.geometry
    if not engine.pages.enabled:
        return "prefix caching: off"
    per_row = cache_nbytes(engine.model_config, geometry)["per_slot_fixed"] / geometry.state_rows
    return (
        f"prefix caching: on, {geometry.num_snapshots} snapshots of the sequence state "
        f"({geometry.num_snapshots * per_row / 2**20:.1f} MiB) for hits to start from"
    )


def _start(engine: Engine, shapes, interrupts: Interrupts | None = None) -> None:
    """Compile `shapes` (what serving needs first) on this thread and start the engine loop; a signal stops it
    between two compiles (Interrupted)."""
    print(f"compiling {len(shapes)} step shapes (rows x chunk buckets) to start", flush=True)
    started = time.perf_counter()
    engine.runner.warmup(shapes, show_progress=True, stop=interrupts and interrupts.requested.is_set)
    if interrupts is not None:
        interrupts.check()
    engine.start()
    print(f"compiled {len(shapes)} step shapes in {time.perf_counter() - started:.1f} s", flush=True)
    _freeze_heap()


def _compile_the_rest(engine: Engine, stop) -> None:
    """Compile every other step shape while serving (steps use a shape once it is compiled), until `stop()`."""
    buckets = engine.runner.buckets
    rest = len(buckets.shapes()) - len(buckets.first_shapes())
    if not rest:
        return
    print(
        f"compiling the other {rest} step shapes while serving (bigger batches and chunks once they are done)",
        flush=True,
    )
    started = time.perf_counter()
    engine.runner.warmup(show_progress=True, stop=stop)
    if not stop():
        print(
            f"compiled all {len(buckets.shapes())} step shapes ({rest} while serving, "
            f"{time.perf_counter() - started:.1f} s)",
            flush=True,
        )
        _freeze_heap()


class RestCompiles(threading.Thread):
    """_compile_the_rest on a daemon thread of its own. A compile in progress cannot be interrupted (one of the
    default's shapes took 49 s on 2 busy cores), so a shutdown must not wait for it: the main thread drains and the
    process ends without the interpreter's teardown (end_process), which could crash under an unfinished compile."""

    def __init__(self, engine: Engine, stop: Callable[[], bool]):
        super().__init__(name="jaxserve-compile", daemon=True)
        self.engine, self.stop = engine, stop
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            _compile_the_rest(self.engine, self.stop)
        except Exception as error:  # noqa: BLE001 - reported by the main thread, which ends the process
            self.error = error


def compile_failed(error: Exception) -> int:
    print(f"jaxserve: error: compiling the step shapes failed: {type(error).__name__}: {error}", file=sys.stderr)
    return EXIT_FAILED


def _freeze_heap() -> None:
    # Everything alive now (JAX, the executables, the weights' host objects) lives as long as the process. Freezing
    # it keeps the collector from walking it: a full collection of that heap took ~200 ms on 2 cores, a stall the
    # step loop would take in the middle of a stream.
    gc.collect()
    gc.freeze()


# ---- commands ------------------------------------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> NoReturn:
    cfg, server_cfg, group_cfg = engine_config(args), server_config(args), filled(GroupConfig, args)
    # Before anything starts JAX's backend (None: one process), and before our signal handlers: joining starts jax's
    # preemption notifier, which would otherwise take SIGTERM for itself.
    group = join(group_cfg)
    if group is not None and cfg.draft_tokens:
        print(
            "jaxserve: error: --speculative-config runs in one process; a group of processes replays plain steps only",
            file=sys.stderr,
            flush=True,
        )
        end_process(EXIT_FAILED)
    if group is not None and cfg.disaggregation_mode != "null":
        print(
            "jaxserve: error: --disaggregation-mode runs in one process (a group of processes does not replay a "
            "request's state transfer yet); give each role one process with all its devices",
            file=sys.stderr,
            flush=True,
        )
        end_process(EXIT_FAILED)
    with Interrupts() as interrupts:
        if group is not None and not group.leader:  # no port for the other processes: they answer nothing
            status = _follow(cfg, group, group_cfg, interrupts)
        else:
            status = _serve(cfg, server_cfg, interrupts, group, group_cfg)
    end_process(status)  # a step shape may still be compiling on its thread (RestCompiles)


def end_process(status: int) -> NoReturn:
    """Exit without the interpreter's teardown. A start-up that failed or was interrupted may have left an XLA
    compile unfinished (its exception unwound out of jax), and tearing jaxlib's objects down after that can crash
    the process (a segfault) after our last line. By now every thread of ours has stopped; only the output needs
    flushing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _serve(
    cfg: EngineConfig,
    server_cfg: ServerConfig,
    interrupts: Interrupts,
    group: ProcessGroup | None,
    group_cfg: GroupConfig,
) -> int:
    from jaxserve.server import create_app
    from jaxserve.server.disaggregation import Disaggregation
    from jaxserve.server.serving import BackgroundServer, ListenError, bind

    try:
        sock = bind(server_cfg.host, server_cfg.port)
    except ListenError as error:
        print(f"jaxserve: error: {error}", file=sys.stderr)
        return EXIT_FAILED
    http: BackgroundServer | None = None
    engine: Engine | None = None
    try:
        engine, loaded = _setup(cfg, group)
        if group is not None:
            lead(engine, group, group_cfg)
        interrupts.check()
        name = server_cfg.served_model_name or (Path(cfg.model).name if cfg.model else DEFAULT_SERVED_NAME)
        disaggregation = Disaggregation.for_runner(cfg, engine.runner)
        app = create_app(
            engine, loaded.tokenizer, name, server_cfg, model_path=str(loaded.path), disaggregation=disaggregation
        )
        http = BackgroundServer(app, sock)
        http.start()
        url = f"http://{server_cfg.host}:{http.address[1]}"
        print(f"listening on {url}: every route but /metrics answers 503 until ready", flush=True)
        try:  # start-up's compiles run on this thread: see cli/interrupts.py
            _start(engine, engine.runner.buckets.first_shapes(), interrupts)
        except Exception as error:  # noqa: BLE001 - one line, not XLA's traceback
            return compile_failed(error)
        interrupts.serving = True
        print(f"jaxserve ready on {url} (model={name})", flush=True)
        compiles = RestCompiles(engine, stop=interrupts.requested.is_set)
        compiles.start()
        while not interrupts.requested.wait(0.2):
            if http.stopped.is_set():
                print("jaxserve: error: the HTTP server stopped on its own", file=sys.stderr)
                return EXIT_FAILED
            if compiles.error is not None:
                return compile_failed(compiles.error)
            if engine.failure is not None:
                return group_failed(engine, group)
        log.info(
            "shutdown requested: draining, running requests get up to %.0f s to finish", server_cfg.shutdown_timeout
        )
        aborted = engine.drain(server_cfg.shutdown_timeout)
        if aborted:
            log.warning("shutdown timeout reached: aborted %d unfinished requests", aborted)
        return 0
    except Interrupted:
        return EXIT_FAILED  # its line is already printed
    finally:
        if http is not None:
            http.stop()
        else:
            sock.close()
        if engine is not None:
            engine.shutdown()
            if group is not None and engine.failure is None:
                stop_group(engine, group)


# ---- several processes (jaxserve.runner.group) ---------------------------------------------------------------------

# How long a lost group's requests get to send their error events before the process ends.
ERROR_EVENTS_GRACE_S = 0.5


def lead(engine: Engine, group: ProcessGroup, group_cfg: GroupConfig) -> None:
    """Process 0 of a group: every device call of its runner goes to the others (before any is made), a failed
    step fails the engine (the group's steps fail together), and a watch fails it when a process is lost."""
    runner = engine.runner
    assert isinstance(runner, ModelRunner)  # build_engine's
    runner.mirror = CallLog(group.channel)
    runner.compile_sync = CompiledEverywhere(group, group_cfg.distributed_timeout)
    engine.fatal_step_errors = True
    group.watch(engine.fail, engine.waiting_since, group_cfg.distributed_step_timeout)


def group_failed(engine: Engine, group: ProcessGroup | None) -> int:
    """The engine stopped for good (a lost process, a failed step): say why, naming the lost process where the
    coordination service knows it, give the streams a moment to send their error events, exit 1."""
    why = engine.failure or ""
    if group is not None and (lost := group.lost_line()) not in why:
        why = f"{lost} ({why})"
    print(f"jaxserve: error: {why}", file=sys.stderr, flush=True)
    time.sleep(ERROR_EVENTS_GRACE_S)
    return EXIT_FAILED


def stop_group(engine: Engine, group: ProcessGroup) -> None:
    """A clean shutdown of process 0: tell the others, and wait (boundedly) until they heard."""
    runner = engine.runner
    assert isinstance(runner, ModelRunner) and runner.mirror is not None  # lead()'s
    sent = runner.mirror.send_seconds
    if sent:
        print(
            f"sent {len(sent)} step messages to the other processes, {runner.mirror.sent_bytes / len(sent):.0f} B "
            f"each on average; send time median {statistics.median(sent) * 1e6:.0f} us, max {max(sent) * 1e6:.0f} us",
            flush=True,
        )
    try:
        runner.mirror.stop()
        group.stop()
    except Exception as error:  # noqa: BLE001 - the others are gone already: nothing left to tell
        log.warning("the other processes did not confirm the shutdown: %s", error)


def _follow(cfg: EngineConfig, group: ProcessGroup, group_cfg: GroupConfig, interrupts: Interrupts) -> int:
    """A process of a group other than process 0: load this process's shards, compile the step shapes in process
    0's order, and replay process 0's device calls until it stops (exit 0) or the group is lost (exit 1)."""
    _prepare(cfg, group)
    runner, _ = load_runner(cfg, skip_tokenizer=True)  # the text side is process 0's
    runner.compile_sync = CompiledEverywhere(group, group_cfg.distributed_timeout)
    stopping = threading.Event()

    def lost(why: str) -> None:
        if stopping.is_set():  # process 0 stopped cleanly and went away: not a loss
            return
        print(f"jaxserve: error: process {group.process_id}: {why}", file=sys.stderr, flush=True)
        end_process(EXIT_FAILED)  # the main thread may be blocked in a step's collective for good

    group.watch(lost, lambda: None, group_cfg.distributed_step_timeout)
    threading.Thread(
        target=runner.compile_ahead, kwargs=dict(stop=interrupts.requested.is_set), name="jaxserve-compile", daemon=True
    ).start()
    print(f"process {group.process_id} of {group.num_processes}: replaying process 0's steps", flush=True)
    follower = Follower(runner, group.channel, stopped=interrupts.requested.is_set)
    try:
        follower.run()
    except GroupLost as error:
        print(f"jaxserve: error: process {group.process_id}: {error}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except Exception as error:  # noqa: BLE001 - a replayed step failed: the group cannot go on; one line, exit 1
        print(
            f"jaxserve: error: process {group.process_id}: replaying process 0's step {follower.replayed} failed: "
            f"{type(error).__name__}: {error}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_FAILED
    if interrupts.requested.is_set():
        print(f"jaxserve: process {group.process_id} interrupted: the group cannot run without it", file=sys.stderr)
        return EXIT_FAILED
    stopping.set()
    try:
        group.stop()
    except Exception as error:  # noqa: BLE001 - process 0 has gone already: it told us to stop
        log.warning("process 0 did not wait for the shutdown's confirmation: %s", error)
    print(f"process {group.process_id}: process 0 stopped; {follower.replayed} calls replayed", flush=True)
    return 0


def generate(args: argparse.Namespace) -> int:
    cfg = engine_config(args)
    if cfg.disaggregation_mode != "null":
        print(
            "jaxserve generate: --disaggregation-mode is a server's role (`jaxserve serve`); generate runs the prompt "
            "here, prefill and decode",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        sampling = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as error:
        print(f"jaxserve generate: {error}", file=sys.stderr)
        return EXIT_USAGE
    # stdout carries the generated text alone (a pipe gets just that); the banner and progress go to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        engine, loaded = _setup(cfg)
    tokenizer = loaded.tokenizer
    if not tokenizer.has_text:
        print("jaxserve generate: this checkpoint has no tokenizer.json; serve it and send token ids", file=sys.stderr)
        return EXIT_USAGE
    prompt_ids = (
        tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        if args.chat
        else tokenizer.encode(args.prompt)
    )
    try:
        engine.check_admission(prompt_ids, sampling)  # before compiling: a prompt that can never fit fails at once
    except ValueError as error:
        print(f"jaxserve generate: {error}", file=sys.stderr)
        return EXIT_USAGE
    with contextlib.redirect_stdout(sys.stderr):
        _start(engine, engine.runner.buckets.prompt_shapes(len(prompt_ids)))  # only what this one prompt needs

    async def stream() -> tuple[int, str | None]:
        generation = Generation(engine, tokenizer, prompt_ids, sampling, tuple(args.stop), "generate")
        reason = None
        async for delta in generation.deltas():  # runs to the end: the last delta carries the finish reason
            print(delta.text, end="", flush=True)
            reason = delta.finish_reason
        return generation.num_generated, reason

    started = time.perf_counter()
    try:
        tokens, reason = asyncio.run(stream())
    finally:
        engine.shutdown()
    seconds = time.perf_counter() - started
    print(flush=True)  # the text ends with a newline
    print(
        f"[{tokens} tokens in {seconds:.2f} s ({tokens / seconds:.1f} tok/s), finish reason: {reason}]",
        file=sys.stderr,
    )
    return 0 if reason != "error" else EXIT_FAILED


def convert(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    dst = convert_checkpoint(
        args.src,
        args.dst,
        dtype=args.dtype,
        overwrite=args.overwrite,
        show_progress=True,
        quantization=args.quantization,
    )
    print(f"converted {args.src} -> {dst} in {time.perf_counter() - started:.1f} s")
    return 0


def plan(args: argparse.Namespace) -> int:
    import json

    from jaxserve.presets import preset

    gpu = None
    if args.target is not None:
        # Before anything here starts JAX's backend (the CLI's imports start none): the CPU platform, the cost
        # model's statistics and no persistent cache (prepare_for_target).
        prepare_for_target()
        gpu = gpu_target(args.target)
    cfg = engine_config(args)
    if gpu is not None and cfg.engram_placement == "host":
        # XLA's deviceless GPU devices expose no host memory kinds, so a step that gathers there cannot compile.
        print(
            "jaxserve plan: --engram-placement host cannot compile for a --target GPU without one (its deviceless "
            "devices have no host memory); plan it without --target",
            file=sys.stderr,
        )
        return EXIT_USAGE
    memory = cfg.device_memory if cfg.device_memory is not None or gpu is None else gpu.memory_bytes
    if memory is None:
        print("jaxserve plan: --device-memory is required (e.g. 80GiB)", file=sys.stderr)
        return EXIT_USAGE
    nodes = {"--num-nodes": args.num_nodes, "--devices-per-node": args.devices_per_node}
    by_nodes = None not in nodes.values()
    if not by_nodes and any(nodes.values()):
        given, missing = sorted(nodes, key=lambda name: nodes[name] is None)
        print(f"jaxserve plan: {given} needs {missing} too", file=sys.stderr)
        return EXIT_USAGE
    if by_nodes and (cfg.tensor_parallel_size, cfg.expert_parallel_size) != (1, 1):
        print(
            "jaxserve plan: --num-nodes and --devices-per-node choose the layout; leave --tensor-parallel-size "
            "and --expert-parallel-size unset",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if by_nodes:
        needed = args.num_nodes * args.devices_per_node
    else:
        needed = cfg.tensor_parallel_size * cfg.expert_parallel_size
    if gpu is None and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Fake CPU devices, one per device of the mesh: nothing is allocated, only compiled. Works while no
        # backend has started yet (this command touches none before here).
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={needed}"
        jax.config.update("jax_platforms", "cpu")
    if args.preset is not None:  # the drafter's weights count too
        model_cfg = preset(args.preset, dtype=cfg.dtype).with_quantization(cfg.quantization).with_drafter(cfg.drafter)
        model_cfg = model_cfg.with_engram_placement(cfg.engram_placement)
    else:
        model_cfg = model_config(cfg.model, cfg.dtype, cfg.quantization, cfg.drafter, cfg.engram_placement)
    layout = node_layout(model_cfg, args.num_nodes, args.devices_per_node) if by_nodes else None
    if layout is not None:
        cfg = dataclasses.replace(
            cfg, tensor_parallel_size=layout.tensor_parallel_size, expert_parallel_size=layout.expert_parallel_size
        )
    share, source = memory_share(cfg.gpu_memory_utilization)
    try:
        devices = plan_devices(needed) if args.target is None else target_devices(args.target, needed)
    except TargetError as missing:
        print(
            f"jaxserve plan: error: {missing} (with --target the command sets JAX_PLATFORMS=cpu itself; where JAX "
            "started earlier, set JAX_PLATFORMS=cpu before it starts)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        the_plan = make_plan(
            model_cfg,
            cfg,
            make_mesh(cfg.tensor_parallel_size, cfg.expert_parallel_size, devices),
            usable_memory(memory, cfg.gpu_memory_utilization),
            target=args.target,
        )
    except StepCompileError as failed:
        print(f"jaxserve plan: error: {failed}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        report = the_plan.to_json()
        print(json.dumps(report if layout is None else {**report, "layout": dataclasses.asdict(layout)}, indent=2))
    else:
        gb = 1e9
        if layout is not None:
            print(
                f"layout: {layout.num_nodes} node(s) x {layout.devices_per_node} devices: tensor parallel "
                f"{layout.tensor_parallel_size} within each node, expert parallel {layout.expert_parallel_size} "
                f"(the routed experts split over all {needed} devices); weights per device by TP x EP: "
                + ", ".join(
                    f"{key}: {value / gb:.2f} GB" if isinstance(value, int) else f"{key}: {value}"
                    for key, value in layout.candidates.items()
                )
            )
        what = "device(s)" if gpu is None else f"{gpu.name} ({args.target}, {gpu.bandwidth / 1e12:.2f} TB/s)"
        print(
            f"{needed} {what} of {memory / gb:.1f} GB, {the_plan.device_memory / gb:.1f} GB of each "
            f"usable ({share:g}: {source}), tensor x expert = {cfg.tensor_parallel_size} x "
            f"{cfg.expert_parallel_size}"
        )
        print(
            f"weights per device: {the_plan.weights_bytes_per_device / gb:.2f} GB ("
            + ", ".join(f"{k} {v / gb:.2f}" for k, v in the_plan.weights_bytes_by_format.items())
            + f"); whole model {the_plan.weights_bytes_total / gb:.1f} GB"
        )
        if the_plan.temp_bytes_per_device is not None and gpu is not None:
            print_target_steps(the_plan, args.target)
        elif the_plan.temp_bytes_per_device is not None:
            print(
                f"step temporaries per device: {the_plan.temp_bytes_per_device / gb:.2f} GB "
                f"(compiled {', '.join(the_plan.compiled_steps)} in {the_plan.compile_s:.1f} s)"
            )
        held = {  # what a role's KV holds its requests for
            "prefill": "prompts of max_model_len prefilling at once (each until its state is handed off)",
            "decode": "requests of max_model_len streaming at once (their prompts' states arrive)",
        }.get(the_plan.disaggregation_mode, f"requests of max_model_len={the_plan.max_model_len} at once")
        role = "" if the_plan.disaggregation_mode == "null" else f" ({the_plan.disaggregation_mode} server)"
        print(
            f"KV{role}: {the_plan.kv_bytes_per_token:.0f} bytes per token; {the_plan.max_kv_tokens} tokens fit; "
            f"{the_plan.max_concurrent_requests} {held}"
        )
        print(f"fits: {'yes' if the_plan.fits else 'no'}: {the_plan.reason}")
    return 0 if the_plan.fits else EXIT_FAILED


def print_target_steps(the_plan: Plan, name: str) -> None:
    """The lines of a --target plan's compiles: the temporaries, each step shape's, and the largest decode step's
    static estimate against its bound."""
    mb, temp = 1e6, the_plan.temp_bytes_per_device or 0
    print(
        f"step temporaries per device: {temp / 1e9:.2f} GB, the largest of "
        f"{len(the_plan.steps)} step shapes compiled for {name} in {the_plan.compile_s:.1f} s (kernels: "
        f"{the_plan.kernels}):"
    )
    width = max(len(step.shape) for step in the_plan.steps)
    for step in the_plan.steps:
        print(
            f"  {step.shape:{width}s}  temporaries {step.temp_bytes / mb:10.2f} MB  compiled in {step.compile_s:.1f} s"
        )
    estimate = the_plan.decode_estimate
    if estimate is not None:
        cost_model = "" if estimate.model_s else "; no cost-model times: JAX started without the flag"
        print(
            f"{estimate.shape} on {name}, static estimate (model figures, nothing ran): "
            f"{estimate.estimate_s * 1e3:.4g} ms, {estimate.launches} kernel launches, "
            f"{estimate.bytes / mb:.4g} MB moved{cost_model}; bound per device at {estimate.rows} row(s) x "
            f"{estimate.context} tokens: {estimate.bound_s * 1e3:.4g} ms ({estimate.bound_bytes / mb:.4g} MB read at "
            f"least): {estimate.estimate_s / estimate.bound_s:.1f}x the bound"
        )


# ---- parsing -------------------------------------------------------------------------------------------------------


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxserve",
        description="Serve DeepSeek-V4 over an OpenAI-compatible HTTP API (the default command; "
        "`jaxserve serve` is the same).",
        epilog="Other commands: `jaxserve generate PROMPT` (one prompt, streamed to the terminal), "
        "`jaxserve convert SRC DST` (safetensors folder -> orbax checkpoint), `jaxserve plan` (will a model "
        "fit these devices), `jaxserve router --prefill URL... --decode URL...` (the front of prefill/decode "
        "disaggregation). Each has --help.",
    )
    parser.add_argument("--version", action="version", version=f"jaxserve {version('jaxserve')}")
    parser.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="checkpoint folder, as in `vllm serve MODEL`: the same as --model"
    )
    add_flags(parser, server=True)
    return parser


def take_positional_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`jaxserve serve MODEL` fills --model (then every flag is a config field again); MODEL and --model naming
    different folders is an error (exit 2) rather than one silently winning."""
    tag = vars(args).pop("model_tag")
    if tag is None:
        return
    if args.model is not None and Path(args.model).resolve() != Path(tag).resolve():
        parser.error(f"the model is given twice: MODEL {tag!r} and --model {args.model!r}; give one")
    args.model = tag


def generate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxserve generate",
        description="Generate from one prompt, streaming the text to the terminal as it is produced.",
    )
    parser.add_argument("prompt")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1, help="-1: off (default: %(default)s)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    add_flags(parser, server=False)
    return parser


def convert_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxserve convert",
        description="Convert a DeepSeek-V4 safetensors folder into a sharded orbax checkpoint that --model can load.",
    )
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--dtype", choices=SUPPORTED_DTYPES, default="bfloat16")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATION_MODES,
        default="auto",
        help="auto: keep the checkpoint's FP8 / FP4 weights so; none: dequantize them to --dtype "
        "(default: %(default)s)",
    )
    parser.add_argument("--overwrite", action="store_true")
    return parser


def plan_parser() -> argparse.ArgumentParser:
    from jaxserve.presets import PRESETS

    parser = argparse.ArgumentParser(
        prog="jaxserve plan",
        description="Will the model fit these devices, and how "
        "much KV cache is left? Compiles the decode step and the largest prefill step "
        "on abstract weights over fake CPU devices (nothing is allocated) and reports "
        "per device: weights by format, step temporaries, KV bytes per token (as "
        "--kv-cache-dtype stores them), KV tokens that fit and requests of "
        "max_model_len at once. With --target, every step shape is compiled for that GPU instead (deviceless). "
        "Exit status 0 when it fits, 1 when not.",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="a named geometry instead of --model (flash: "
        "DeepSeek-V4-Flash as released, FP4 experts and FP8 projections; pro: DeepSeek-V4-Pro's published "
        "geometry in the same formats)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument(
        "--target",
        choices=sorted(TARGETS),
        help="compile for this GPU without one (JAX's deviceless ahead-of-time compile: jaxlib's CUDA plugin and "
        "ptxas, no driver; the command runs JAX on the CPU platform): every step shape of the buckets, as the "
        "engine compiles it, over deviceless devices of the mesh's count; --device-memory defaults to the GPU's "
        "memory and --kernels auto means the Pallas kernels. The report adds each shape's temporaries and compile "
        "time and the largest decode step's static estimate and kernel launches against the least it must read "
        "(the HBM bound). A shape that fails to compile is an error naming it (exit status 1)",
    )
    nodes = parser.add_argument_group(
        "several nodes",
        "Plan N nodes of D devices each instead of --tensor-parallel-size x --expert-parallel-size (give both "
        "flags, and neither of those). Tensor parallelism stays inside a node (its all-reduces run in every layer, "
        "over the node's own links) and expert parallelism spans the nodes: of the layouts TP x EP with TP dividing "
        "D and EP = N x D / TP (the routed experts split over all N x D devices whichever), the plan takes the one "
        "whose devices hold the least weights, the larger TP on a tie; usually TP = D and EP = N, since TP also "
        "splits attention and the vocabulary. The report says the layout and every candidate's weights per device. "
        "The devices are fake CPU devices, as without these flags: nothing is allocated.",
    )
    nodes.add_argument("--num-nodes", type=node_count, metavar="N", help="nodes")
    nodes.add_argument("--devices-per-node", type=node_count, metavar="D", help="devices in each node")
    add_flags(parser, server=False)
    return parser


def node_count(text: str) -> int:
    """A positive integer (argparse names the flag in its error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be a positive integer")
    return value


def router_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxserve router",
        description="The front of prefill/decode disaggregation: the OpenAI API of a server, each completion sent to "
        "a decode server (`jaxserve serve --disaggregation-mode decode`) that has a prefill server (`... "
        "--disaggregation-mode prefill`) prefill its prompt and hand the state over, then streams the tokens. "
        "Servers are taken in turn among the healthy ones (each asked /health every --health-check-interval "
        "seconds).",
    )
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on, 0: any (default: %(default)s)")
    parser.add_argument(
        "--health-check-interval", type=float, default=0.5, metavar="S", help="seconds (default: %(default)s)"
    )
    parser.add_argument(
        "--upstream-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds a decode server may stay silent in an answer (its first token waits for the prompt's "
        "prefill) before the request fails and the server is marked down (default: %(default)s)",
    )
    return parser


def route(args: argparse.Namespace) -> int:
    """`jaxserve router`: serve the router until SIGINT or SIGTERM."""
    from jaxserve.server.router import Routing, create_router_app
    from jaxserve.server.serving import BackgroundServer, ListenError, bind

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    routing = Routing(args.prefill, args.decode, args.health_check_interval, args.upstream_timeout)
    try:
        sock = bind(args.host, args.port)
    except ListenError as error:
        print(f"jaxserve: error: {error}", file=sys.stderr)
        return EXIT_FAILED
    with Interrupts() as interrupts:
        http = BackgroundServer(create_router_app(routing), sock)
        http.start()
        print(f"jaxserve router ready on http://{args.host}:{http.address[1]}", flush=True)
        interrupts.serving = True
        while not interrupts.requested.wait(0.2) and not http.stopped.is_set():
            pass
        http.stop()
    return 0


COMMANDS = {
    "serve": (serve_parser, serve),
    "router": (router_parser, route),
    "generate": (generate_parser, generate),
    "convert": (convert_parser, convert),
    "plan": (plan_parser, plan),
}


def parse(argv: list[str]) -> tuple[Callable[[argparse.Namespace], int], argparse.Namespace]:
    """(command, its parsed arguments); without a command name, `serve`."""
    name = argv[0] if argv and argv[0] in COMMANDS else "serve"
    make_parser, command = COMMANDS[name]
    parser = make_parser()
    args = parser.parse_args(argv[1:] if argv and argv[0] == name else argv)
    if name == "serve":
        take_positional_model(parser, args)
    return command, args


def main(argv: list[str] | None = None) -> int:
    command, args = parse(sys.argv[1:] if argv is None else argv)
    tune_xla_cpu()  # before any backend starts
    try:
        return command(args)
    except ValueError as bad:  # ConfigError, CheckpointError and bad knob combinations: say what, not where
        print(f"jaxserve: error: {bad}", file=sys.stderr)
        return EXIT_USAGE
    except Interrupted:  # start-up interrupted outside serve's own handling; the line is already printed
        end_process(EXIT_FAILED)


if __name__ == "__main__":
    sys.exit(main())
