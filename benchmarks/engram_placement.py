"""Issue 43: a step whose Engram rows live in host memory (`--engram-placement host`) against the same step with
them on the device, and what the gather's bytes over the host link predict for the difference.

    .venv/bin/python benchmarks/engram_placement.py            # about 10-15 minutes on 2 busy cores
    .venv/bin/python benchmarks/engram_placement.py --quick    # a smoke run (small tables, few rounds)

What runs, in one process, the two placements interleaved round by round, the order reversed every other round
(medians, min-max, and the per-round host - device differences):

1. The model: a tiny DeepSeek-V4.1 checkpoint from tests/v41_tiny.py's generator with the release's Engram row
   geometry (8 heads x 3 n-gram sizes = 24 columns, head_dim 256: a row is 256 B of FP8 codes + 8 B of ue8m0
   scales) and big tables (engram_vocab_size --vocab: the rows of a layer are the sum of its 24 primes drawn above
   it, about 24 x vocab; 48,000 gives ~1.15M rows, ~300 MB a table), written once under --checkpoints (/tmp). Both
   placements are loaded from it (`load_model(..., engram_placement=...)`); each gets a ModelRunner, every step
   shape compiled and run once before timing. Timed: the runner's own steps (`runner.run` through
   benchmarks/common's `decode_step` / `prefill_step`: the forward, on-device greedy sampling, the host fetching
   the tokens), decode at B rows and one prefill chunk of L tokens. Then small tables (--small-vocab) are loaded
   beside them and the largest B and L run with all four runners (2 table sizes x 2 placements) interleaved: a
   step that copied or converted a whole table would grow with its size.
2. The gather alone (`jaxserve.model.forward.engram_rows`, jitted, both Engram layers of a step): device table,
   host table (the host path: the rows' codes and scales gathered in host memory, copied to the device as stored,
   decoded there), and on the host table the same without the decode (the host path's host-side work and its
   copy), at each table size.
3. Copies: numpy memcpy of the bytes a step moves (its rows as stored + their ids), `jax.device_put` from
   pinned_host to device memory (an array of that size, and one of 264 B: the fixed cost of a transfer), each
   timed alone.
4. Checks: both placements' logits (a jitted `logits_all`: a prompt chunk, then a decode step) are bitwise equal,
   and so are the runners' greedy tokens; the compiled host step's HLO names no table-sized value other than the
   tables themselves (no copy of a table).

The host path (`engram_rows` with the tables in host memory, per Engram layer): the row ids (int32, 4 B a row) are
copied to host memory, the rows are gathered there as stored (FP8 codes + ue8m0 scales, 264 B a release row) inside
`compute_on("device_host")`, copied to the device as stored, and decoded to float32 on the device (`lookup`), as
the device path decodes its own gather. A step moves rows x 264 B + rows x 4 B of ids between the memory kinds, in
3 transfers a layer (the ids; the codes and the scales).

On XLA:CPU "device" and "pinned_host" memory are both this machine's RAM, and `compute_on("device_host")` runs on
the same cores: the host path's transfers are at most memcpys (the HLO check says whether there are any inside the
step). The prediction here is therefore the moved bytes at this machine's memcpy rate + the fixed cost of a
transfer; what the rows would take over PCIe 5.0 x16 to an H200 is computed from an assumed bandwidth (see the
results' last table).

`--render RESULT.json` recomputes the derived fields (byte counts, predictions, the H200 table) from the raw
measurements in the JSON with this byte model and rewrites the findings and markdown; measured numbers are kept.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (
    REPO,
    add_kernels_flag,
    configure_jax,
    decode_step,
    geometry,
    load_average,
    machine_info,
    markdown_table,
    median,
    prefill_step,
    slot_pages,
    slot_request,
    spread,
    timed,
    write_results,
)

PLACEMENTS = ("device", "host")
HEAD_DIM = 256  # the release's engram_head_dim
N_HEADS = 8  # the release's engram_n_heads: 8 heads x 3 n-gram sizes (2, 3, 4) = 24 columns
SCALE_BLOCK = 32  # channels per ue8m0 scale
ROW_BYTES = HEAD_DIM + HEAD_DIM // SCALE_BLOCK  # 264: FP8 codes + scales, what a row stores and what crosses the link
ID_BYTES = 4  # a row id (int32), copied to host memory
TRANSFERS_PER_LAYER = 3  # the ids to the host; the rows' codes and scales back to the device
# The earlier design (before ff37eb2) decoded the rows on the host and handed the device float32: for comparison only.
DECODED_ROW_BYTES = HEAD_DIM * 4
TABLE_CHUNK = 1 << 17  # rows drawn and quantized at a time when writing a big table
# The release (issue 43; the v41-flash preset): 2 Engram layers, (4 - 1) x 8 = 24 columns, 264 B a row.
RELEASE_LAYERS, RELEASE_COLUMNS = 2, 24
RELEASE_DECODE_ROWS, RELEASE_PREFILL_CHUNK = 64, 8192
# Assumptions, not measurements: PCIe 5.0 x16, per direction.
PCIE5_THEORETICAL = 64e9
PCIE5_ACHIEVED = (50e9, 55e9)
# Plausible H200 step times of the release at TP 8 (estimates, see the markdown): (low, high) seconds.
H200_DECODE_64_S = (0.008, 0.020)
H200_PREFILL_8192_S = (0.040, 0.100)


# ---- the checkpoint -------------------------------------------------------------------------------------------


def text_config(vocab: int) -> dict[str, Any]:
    """tests/v41_tiny.py's text config with the release's Engram row geometry and `vocab` as engram_vocab_size (the
    primes, and so the tables' rows, start above it); positions to 4096 so a 1024-token chunk and the decode steps
    fit (yarn factor 16 kept)."""
    from v41_tiny import TINY_TEXT_CONFIG, engram_primes

    cfg = json.loads(json.dumps(TINY_TEXT_CONFIG))
    cfg.update(engram_n_heads=N_HEADS, engram_head_dim=HEAD_DIM, engram_vocab_size=vocab, max_position_embeddings=4096)
    cfg["rope_scaling"]["original_max_position_embeddings"] = 4096 // int(cfg["rope_scaling"]["factor"])
    cfg["engram_num_embeddings"] = [sum(sum(heads) for heads in layer) for layer in engram_primes(cfg)]
    return cfg


def write_checkpoint(folder: Path, vocab: int, seed: int = 0) -> Path:
    """The generator's checkpoint for `text_config(vocab)`, in `folder` (reused when its config matches). The
    backbone's tensors are the generator's own (drawn with small tables); the big tables are drawn and quantized
    by the generator's rule (N(0, 0.15), FP8 e4m3 with a ue8m0 scale per 32 channels) a chunk of rows at a time."""
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    from v41_tiny import STD, tiny_config, tiny_tensors

    from jaxserve.checkpoints import default_checkpoint_path
    from jaxserve.checkpoints.deepseek import scale_name
    from jaxserve.checkpoints.writer import save_tensors
    from jaxserve.kernels.quant import FP8, quantize

    cfg = text_config(vocab)
    config = tiny_config(cfg)
    done = folder / "complete.json"
    if done.exists() and json.loads(done.read_text()) == config:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    small = text_config(40)  # the backbone, drawn by the generator with tables of a few hundred rows
    tensors = tiny_tensors(seed, small)
    rng = np.random.default_rng(seed + 1)
    for layer, rows in zip(cfg["engram_layer_ids"], cfg["engram_num_embeddings"]):
        name = f"layers.{layer}.engram.embed.weight"
        codes = np.empty((rows, HEAD_DIM), ml_dtypes.float8_e4m3fn)
        scales = np.empty((rows, HEAD_DIM // SCALE_BLOCK), ml_dtypes.float8_e8m0fnu)
        for start in range(0, rows, TABLE_CHUNK):
            stop = min(rows, start + TABLE_CHUNK)
            w = np.float32(STD) * rng.standard_normal((stop - start, HEAD_DIM), dtype=np.float32)
            q = quantize(jnp.asarray(w), FP8, (1, SCALE_BLOCK))
            codes[start:stop] = np.asarray(q.codes)
            scales[start:stop] = np.asarray(q.scales).view(ml_dtypes.float8_e8m0fnu)
        assert tensors[name].shape[1:] == codes.shape[1:], (name, tensors[name].shape)
        tensors[name], tensors[scale_name(name)] = codes, scales
    save_tensors(tensors, folder)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    source = default_checkpoint_path()
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / file).exists():
            shutil.copyfile(source / file, folder / file)
    done.write_text(json.dumps(config))
    return folder


def code_state() -> dict[str, Any]:
    """The commit the run measures and the files of the package that differ from it (as the run starts)."""
    import subprocess

    def git(*words: str) -> str:
        return subprocess.run(["git", *words], cwd=REPO, capture_output=True, text=True, check=False).stdout.rstrip()

    changed = git("status", "--porcelain", "--", "jaxserve", "kernels", "checkpoints", "server", "cli")
    return {"head": git("rev-parse", "HEAD"), "modified": [line[3:] for line in changed.splitlines()]}


# ---- the host gather runs at all? ------------------------------------------------------------------------------


def host_gather_error() -> str | None:
    """None if the committed `engram_rows` traces and runs with a host table; else its error."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    from jaxserve.kernels.quant import LayerOf
    from jaxserve.model.forward import engram_rows

    host = SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    table = jax.device_put(np.ones((2, 8, SCALE_BLOCK), np.float32), host)
    try:
        got = jax.jit(lambda t, ids: engram_rows(LayerOf(t, jnp.int32(1)), ids, True))(table, jnp.zeros((1, 2, 3), int))
        jax.block_until_ready(got)
    except Exception as failed:  # noqa: BLE001 -- any failure is the finding
        return f"{type(failed).__name__}: {str(failed).splitlines()[0]}"
    return None


# ---- measurements ----------------------------------------------------------------------------------------------


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int, calls: int = 1) -> dict[str, list[float]]:
    """common.alternate with the order reversed every other round (A B, B A, ...): neither placement always runs
    first in a round. Seconds per call, per round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            times[name].append(timed(lambda fn=fns[name]: [fn() for _ in range(calls)]) / calls)
    return times


def paired(times: dict[str, list[float]], base: str = "device", other: str = "host") -> dict[str, Any]:
    """Medians and spreads of both, the ratio of medians, and the per-round differences (other - base)."""
    diffs = [o - b for o, b in zip(times[other], times[base])]
    return {
        base: spread(times[base]),
        other: spread(times[other]),
        "ratio": round(median(times[other]) / median(times[base]), 3),
        "ratio_of_minimums": round(min(times[other]) / min(times[base]), 3),
        "extra_of_minimums_ms": round(1e3 * (min(times[other]) - min(times[base])), 3),
        "extra_ms": spread(diffs),
        "extra_ms_quartiles": [round(1e3 * q, 3) for q in statistics.quantiles(diffs, n=4)] if len(diffs) > 1 else [],
    }


def step_bytes(tokens: int, layers: int = 2, columns: int = RELEASE_COLUMNS) -> dict[str, int]:
    """A step's Engram bytes on the host path: the rows as stored (codes + scales: what the host hands the device),
    their ids (sent to host memory), and the two together (`moved`: what crosses between the memory kinds)."""
    rows = tokens * layers * columns
    stored, ids = rows * ROW_BYTES, rows * ID_BYTES
    return {"rows": rows, "stored": stored, "ids": ids, "moved": stored + ids}


def copy_costs(sizes: dict[str, int], repeats: int) -> dict[str, Any]:
    """Per size: a numpy memcpy and jax.device_put pinned_host -> device (arrays of that many bytes), interleaved;
    and the same for a 264-byte array (one row: the fixed cost of a transfer)."""
    import jax
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    device = jax.devices()[0]
    to_host = SingleDeviceSharding(device, memory_kind="pinned_host")
    to_device = SingleDeviceSharding(device, memory_kind="device")
    out = {}
    for name, nbytes in {"one row (264 B)": ROW_BYTES, **sizes}.items():
        src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        dst = np.empty_like(src)
        on_host = jax.device_put(src, to_host)
        calls = max(1, min(200, int(2e8 // max(nbytes, 1))))
        fns = {
            "memcpy": lambda dst=dst, src=src: np.copyto(dst, src),
            "device_put": lambda x=on_host: jax.device_put(x, to_device).block_until_ready(),
        }
        for fn in fns.values():
            fn()
        times = interleaved(fns, repeats, calls)
        out[name] = {
            "bytes": nbytes,
            "calls_per_round": calls,
            **{k: spread(v) for k, v in times.items()},
            **{f"{k}_GBps": round(nbytes / median(v) / 1e9, 2) for k, v in times.items()},
        }
        print(f"  copy {name}: " + ", ".join(f"{k} {1e3 * median(v):.4f} ms" for k, v in times.items()), flush=True)
    return out


def synthetic_tables(rows: int, seed: int = 0):
    """Both placements' copies of a stack of 2 Engram tables of `rows` rows (random FP8 codes, never NaN; unit
    scales), as `Quantized` the way the model holds them."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    from jaxserve.kernels.quant import FP8, Quantized

    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 0x7E, size=(2, rows, HEAD_DIM), dtype=np.uint8).view(jnp.float8_e4m3fn)
    scales = np.full((2, rows, HEAD_DIM // SCALE_BLOCK), 127, np.uint8)
    device = jax.devices()[0]
    tables = {}
    for placement, kind in (("device", "device"), ("host", "pinned_host")):
        sharding = SingleDeviceSharding(device, memory_kind=kind)
        tables[placement] = Quantized(
            jax.device_put(codes, sharding), jax.device_put(scales, sharding), FP8, (1, SCALE_BLOCK)
        )
    return tables


def gather_costs(rows: int, token_counts: list[int], repeats: int) -> dict[str, Any]:
    """The Engram gather of a step alone (both layers, 24 columns each), on tables of `rows` rows: device table
    (gathered and decoded on the device), host table (what the step runs: codes and scales gathered in host
    memory, copied to the device as stored, decoded there), and on the host table the same without the decode
    (`host_codes_only`: the host path's host-side gather and its copy; `host` - `host_codes_only` is the decode)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.compute_on import compute_on

    from jaxserve.kernels.quant import LayerOf
    from jaxserve.model import forward

    tables = synthetic_tables(rows)

    def both_layers(on_host: bool):
        def run(table, ids):
            return [forward.engram_rows(LayerOf(table, jnp.int32(i)), ids[:, :, i], on_host) for i in range(2)]

        return jax.jit(run)

    def codes_only(table, ids):
        # engram_rows' host path (one run of rows of the stack, a flat index; rows handed over as stored) without
        # the decode on the device
        rows_per_layer = table.codes.shape[1]
        codes, scales = (a.reshape(-1, a.shape[-1]) for a in (table.codes, table.scales))
        out = []
        for i in range(2):
            flat = jax.device_put(ids[:, :, i] + i * rows_per_layer, jax.memory.Space.Host)
            with compute_on("device_host"):
                gathered = codes[flat], scales[flat]
            out.append(jax.device_put(gathered, jax.memory.Space.Device))
        return out

    fns = {"device": (both_layers(False), "device"), "host": (both_layers(True), "host")}
    fns["host_codes_only"] = (jax.jit(codes_only), "host")
    out: dict[str, Any] = {"rows_per_table": rows, "table_bytes": rows * ROW_BYTES, "by_tokens": {}}
    rng = np.random.default_rng(1)
    for tokens in token_counts:
        ids = jnp.asarray(rng.integers(0, rows, size=(1, tokens, 2, RELEASE_COLUMNS)), jnp.int32)
        args = {name: (fn, tables[t], ids) for name, (fn, t) in fns.items()}
        results = {name: jax.block_until_ready(fn(table, i)) for name, (fn, table, i) in args.items()}
        same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(results["device"], results["host"]))
        per_call = timed(lambda a=args["device"]: jax.block_until_ready(a[0](a[1], a[2])))
        calls = max(1, min(50, int(0.05 // max(per_call, 1e-6))))
        times = interleaved(
            {name: (lambda a=a: jax.block_until_ready(a[0](a[1], a[2]))) for name, a in args.items()},
            repeats,
            calls,
        )
        out["by_tokens"][tokens] = {
            **paired(times),
            "host_codes_only": spread(times["host_codes_only"]),
            "rows_equal": same,
            "calls_per_round": calls,
            **step_bytes(tokens),
        }
        print(
            f"  gather {rows:,} rows x {tokens} tokens: "
            + ", ".join(f"{k} {1e3 * median(v):.3f} ms" for k, v in times.items())
            + f" (rows equal: {same})",
            flush=True,
        )
    del tables
    gc.collect()
    return out


# ---- the model --------------------------------------------------------------------------------------------------


def table_shapes(weights) -> list[tuple[int, ...]]:
    """The shapes of the arrays in host memory (the Engram tables' codes and scales)."""
    import jax

    return sorted(
        {tuple(a.shape) for a in jax.tree.leaves(weights) if getattr(a.sharding, "memory_kind", None) == "pinned_host"}
    )


def hlo_table_values(hlo: str, shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    """In a compiled module's text, outside fusion bodies (a fused op reads its operand in place): the values of a
    table's shape other than the parameters and no-op views (a copy, a convert or a slice of a whole table would
    be listed), the copies to or from host memory, and how many values live in host memory (layout S(5))."""
    pattern = "|".join(re.escape("[" + ",".join(map(str, s)) + "]") for s in shapes)
    fused = set(re.findall(r" fusion\(.*?calls=%([\w.\-]+)", hlo))
    materialized, copies, in_host, current = [], [], 0, None
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%([\w.\-]+) \(", line)
        if header:
            current = header.group(1)
            continue
        found = re.match(r"\s+(?:ROOT )?%\S+ = (\S+\[[^\]]*\])(\S*) ([\w\-]+)\(", line)
        if not found or current in fused:
            continue
        shape, layout, op = found.groups()
        in_host += "S(5)" in layout
        if re.search(pattern, shape) and op not in ("parameter", "bitcast", "get-tuple-element", "tuple"):
            materialized.append(f"{op} {shape}{layout}")
        if op in ("copy-start", "copy-done", "copy") and "S(5)" in line:
            copies.append(f"{op} {shape}{layout}")
    return {
        "table_shapes": [list(s) for s in shapes],
        "table_sized_values": materialized,
        "host_copies": copies,
        "values_in_host_memory": in_host,
        "parameters_in_host_memory": hlo.split("\n", 1)[0].count("S(5)"),
    }


def logits_check(models: dict[str, Any], mesh, chunk: int = 64) -> dict[str, Any]:
    """Both placements' logits for a prompt chunk, then one decode step after it (a jitted logits_all, the cache
    donated), and whether they are bitwise equal; the host step's compiled HLO, scanned for table copies."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.config.model import ENGRAM_CONTEXT_TOKENS
    from jaxserve.model.cache import init_cache
    from jaxserve.model.forward import logits_all
    from jaxserve.model.inputs import StepInputs

    cfg0 = models["device"].config
    geo = geometry(cfg0, 1, chunk + 8)
    prompt = np.random.default_rng(3).integers(3, cfg0.vocab_size, chunk).astype(np.int32)
    pages = jnp.asarray([slot_pages(geo, 0)], jnp.int32)

    def inputs(tokens: np.ndarray, position: int, before: np.ndarray) -> StepInputs:
        context = np.full(ENGRAM_CONTEXT_TOKENS, -1, np.int32)
        if len(before):
            context[-len(before) :] = before[-ENGRAM_CONTEXT_TOKENS:]
        return StepInputs(
            tokens=jnp.asarray(tokens[None], jnp.int32),
            positions=jnp.asarray([position], jnp.int32),
            lengths=jnp.asarray([len(tokens)], jnp.int32),
            slots=jnp.zeros(1, jnp.int32),
            page_table=pages,
            context=jnp.asarray(context[None]),
        )

    step = jax.jit(logits_all, static_argnames=("cfg",), donate_argnames=("cache",))
    logits, hlo = {}, ""
    with jax.set_mesh(mesh):
        for placement, model in models.items():
            cfg = model.config
            first = inputs(prompt, 0, prompt[:0])
            compiled = step.lower(model.weights, init_cache(cfg, geo), first, cfg=cfg).compile()
            if placement == "host":
                hlo = compiled.as_text()
            out, cache = compiled(model.weights, init_cache(cfg, geo), first)
            token = np.array([int(np.argmax(np.asarray(out)[0, -1]))], np.int32)
            out2, _ = step(model.weights, cache, inputs(token, chunk, prompt), cfg=cfg)
            logits[placement] = [np.asarray(out), np.asarray(out2)]
    equal = all(np.array_equal(a, b) for a, b in zip(logits["device"], logits["host"]))
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(logits["device"], logits["host"]))
    return {
        "prompt_tokens": chunk,
        "bitwise_equal": equal,
        "max_abs_diff": diff,
        "hlo": hlo_table_values(hlo, table_shapes(models["host"].weights)),
    }


class Rows:
    """A placement's runner and its decode requests in fixed slots, advanced by greedy decode steps."""

    def __init__(self, runner, geo, slots: int, prompts):
        self.runner, self.geo = runner, geo
        self.requests = [slot_request(geo, slot, prompts[slot]) for slot in range(slots)]
        for request in self.requests:
            request.output_ids.append(prefill_step(runner, request, 0, request.prompt_len))

    def decode(self, batch: int) -> None:
        decode_step(self.runner, self.requests[:batch])

    def prefill(self, slot: int, prompt) -> None:
        prefill_step(self.runner, slot_request(self.geo, slot, prompt), 0, len(prompt))


class Placed:
    """One checkpoint loaded in both placements, each with a runner whose step shapes are compiled and run once."""

    def __init__(self, folder: Path, args: argparse.Namespace, batches: list[int], chunks: list[int], positions: int):
        from jaxserve.checkpoints.load import load_model
        from jaxserve.model.sharding import make_mesh
        from jaxserve.request.step import GroupShape, StepShape
        from jaxserve.runner import Buckets, ModelRunner

        self.folder, self.mesh = folder, make_mesh(1, 1)
        self.prompt_len, self.max_batch = args.prompt, max(batches)
        t0 = time.perf_counter()
        self.models = {p: load_model(folder, self.mesh, args.dtype, engram_placement=p) for p in PLACEMENTS}
        self.load_s = round(time.perf_counter() - t0, 1)
        self.cfg = self.models["device"].config
        self.geo = geometry(self.cfg, self.max_batch + 1, max(max(chunks), args.prompt + positions) + 8)
        prefill = tuple(sorted({args.prompt, *chunks}))
        buckets = Buckets(prefill_rows=(1,), prefill_chunks=prefill, decode_rows=tuple(batches))
        shapes = [StepShape(prefill=GroupShape(1, c)) for c in prefill]
        shapes += [StepShape(decode=GroupShape(b, 1)) for b in batches]
        self.runners, self.compile_s = {}, {}
        for p, model in self.models.items():
            runner = ModelRunner(model.config, model.weights, self.geo, self.mesh, buckets, kernels=args.kernels)
            self.compile_s[p] = round(timed(lambda r=runner: r.warmup(shapes)), 1)
            self.runners[p] = runner
        print(f"  {folder.name}: loaded in {self.load_s} s; compiled {self.compile_s} s", flush=True)

    def describe(self) -> dict[str, Any]:
        engram = self.cfg.engram
        assert engram is not None
        return {
            "checkpoint": str(self.folder),
            "engram_rows_per_table": list(engram.num_embeddings),
            "table_bytes_each": [n * ROW_BYTES for n in engram.num_embeddings],
            "columns": engram.columns,
            "compile_s": self.compile_s,
            "load_s": self.load_s,
        }

    def rows(self, seed: int = 0) -> dict[str, Rows]:
        """Both placements' decode rows, freshly prefilled with the same prompts (slots 0 .. max_batch - 1)."""
        import numpy as np

        prompts = np.random.default_rng(seed).integers(3, self.cfg.vocab_size, (self.max_batch, self.prompt_len))
        return {p: Rows(self.runners[p], self.geo, self.max_batch, prompts) for p in PLACEMENTS}

    def close(self) -> None:
        import jax

        self.runners.clear()
        self.models.clear()
        gc.collect()
        jax.clear_caches()


def model_steps(
    placed: Placed, args: argparse.Namespace, batches: list[int], chunks: list[int], rounds: int, prefill_rounds: int
) -> dict[str, Any]:
    """Decode and prefill steps of the two placements' runners, interleaved round by round; the logits check."""
    import numpy as np

    out: dict[str, Any] = placed.describe() | {"decode": {}, "prefill": {}}
    out["logits"] = logits_check(placed.models, placed.mesh)
    print(f"  logits bitwise equal: {out['logits']['bitwise_equal']}; HLO: {out['logits']['hlo']}", flush=True)
    rows = placed.rows()
    for batch in batches:
        fns = {p: (lambda r=rows[p], b=batch: r.decode(b)) for p in PLACEMENTS}
        times = interleaved(fns, rounds, args.decode_calls)
        out["decode"][batch] = {**paired(times), **step_bytes(batch), "calls_per_round": args.decode_calls}
        print(f"  decode B={batch}: " + ", ".join(f"{p} {1e3 * median(v):.3f} ms" for p, v in times.items()))
    tokens = {p: [r.output_ids for r in rows[p].requests] for p in PLACEMENTS}
    out["greedy_tokens_equal"] = tokens["device"] == tokens["host"]
    out["greedy_tokens_compared"] = sum(len(t) for t in tokens["device"])
    rng = np.random.default_rng(1)
    for chunk in chunks:
        prompt = rng.integers(3, placed.cfg.vocab_size, chunk)
        fns = {p: (lambda r=rows[p], x=prompt: r.prefill(placed.max_batch, x)) for p in PLACEMENTS}
        times = interleaved(fns, prefill_rounds, 1)
        out["prefill"][chunk] = {**paired(times), **step_bytes(chunk)}
        print(f"  prefill L={chunk}: " + ", ".join(f"{p} {1e3 * median(v):.3f} ms" for p, v in times.items()))
    return out


def table_size_steps(
    big: Placed, small: Placed, args: argparse.Namespace, batch: int, chunk: int, rounds: int, prefill_rounds: int
) -> dict[str, Any]:
    """Decode at `batch` rows and a prefill chunk of `chunk` tokens, all four runners (two table sizes x two
    placements) interleaved round by round from freshly prefilled rows: a step that copied or converted a whole
    table would grow with its size."""
    import numpy as np

    rows = {size: placed.rows() for size, placed in (("big", big), ("small", small))}
    names = [(size, p) for size in ("big", "small") for p in PLACEMENTS]
    prompt = np.random.default_rng(2).integers(3, big.cfg.vocab_size, chunk)
    slot = {"big": big.max_batch, "small": small.max_batch}
    runs = {
        "decode": {f"{p}, {size}": (lambda r=rows[size][p]: r.decode(batch)) for size, p in names},
        "prefill": {f"{p}, {size}": (lambda r=rows[size][p], s=slot[size]: r.prefill(s, prompt)) for size, p in names},
    }
    out: dict[str, Any] = {"small": small.describe(), "big": big.describe(), "batch": batch, "chunk": chunk}
    for kind, fns in runs.items():
        times = interleaved(
            fns, rounds if kind == "decode" else prefill_rounds, args.decode_calls if kind == "decode" else 1
        )
        out[kind] = {
            placement: {
                "big": spread(times[f"{placement}, big"]),
                "small": spread(times[f"{placement}, small"]),
                "big_over_small": round(median(times[f"{placement}, big"]) / median(times[f"{placement}, small"]), 3),
                "big_minus_small_ms": spread(
                    [b - s for b, s in zip(times[f"{placement}, big"], times[f"{placement}, small"])]
                ),
            }
            for placement in PLACEMENTS
        }
        print(f"  table size, {kind}: " + ", ".join(f"{k} {1e3 * median(v):.3f} ms" for k, v in times.items()))
    return out


# ---- predictions and the report ---------------------------------------------------------------------------------


def memcpy_rate(nbytes: int, copies: dict[str, Any]) -> tuple[float, str]:
    """Bytes a second of this machine's memcpy for a copy of `nbytes`, and where it comes from: the copy measured
    at that size, else interpolated (linearly in log size) between the measured sizes around it, or the nearest
    measured size beyond the range (a result of a run whose copies were sized for another byte model). The one-row
    copy (call overhead, not bandwidth) is left out."""
    import math

    sizes = [(c["bytes"], c["memcpy_GBps"] * 1e9, name) for name, c in copies.items() if c["bytes"] > ROW_BYTES]
    measured = sorted(sizes)
    for size, rate, name in measured:
        if size == nbytes:
            return rate, f"measured ({name})"
    if nbytes <= measured[0][0] or nbytes >= measured[-1][0]:
        size, rate, name = measured[0] if nbytes <= measured[0][0] else measured[-1]
        return rate, f"nearest measured size ({name})"
    (s0, r0, n0), (s1, r1, n1) = next((a, b) for a, b in zip(measured, measured[1:]) if a[0] < nbytes < b[0])
    w = math.log(nbytes / s0) / math.log(s1 / s0)
    return r0 + w * (r1 - r0), f"interpolated ({n0}, {n1})"


def predict(moved: int, copies: dict[str, Any], transfers: int) -> float:
    """Seconds: a memcpy of `moved` bytes at this machine's memcpy rate for that size, and `transfers` times the
    fixed cost of a transfer (a one-row device_put, pinned_host -> device)."""
    fixed = copies["one row (264 B)"]["device_put"]["median_ms"] / 1e3
    return moved / memcpy_rate(moved, copies)[0] + transfers * fixed


def h200_projection(gathers: dict[int, Any]) -> list[dict[str, Any]]:
    """The release's rows as stored over PCIe 5.0 x16 (assumed bandwidths; the ids go the other way, a separate
    direction of the link), the host path's gather measured here at the same row counts, and plausible H200 step
    times (estimates). `earlier_design_decoded`: what handing the device float32 rows (decoding on the host, the
    design before ff37eb2) would have cost, for comparison."""
    out = []
    achieved = sum(PCIE5_ACHIEVED) / 2
    for label, tokens, step_s in (
        (f"decode batch {RELEASE_DECODE_ROWS}", RELEASE_DECODE_ROWS, H200_DECODE_64_S),
        (f"prefill chunk {RELEASE_PREFILL_CHUNK}", RELEASE_PREFILL_CHUNK, H200_PREFILL_8192_S),
    ):
        b = step_bytes(tokens, RELEASE_LAYERS, RELEASE_COLUMNS)
        row: dict[str, Any] = {"step": label, "tokens": tokens, **b}
        row["stored_ms_at"] = {
            f"{bw / 1e9:.0f} GB/s": round(1e3 * b["stored"] / bw, 3) for bw in (PCIE5_THEORETICAL, *PCIE5_ACHIEVED)
        }
        row["step_estimate_ms"] = [round(1e3 * s, 1) for s in step_s]
        row["stored_share_of_step"] = [round(b["stored"] / achieved / s, 4) for s in reversed(step_s)]
        decoded = b["rows"] * DECODED_ROW_BYTES
        row["earlier_design_decoded"] = {
            "bytes": decoded,
            f"ms_at_{achieved / 1e9:g}_GBps": round(1e3 * decoded / achieved, 3),
            "share_of_step": [round(decoded / achieved / s, 4) for s in reversed(step_s)],
        }
        measured = gathers.get(tokens)
        if measured is not None:
            row["host_gather_here_ms"] = {
                "device": measured["device"]["median_ms"],
                "host": measured["host"]["median_ms"],
                "codes_only": measured["host_codes_only"]["median_ms"],
            }
        out.append(row)
    return out


def derive(report: dict[str, Any]) -> None:
    """The fields computed from the measurements, (re)computed in place with this script's byte model: each step's
    and gather's bytes, the steps' predicted extra, the H200 table. Measured numbers are left as they are."""
    report["byte_model"] = {
        "row_bytes_stored": ROW_BYTES,
        "id_bytes": ID_BYTES,
        "transfers_per_step": TRANSFERS_PER_LAYER * RELEASE_LAYERS,
        "moved": "rows x (264 B of codes and scales + 4 B of id): the rows cross as stored, decoded on the device",
    }
    copies = report["copies"]
    for g in report["gathers"]:
        for tokens, m in g["by_tokens"].items():
            m.pop("decoded", None)
            m.update(step_bytes(int(tokens)))
    for model in report["models"]:
        for kind in ("decode", "prefill"):
            for n, m in model[kind].items():
                m.pop("decoded", None)
                m.update(step_bytes(int(n)))
                rate, source = memcpy_rate(m["moved"], copies)
                m["memcpy_GBps_used"] = {"GBps": round(rate / 1e9, 2), "from": source}
                m["predicted_copy_ms"] = round(1e3 * predict(m["moved"], copies, 0), 3)
                m["predicted_ms"] = round(1e3 * predict(m["moved"], copies, TRANSFERS_PER_LAYER * RELEASE_LAYERS), 3)
    report["h200"] = h200_projection({int(t): m for t, m in report["gathers"][0]["by_tokens"].items()})


def extra(s: dict[str, Any]) -> str:
    return f"{s['median_ms']:+.3f} [{s['min_ms']:+.2f}, {s['max_ms']:+.2f}]"


def markdown(report: dict[str, Any]) -> str:
    lines = ["# Engram tables in host memory vs on the device (issue 43)", ""]
    info = report["machine"]
    lines.append(
        f"{info['cpu_cores']} CPU cores, JAX {info['jax']} (XLA:CPU), {report['dtype']}; load average "
        f"{info['load_average_1min_at_start']} -> {report['load_average_at_end']}; the two placements interleaved "
        "round by round, their order reversed every other round; times are medians [min-max]; `extra` is host - "
        "device, the median of the per-round "
        "differences [min-max]."
    )
    code = report.get("code")
    if code:
        changed = f", with uncommitted changes to {', '.join(code['modified'])}" if code["modified"] else ""
        lines[-1] += f" Code measured: jaxserve at {code['head'][:10]}{changed}."
        if code.get("note"):
            lines[-1] += f" Note: {code['note']}"
    lines.append("")
    for model in report["models"]:
        sizes = " + ".join(f"{b / 1e6:.1f} MB" for b in model["table_bytes_each"])
        lines += [f"## Steps of the runner: tables of {sizes} ({model['engram_rows_per_table']} rows)", ""]
        rows = []
        for kind, by in (("decode B", model["decode"]), ("prefill L", model["prefill"])):
            for n, m in by.items():
                rows.append(
                    [
                        f"{kind}={n}",
                        f"{m['device']['median_ms']:.3f} [{m['device']['min_ms']:.2f}-{m['device']['max_ms']:.2f}]",
                        f"{m['host']['median_ms']:.3f} [{m['host']['min_ms']:.2f}-{m['host']['max_ms']:.2f}]",
                        f"{m['ratio']:.3f}x",
                        extra(m["extra_ms"]),
                        f"{m['extra_of_minimums_ms']:+.3f}",
                        f"{m['moved'] / 1e3:,.1f}",
                        f"{m['predicted_copy_ms']:.3f} / {m['predicted_ms']:.3f}",
                        m["device"]["n"],
                    ]
                )
        lines.append(
            markdown_table(
                [
                    "step",
                    "device ms",
                    "host ms",
                    "host/device",
                    "extra ms",
                    "min - min ms",
                    "KB moved",
                    "predicted extra ms: copy / + fixed",
                    "rounds",
                ],
                rows,
            )
        )
        lines.append("")
        checks = [f"greedy tokens equal: {model['greedy_tokens_equal']} ({model['greedy_tokens_compared']} tokens)"]
        if "logits" in model:
            lg = model["logits"]
            checks.append(
                f"logits bitwise equal (a {lg['prompt_tokens']}-token chunk and a decode step): {lg['bitwise_equal']} "
                f"(max |diff| {lg['max_abs_diff']})"
            )
            hlo = lg["hlo"]
            checks.append(
                f"compiled host step (XLA:CPU): {hlo['parameters_in_host_memory']} parameters in host memory (the "
                f"tables' codes and scales), {hlo['values_in_host_memory']} other values there, copies to or from it: "
                f"{hlo['host_copies'] or 'none'}, table-sized values outside fusions other than the parameters: "
                f"{hlo['table_sized_values'] or 'none'}"
            )
        lines += [f"{'; '.join(checks)}. Compile {model['compile_s']} s.", ""]
    size = report.get("table_size")
    if size:
        mb = [sum(size[k]["table_bytes_each"]) / 1e6 for k in ("small", "big")]
        lines += [
            f"## Table size: {mb[0]:.0f} MB against {mb[1]:.0f} MB of tables, four runners interleaved",
            "",
            f"Decode B={size['batch']} and prefill L={size['chunk']}, both placements at both table sizes, every round "
            "running all four (fresh rows, prefilled alike). A step that copied or converted a whole table would grow "
            "with its size.",
            "",
        ]
        rows = []
        for kind in ("decode", "prefill"):
            for placement, m in size[kind].items():
                rows.append(
                    [
                        f"{kind} {size['batch'] if kind == 'decode' else size['chunk']}",
                        placement,
                        f"{m['small']['median_ms']:.3f} [{m['small']['min_ms']:.2f}-{m['small']['max_ms']:.2f}]",
                        f"{m['big']['median_ms']:.3f} [{m['big']['min_ms']:.2f}-{m['big']['max_ms']:.2f}]",
                        f"{m['big_over_small']:.3f}x",
                        extra(m["big_minus_small_ms"]),
                    ]
                )
        headers = ["step", "placement", f"{mb[0]:.0f} MB ms", f"{mb[1]:.0f} MB ms", "big/small", "big - small ms"]
        lines += [markdown_table(headers, rows), ""]
    transfers = TRANSFERS_PER_LAYER * RELEASE_LAYERS
    lines += [
        f"KB moved: what the host path moves between the memory kinds, rows x {ROW_BYTES + ID_BYTES} B (tokens x 2 "
        f"layers x 24 columns): each row as stored, {ROW_BYTES} B (256 B of FP8 codes + 8 B of ue8m0 scales: the host "
        "gathers the rows inside `compute_on('device_host')` and hands them over undecoded; `lookup` decodes them on "
        f"the device, as in the device path), and its id, {ID_BYTES} B, sent to host memory. Predicted extra: the "
        "moved bytes at this machine's memcpy rate for that size (`copy`; see the copies below), and that + "
        f"{transfers} transfers a step (per Engram layer the ids to the host, the codes and the scales back) at the "
        "measured cost of a one-row device_put from Python (`+ fixed`: mostly dispatch). Both assume the step copies "
        "its rows; see the findings for whether XLA:CPU's compiled step copies anything.",
        "",
        "## The gather alone (both Engram layers of a step, jitted)",
        "",
    ]
    rows = []
    for g in report["gathers"]:
        for tokens, m in g["by_tokens"].items():
            rows.append(
                [
                    f"{g['table_bytes'] / 1e6:,.0f} MB",
                    tokens,
                    f"{m['device']['median_ms']:.3f} [{m['device']['min_ms']:.2f}-{m['device']['max_ms']:.2f}]",
                    f"{m['host']['median_ms']:.3f} [{m['host']['min_ms']:.2f}-{m['host']['max_ms']:.2f}]",
                    f"{m['ratio']:.3f}x",
                    f"{m['extra_ms']['median_ms']:+.3f}",
                    f"{m['host_codes_only']['median_ms']:.3f}",
                    f"{m['host']['median_ms'] - m['host_codes_only']['median_ms']:.3f}",
                    m["rows_equal"],
                ]
            )
    lines.append(
        markdown_table(
            [
                "table",
                "tokens",
                "device ms",
                "host ms",
                "host/device",
                "extra ms",
                "host, codes only ms",
                "host - codes only ms",
                "equal",
            ],
            rows,
        )
    )
    lines += [
        "",
        "`device`: the rows gathered from the device's table and decoded there. `host`: the host path, the rows' "
        "codes and scales gathered in host memory, copied to the device as stored (264 B a row) and decoded there. "
        "`host, codes only`: the host path without its decode on the device (the gather in host memory and the copy "
        "of the stored rows); `host - codes only` (difference of medians) is the device's FP8 -> float32 decode, the "
        "same decode the device path runs. On XLA:CPU both memories are this machine's RAM and every part runs on "
        "the same cores.",
        "",
        "## Copies on this machine",
        "",
    ]
    rows, earlier = [], False
    for name, c in report["copies"].items():
        sized = re.fullmatch(r"(decode|prefill) (\d+): moved", name)
        if sized and c["bytes"] == step_bytes(int(sized.group(2)))["rows"] * DECODED_ROW_BYTES:
            name, earlier = f"{sized.group(1)} {sized.group(2)}: its rows decoded to float32 (earlier design)", True
        rows.append(
            [
                name,
                c["bytes"],
                f"{c['memcpy']['median_ms']:.3f}",
                c["memcpy_GBps"],
                f"{c['device_put']['median_ms']:.3f}",
                c["device_put_GBps"],
            ]
        )
    lines.append(markdown_table(["size", "bytes", "memcpy ms", "GB/s", "device_put host->device ms", "GB/s"], rows))
    lines += [
        "",
        "device_put is called from Python (its time includes the dispatch); inside a jitted step XLA:CPU emits no "
        "copy between the memory kinds at all (see the HLO check above).",
        "",
    ]
    if earlier:
        used = {
            f"{kind} {n}": m["memcpy_GBps_used"]
            for model in report["models"][:1]
            for kind in ("decode", "prefill")
            for n, m in model[kind].items()
        }
        lines += [
            "This run's copies were sized for the earlier design's bytes (rows decoded to float32 on the host, "
            f"{DECODED_ROW_BYTES} B a row); the predictions above take the memcpy rate at each step's moved bytes "
            "from them, interpolated in log size: "
            + ", ".join(f"{k} {v['GBps']:.2f} GB/s" for k, v in used.items())
            + ".",
            "",
        ]
    lines += [
        "## What the same bytes would cost on an H200 over PCIe 5.0 x16",
        "",
        "Assumed, not measured: PCIe 5.0 x16 gives 64 GB/s per direction in theory and about 50-55 GB/s achieved "
        "host-to-device; shares below use 52.5 GB/s. Release geometry: 2 Engram layers, 24 columns, 264 B a row as "
        "stored, which is what crosses the link (the rows are decoded on the device; the ids, 4 B a row, go the "
        "other way). Step times are estimates of the release on 8 x H200 at TP 8: decode at "
        "batch 64 is bound by reading ~25 GB of weights a device (`jaxserve plan --preset v41-flash`: 34 GB of FP4 "
        "experts a device, ~64% of experts touched at batch 64, ~3 GB of dense weights) at 4.8 TB/s, ~5 ms, so "
        "8-20 ms in practice; a prefill chunk of 8192 tokens is ~2.8e14 FLOP (~17B active parameters a token), "
        "~35 ms at 8 x 989 TFLOP/s bf16, so 40-100 ms in practice.",
        "",
    ]
    rows = []
    for p in report["h200"]:
        here = p.get("host_gather_here_ms", {})
        old = p["earlier_design_decoded"]
        old_ms = next(v for k, v in old.items() if k.startswith("ms_at_"))
        rows.append(
            [
                p["step"],
                f"{p['rows']:,}",
                f"{p['stored'] / 1e6:.2f}",
                " / ".join(f"{v:.3f}" for v in p["stored_ms_at"].values()),
                f"{p['step_estimate_ms'][0]:.0f}-{p['step_estimate_ms'][1]:.0f}",
                f"{100 * p['stored_share_of_step'][0]:.2f}-{100 * p['stored_share_of_step'][1]:.2f}%",
                f"{here['device']:.1f} / {here['host']:.1f} / {here['codes_only']:.1f}" if here else "-",
                f"{old['bytes'] / 1e6:.2f} MB, {old_ms:.3f} ms, "
                f"{100 * old['share_of_step'][0]:.2f}-{100 * old['share_of_step'][1]:.2f}%",
            ]
        )
    lines.append(
        markdown_table(
            [
                "step",
                "rows",
                "MB over the link (as stored)",
                "ms at 64 / 50 / 55 GB/s",
                "step estimate ms",
                "share of step at 52.5 GB/s",
                "gather alone here ms: device / host / host codes only",
                "earlier design, not run: rows decoded on the host (1024 B a row) at 52.5 GB/s",
            ],
            rows,
        )
    )
    lines += [
        "",
        "The last column is what the design before ff37eb2 (decoding on the host, handing the device float32 rows) "
        f"would have moved: {DECODED_ROW_BYTES / ROW_BYTES:.2f}x the bytes; the code measured here does not do it.",
    ]
    lines += ["", "## Findings", ""] + [f"- {f}" for f in report["findings"]]
    return "\n".join(lines)


def findings(report: dict[str, Any]) -> list[str]:
    out = []
    big = report["models"][0]
    hlo = big.get("logits", {}).get("hlo")
    if hlo is not None:
        if not hlo["host_copies"] and not hlo["values_in_host_memory"] and not hlo["table_sized_values"]:
            out.append(
                "XLA:CPU compiles the host step to the device step's computation: the tables are parameters in host "
                f"memory ({hlo['parameters_in_host_memory']} of them), no other value lives there, nothing is copied "
                "between the memory kinds and no whole table is materialized. On this machine the prediction proper "
                "is therefore zero; the bytes / memcpy figures are what the copy would cost if there were one."
            )
        else:
            out.append(f"The compiled host step moves or materializes: {hlo}.")
    steps = [(f"decode B={n}", m) for n, m in big["decode"].items()]
    steps += [(f"prefill L={n}", m) for n, m in big["prefill"].items()]
    label, worst = max(steps, key=lambda item: item[1]["extra_ms"]["median_ms"] - item[1]["predicted_ms"])
    excess = worst["extra_ms"]["median_ms"] - worst["predicted_ms"]
    out.append(
        "Host vs device on this CPU, the runner's steps with the big tables: "
        + ", ".join(f"{name} {m['ratio']:.3f}x ({m['extra_ms']['median_ms']:+.3f} ms)" for name, m in steps)
        + f"; the largest measured extra beyond the prediction (copy + fixed): {excess:+.3f} ms ({label})."
    )
    noise = [(name, m) for name, m in steps if len(m["extra_ms_quartiles"]) == 3]
    straddle = [name for name, m in noise if m["extra_ms_quartiles"][0] <= 0 <= m["extra_ms_quartiles"][2]]
    above = [name for name, m in noise if m["extra_ms_quartiles"][0] > 0]
    below = [name for name, m in noise if m["extra_ms_quartiles"][2] < 0]
    verdict = (
        f"Per-round host - device differences whose interquartile range contains 0: {', '.join(straddle) or 'none'}"
    )
    if above:
        verdict += f"; host slower in at least 3 of 4 rounds: {', '.join(above)}"
    if below:
        verdict += f"; host faster in at least 3 of 4 rounds: {', '.join(below)}"
    out.append(verdict + ".")
    gathers = report["gathers"]
    top = max(gathers[0]["by_tokens"], key=int)
    g = gathers[0]["by_tokens"][top]
    out.append(
        f"The host path's host-side work is the gather of the stored rows: the gather alone of {int(top):,} tokens x "
        f"2 layers x 24 columns takes {g['host_codes_only']['median_ms']:.1f} ms for the codes and scales gathered "
        f"in host memory and copied over as stored, {g['host']['median_ms']:.1f} ms for the whole host path; the "
        f"difference, {g['host']['median_ms'] - g['host_codes_only']['median_ms']:.1f} ms, is the FP8 -> float32 "
        f"decode, which runs on the device in both placements (the device path: {g['device']['median_ms']:.1f} ms "
        f"for the same gather and decode; XLA:CPU, this machine). The rows cross the link as stored, {ROW_BYTES} B a "
        f"row; decoding them on the host (the design before ff37eb2) would have handed the device "
        f"{DECODED_ROW_BYTES / ROW_BYTES:.2f}x the bytes."
    )
    if len(gathers) > 1:
        common_tokens = sorted(set(gathers[0]["by_tokens"]) & set(gathers[1]["by_tokens"]), key=int)
        parts = []
        for t in common_tokens:
            big_g, small_g = gathers[0]["by_tokens"][t], gathers[1]["by_tokens"][t]
            parts.append(
                f"{int(t):,} tokens: {small_g['device']['median_ms']:.2f} / {small_g['host']['median_ms']:.2f} ms with "
                f"tables of {gathers[1]['table_bytes'] / 1e6:.0f} MB each, {big_g['device']['median_ms']:.2f} / "
                f"{big_g['host']['median_ms']:.2f} ms with {gathers[0]['table_bytes'] / 1e6:.0f} MB (device / host)"
            )
        out.append(
            "The gather alone against the table's size (separate runs, not paired): "
            + "; ".join(parts)
            + ". A cost that grows with the rows gathered, not a fixed one: a whole-table copy would cost the same "
            "at every token count; the per-row cost grows with the table (cache and TLB misses of random rows), in "
            "both placements alike."
        )
    size = report.get("table_size")
    if size:
        mb = [sum(size[k]["table_bytes_each"]) / 1e6 for k in ("small", "big")]
        gbps = max(report["copies"].values(), key=lambda c: c["bytes"])["memcpy_GBps"]
        parts = [
            f"{kind} {p}: {m['big_over_small']:.3f}x ({m['big_minus_small_ms']['median_ms']:+.2f} ms)"
            for kind in ("decode", "prefill")
            for p, m in size[kind].items()
        ]
        out.append(
            f"Table size, {mb[0]:.0f} MB -> {mb[1]:.0f} MB of tables, paired: " + ", ".join(parts) + f". A copy of "
            f"the big tables at this machine's {gbps:.1f} GB/s memcpy would add ~{mb[1] / gbps:.0f} ms a step "
            f"(~{mb[1] * 2 / gbps:.0f} ms for an FP8 -> f16 conversion writing twice the bytes)."
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small tables, few rounds (a smoke run)")
    parser.add_argument("--vocab", type=int, default=48_000, help="engram_vocab_size of the big tables")
    parser.add_argument("--small-vocab", type=int, default=4_000, help="engram_vocab_size of the small tables")
    parser.add_argument("--batches", default=None, help="decode rows, comma-separated (default 1,8,32)")
    parser.add_argument("--chunks", default=None, help="prefill chunks, comma-separated (default 256,1024)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens of each decode row")
    parser.add_argument("--rounds", type=int, default=None, help="decode rounds (default 20; --quick 3)")
    parser.add_argument("--decode-calls", type=int, default=4, help="decode steps per round")
    parser.add_argument("--prefill-rounds", type=int, default=None, help="prefill rounds (default 12; --quick 3)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--checkpoints", type=Path, default=Path("/tmp/jaxserve_engram_placement"))
    parser.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    parser.add_argument("--render", type=Path, help="rewrite the findings and markdown of this result JSON; no run")
    configure_jax(devices=1)
    add_kernels_flag(parser)
    args = parser.parse_args(argv)
    if args.render:
        report = json.loads(args.render.read_text())
        derive(report)
        report["findings"] = findings(report)
        text = markdown(report)
        print(text)
        if not args.no_write:
            print("wrote", *write_results(args.render.stem, report, text))
        return
    sys.path.insert(0, str(REPO / "tests"))
    quick = args.quick
    batches = [int(b) for b in (args.batches or ("1,8" if quick else "1,8,32")).split(",")]
    chunks = [int(c) for c in (args.chunks or ("256" if quick else "256,1024")).split(",")]
    rounds = args.rounds or (3 if quick else 20)
    prefill_rounds = args.prefill_rounds or (3 if quick else 12)
    big_vocab = args.small_vocab if quick else args.vocab

    report: dict[str, Any] = {"machine": machine_info(), "code": code_state(), "dtype": args.dtype, "quick": quick}
    print(f"load average {report['machine']['load_average_1min_at_start']}", flush=True)
    error = host_gather_error()
    if error:
        raise SystemExit(f"jaxserve.model.forward.engram_rows does not run with a table in host memory: {error}")

    folders = {}
    for vocab in sorted({big_vocab, args.small_vocab}, reverse=True):
        t0 = time.perf_counter()
        folders[vocab] = write_checkpoint(args.checkpoints / f"vocab{vocab}", vocab)
        print(f"checkpoint vocab {vocab}: {folders[vocab]} ({time.perf_counter() - t0:.1f} s)", flush=True)

    # 3. copies: the byte counts the measured steps move (rows as stored + ids), and the release's
    sizes = {}
    for kind, ns in (("decode", batches), ("prefill", chunks)):
        for n in ns:
            sizes[f"{kind} {n}: moved"] = step_bytes(n)["moved"]
    sizes[f"release prefill {RELEASE_PREFILL_CHUNK}: stored"] = step_bytes(RELEASE_PREFILL_CHUNK)["stored"]
    print("copies", flush=True)
    report["copies"] = copy_costs(sizes, 5 if quick else 11)

    # 2. the gather alone, at each table size (the release's row counts too where affordable)
    report["gathers"] = []
    token_counts = sorted(set(batches + chunks + ([] if quick else [RELEASE_DECODE_ROWS, RELEASE_PREFILL_CHUNK])))
    for vocab in sorted(folders, reverse=True):
        rows = max(text_config(vocab)["engram_num_embeddings"])
        print(f"gather, tables of {rows:,} rows", flush=True)
        counts = token_counts if vocab == big_vocab else [max(batches), max(chunks)]
        report["gathers"].append(gather_costs(rows, counts, 3 if quick else 7))

    # 1. the runner's steps: big tables in full; then (not --quick) the table-size check, four runners interleaved
    positions = (rounds * args.decode_calls * (len(batches) + 1)) + 4
    print(f"model steps, engram_vocab_size {big_vocab}", flush=True)
    big = Placed(folders[big_vocab], args, batches, chunks, positions)
    report["models"] = [model_steps(big, args, batches, chunks, rounds, prefill_rounds)]
    report["table_size"] = None
    if not quick:
        print(f"table size: engram_vocab_size {args.small_vocab} against {big_vocab}", flush=True)
        small = Placed(folders[args.small_vocab], args, [max(batches)], [max(chunks)], positions)
        report["table_size"] = table_size_steps(big, small, args, max(batches), max(chunks), rounds, prefill_rounds)
        small.close()
    big.close()
    derive(report)
    report["assumptions"] = {
        "pcie5_x16_theoretical_Bps": PCIE5_THEORETICAL,
        "pcie5_x16_achieved_Bps": list(PCIE5_ACHIEVED),
        "h200_decode_64_step_s": list(H200_DECODE_64_S),
        "h200_prefill_8192_step_s": list(H200_PREFILL_8192_S),
    }
    report["load_average_at_end"] = load_average()
    report["findings"] = findings(report)
    text = markdown(report)
    print(text)
    if not args.no_write:
        name = "engram_placement_quick" if quick else "engram_placement"
        paths = write_results(name, report, text)
        print("wrote", *paths)


if __name__ == "__main__":
    main()
