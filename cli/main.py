"""The `jaxserve` command: `serve` (the default: plain `jaxserve` is `jaxserve serve`), `generate`, `convert`.

Every engine and server flag is one EngineConfig field, named as in vLLM/SGLang, with the field's default.
Start-up prints the weight-loading progress, the KV capacity, the compile progress and time, then one stable
line, `jaxserve ready on http://HOST:PORT`, that scripts can wait for.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Callable

import jax
import uvicorn

from jaxserve.checkpoints.load import LoadedModel, load_model
from jaxserve.config import SUPPORTED_DTYPES, EngineConfig
from jaxserve.engine import Engine
from jaxserve.generation import Generation
from jaxserve.request import SamplingParams
from jaxserve.runner import build_runner
from jaxserve.sharding import make_mesh

log = logging.getLogger("jaxserve.cli")

COMPILE_CACHE_ENV = "JAXSERVE_COMPILE_CACHE"  # a folder, or "" to switch the persistent cache off
DEFAULT_COMPILE_CACHE = Path.home() / ".cache" / "jaxserve" / "xla"
DEFAULT_SERVED_NAME = "jaxserve-default"
UVICORN_GRACE_SECONDS = 5  # after the drain: for finished streams to flush and connections to close

INTERLEAVE_HELP = (
    "After N consecutive prefill steps, take one decode step (when a request is decoding) before prefilling "
    "further. Smaller N: running requests wait less for their next token, but new prompts take longer to reach "
    "their first token; larger N: the reverse. Under asynchronous dispatch the longest wait for the next token "
    "of a running request is about (N+1) x t_chunk + t_decode (t_chunk: one prefill step of "
    "--chunked-prefill-size tokens, t_decode: one decode step). Unset or 0: prefill always goes first, so "
    "running requests freeze for a whole prefill burst.")


STALL_HELP = (
    "Keep prefill's priority, but never let a running request wait longer than this many milliseconds for its "
    "next token: the engine learns the per-token prefill cost, counts the step in flight, and shrinks the next "
    "chunk (page-aligned, with a floor) or takes a decode step when the next prefill step would break the "
    "budget. Requests still waiting for their first token are not held back. Composes with "
    "--decode-interleave-every (whichever is due first wins).")


@dataclass(frozen=True)
class Flag:
    field: str  # the EngineConfig field, which is also the flag's name (--max-num-seqs: max_num_seqs)
    type: Callable
    help: str
    server_only: bool = False  # meaningless to `generate`
    choices: tuple | None = None
    metavar: str | None = None  # default: N for integers, SECONDS for floats


FLAGS = (
    Flag("model", str, "checkpoint folder (safetensors, or an orbax conversion); default: the embedded tiny "
                       "DeepSeek-V4", metavar="PATH"),
    Flag("served_model_name", str, f"the model name clients use (default: {DEFAULT_SERVED_NAME}, or the --model "
                                   "folder's name)", server_only=True, metavar="NAME"),
    Flag("dtype", str, "weights and activations", choices=SUPPORTED_DTYPES),
    Flag("seed", int, "base of the per-request sampling seeds of requests that bring none"),
    Flag("tensor_parallel_size", int, "devices that split attention heads and the vocabulary"),
    Flag("expert_parallel_size", int, "devices that split the routed experts (with the tensor axis)"),
    Flag("max_num_seqs", int, "requests running at once (KV slots), also the largest decode batch"),
    Flag("max_model_len", int, "prompt + completion tokens of one request (default: the model's, at most 16384)"),
    Flag("chunked_prefill_size", int, "prompt tokens in one prefill step"),
    Flag("max_prefill_rows", int, "prompts in one prefill step"),
    Flag("num_kv_pages", int, "KV cache pages (default: enough for --max-num-seqs requests of --max-model-len)"),
    Flag("page_size", int, "tokens per KV page; a multiple of every compress rate of the model"),
    Flag("max_queued_requests", int, "requests waiting for admission; more are refused with HTTP 429",
         server_only=True),
    Flag("decode_interleave_every", int, INTERLEAVE_HELP),
    Flag("max_decode_stall_ms", float, STALL_HELP, metavar="MS"),
    Flag("mixed_batches", bool, "put one token of every running request into each prefill step, so running "
                                "requests advance every step (each then waits one prefill step, not N)"),
    Flag("decode_log_interval", int, "log one decode step in this many"),
    Flag("log_stats_interval", float, "seconds between throughput lines while busy; <= 0: never",
         server_only=True),
    Flag("host", str, "address to listen on", server_only=True, metavar="HOST"),
    Flag("port", int, "port to listen on (0: any free port)", server_only=True),
    Flag("api_key", str, "require `Authorization: Bearer KEY` on /v1/* (/health and /metrics stay open)",
         server_only=True, metavar="KEY"),
    Flag("shutdown_timeout", float, "seconds running requests get to finish after SIGTERM", server_only=True),
)


def add_engine_flags(parser: argparse.ArgumentParser, server: bool) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    for flag in FLAGS:
        if flag.server_only and not server:
            continue
        default = defaults[flag.field]
        name = "--" + flag.field.replace("_", "-")
        if flag.type is bool:
            parser.add_argument(name, dest=flag.field, action=argparse.BooleanOptionalAction, default=default,
                                help=flag.help + " (default: %(default)s)")
            continue
        metavar = None if flag.choices else flag.metavar or {int: "N", float: "SECONDS"}[flag.type]
        parser.add_argument(name, dest=flag.field, type=flag.type, default=default,
                            choices=flag.choices, metavar=metavar,
                            help=flag.help + (" (default: %(default)s)" if default is not None else ""))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the parsed flags describe (fields without a flag in this command keep their default)."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
                           if hasattr(args, f.name)})


def build_engine(cfg: EngineConfig, show_progress: bool = False) -> tuple[Engine, LoadedModel]:
    """Load the checkpoint onto the mesh and make the engine (not started: start() compiles the step shapes)."""
    mesh = make_mesh(cfg.tensor_parallel_size, cfg.expert_parallel_size)
    loaded = load_model(cfg.model, mesh, cfg.dtype, show_progress=show_progress)
    runner = build_runner(cfg, loaded.config, loaded.weights, mesh)
    return Engine(cfg, loaded.config, runner, loaded.tokenizer.eos_ids), loaded


# ---- start-up ------------------------------------------------------------------------------------------------------

def _setup(cfg: EngineConfig) -> tuple[Engine, LoadedModel]:
    # force: importing orbax (through absl) has already given the root logger a bare handler.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    cache = os.environ.get(COMPILE_CACHE_ENV, str(DEFAULT_COMPILE_CACHE))
    if cache:
        # Every step shape is compiled at start; the persistent cache makes the next start with the same flags fast.
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    print(f"jaxserve {version('jaxserve')} on {len(jax.devices())} {jax.default_backend()} device(s); XLA "
          f"compilation cache: {cache or 'off'}", flush=True)
    print(f"loading weights from {cfg.model or 'the embedded default checkpoint'}", flush=True)
    started = time.perf_counter()
    engine, loaded = build_engine(cfg, show_progress=True)
    print(f"loaded weights in {time.perf_counter() - started:.1f} s", flush=True)
    print(capacity_line(engine), flush=True)
    return engine, loaded


def capacity_line(engine: Engine) -> str:
    geometry = engine.geometry
    per_request = geometry.num_pages // geometry.max_pages_per_seq
    concurrency = min(per_request, geometry.num_slots)
    return (f"KV cache: {geometry.num_pages} pages x {geometry.page_size} tokens = "
            f"{geometry.num_pages * geometry.page_size} tokens; max concurrency at max_model_len "
            f"({engine.max_model_len} tokens): {concurrency} requests")


def _compile(engine: Engine) -> None:
    shapes = len(engine.runner.buckets.shapes())
    print(f"compiling {shapes} step shapes (rows x chunk buckets); each is logged as it is done", flush=True)
    started = time.perf_counter()
    # The runner logs every compiled shape with its time; its own progress bar would tangle with those lines.
    engine.start(show_progress=False)
    print(f"compiled {shapes} step shapes in {time.perf_counter() - started:.1f} s", flush=True)
    # Everything alive now (JAX, the executables, the weights' host objects) lives as long as the process. Freezing
    # it keeps the collector from walking it: a full collection of that heap took ~200 ms on 2 cores, a stall the
    # step loop would take in the middle of a stream.
    gc.collect()
    gc.freeze()


# ---- commands ------------------------------------------------------------------------------------------------------

def serve(args: argparse.Namespace) -> int:
    from jaxserve.server import create_app
    from jaxserve.server.shutdown import DrainingServer

    cfg = engine_config(args)
    engine, loaded = _setup(cfg)
    name = cfg.served_model_name or (Path(cfg.model).name if cfg.model else DEFAULT_SERVED_NAME)
    app = create_app(engine, loaded.tokenizer, name, api_key=cfg.api_key, model_path=str(loaded.path))
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, access_log=False,
                            timeout_graceful_shutdown=UVICORN_GRACE_SECONDS)
    server = DrainingServer(config, engine, cfg.shutdown_timeout)
    failed = threading.Event()

    def warm_up_then_announce() -> None:
        # The port is bound while compiling, so /health can say "Loading model" (503) meanwhile.
        try:
            _compile(engine)
        except Exception:  # noqa: BLE001 - report, then stop the server
            log.exception("compiling the step shapes failed")
            failed.set()
            server.should_exit = True
            return
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            print(f"jaxserve ready on http://{cfg.host}:{port} (model={name})", flush=True)

    threading.Thread(target=warm_up_then_announce, name="jaxserve-warmup", daemon=True).start()
    try:
        server.run()
    finally:
        engine.shutdown()
    return 1 if failed.is_set() else 0


def generate(args: argparse.Namespace) -> int:
    cfg = engine_config(args)
    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, ignore_eos=args.ignore_eos)
    except ValueError as error:
        print(f"jaxserve generate: {error}", file=sys.stderr)
        return 2
    engine, loaded = _setup(cfg)
    tokenizer = loaded.tokenizer
    if not tokenizer.has_text:
        print("jaxserve generate: this checkpoint has no tokenizer.json; serve it and send token ids",
              file=sys.stderr)
        return 2
    prompt_ids = (tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat
                  else tokenizer.encode(args.prompt))
    try:
        engine.check_admission(prompt_ids, sampling)  # before compiling: a prompt that can never fit fails at once
    except ValueError as error:
        print(f"jaxserve generate: {error}", file=sys.stderr)
        return 2
    _compile(engine)

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
    print(f"\n[{tokens} tokens in {seconds:.2f} s ({tokens / seconds:.1f} tok/s), finish reason: {reason}]",
          file=sys.stderr)
    return 0 if reason != "error" else 1


def convert(args: argparse.Namespace) -> int:
    from jaxserve.checkpoints.orbax_io import convert_checkpoint  # heavy (orbax), and only this command needs it

    started = time.perf_counter()
    dst = convert_checkpoint(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite, show_progress=True)
    print(f"converted {args.src} -> {dst} in {time.perf_counter() - started:.1f} s")
    return 0


# ---- parsing -------------------------------------------------------------------------------------------------------

def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxserve", description="Serve DeepSeek-V4 over an OpenAI-compatible HTTP API (the default command; "
        "`jaxserve serve` is the same).",
        epilog="Other commands: `jaxserve generate PROMPT` (one prompt, streamed to the terminal), "
               "`jaxserve convert SRC DST` (safetensors folder -> orbax checkpoint). Each has --help.")
    parser.add_argument("--version", action="version", version=f"jaxserve {version('jaxserve')}")
    add_engine_flags(parser, server=True)
    return parser


def generate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve generate", description="Generate from one prompt, streaming "
                                     "the text to the terminal as it is produced.")
    parser.add_argument("prompt")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1, help="-1: off (default: %(default)s)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    add_engine_flags(parser, server=False)
    return parser


def convert_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve convert", description="Convert a DeepSeek-V4 safetensors "
                                     "folder into a sharded orbax checkpoint that --model can load.")
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--dtype", choices=SUPPORTED_DTYPES, default="bfloat16")
    parser.add_argument("--overwrite", action="store_true")
    return parser


COMMANDS = {"serve": (serve_parser, serve), "generate": (generate_parser, generate),
            "convert": (convert_parser, convert)}


def parse(argv: list[str]) -> tuple[Callable[[argparse.Namespace], int], argparse.Namespace]:
    """(command, its parsed arguments); without a command name, `serve`."""
    name = argv[0] if argv and argv[0] in COMMANDS else "serve"
    make_parser, command = COMMANDS[name]
    return command, make_parser().parse_args(argv[1:] if argv and argv[0] == name else argv)


def main(argv: list[str] | None = None) -> int:
    command, args = parse(sys.argv[1:] if argv is None else argv)
    try:
        return command(args)
    except ValueError as bad:  # ConfigError, CheckpointError and bad knob combinations: say what, not where
        print(f"jaxserve: error: {bad}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
