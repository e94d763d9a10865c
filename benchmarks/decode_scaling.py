"""Issue 3: how decode step time grows with context, and prefill chunk time with chunk size, on the `small`
preset (float32, random weights), on one CPU device and on the 8-device fake CPU mesh.

Contexts are reached honestly: each sequence's KV state is filled by prefill chunks through the ModelRunner.
Two cache geometries are compared, because jaxserve's attention reads a row's whole page table every step
(every page up to max_pages_per_seq, masked by position), so decode cost follows the geometry, not the context:
  (a) one geometry sized for the largest context, sequences filled to each context in it;
  (b) a geometry sized to each context.
Every decode measurement of one device count is interleaved round-robin with the others.

Each device count runs in its own process (XLA reads the fake device count once, at start-up). The 8 fake
devices share the same 2 cores, so the 8-device numbers measure the cost of the sharded program (collectives,
per-device dispatch, smaller per-device matmuls), not a speed-up.

    .venv/bin/python benchmarks/decode_scaling.py            # both device counts; 1K, 8K, 32K
    .venv/bin/python benchmarks/decode_scaling.py --quick    # 1K and 4K, fewer chunk sizes and repeats
    .venv/bin/python benchmarks/decode_scaling.py --devices 8 --contexts 1024,8192
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import (
    REPO,
    RESULTS,
    alternate,
    configure_jax,
    decode_step,
    geometry,
    load_average,
    machine_info,
    make_runner,
    markdown_table,
    median,
    prefill_step,
    slot_request,
    spread,
    timed,
    write_results,
)

GOAL_RATIO = 2.0  # decode t(largest context) / t(smallest context)


def fill(runner, geo, slot: int, tokens, start: int, end: int, chunk: int) -> list[dict]:
    """Prefill tokens[start:end] into `slot` in chunks of at most `chunk`; the time of each chunk."""
    request = slot_request(geo, slot, tokens[:end])
    record = []
    for pos in range(start, end, chunk):
        n = min(chunk, end - pos)
        seconds = timed(lambda pos=pos, n=n: prefill_step(runner, request, pos, n))
        record.append({"position": pos, "tokens": n, "s": round(seconds, 4)})
    return record


class Sequence:
    """A filled sequence in a runner slot, advanced one greedy decode step per call."""

    def __init__(self, runner, geo, slot: int, tokens):
        # The filled tokens, then token 1 as the first output: the first step decodes at position len(tokens).
        self.runner, self.request = runner, slot_request(geo, slot, tokens, output=[1])

    def step(self) -> None:
        decode_step(self.runner, [self.request])


def measure(
    devices: int, contexts: list[int], chunks: list[int], fill_chunk: int, repeats: int, steps: int, tp: int, ep: int
) -> dict:
    """Everything for one device count (run in a process configured for it)."""
    configure_jax(devices=devices)
    import jax
    import numpy as np

    from jaxserve.model.sharding import make_mesh
    from jaxserve.model.weights import init_weights
    from jaxserve.presets import preset

    cfg = preset("small", dtype="float32")
    weights = init_weights(jax.random.key(0), cfg)
    mesh = make_mesh(1, 1) if devices == 1 else make_mesh(tp, ep)
    margin = repeats * steps + 8  # decode steps past each context
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, max(contexts) + margin)
    out = {"devices": devices, "mesh": dict(mesh.shape), "machine": machine_info(), "compile_s": {}, "fill": {}}
    log = lambda msg: print(f"[{devices} device{'s' * (devices > 1)}] {msg}", flush=True)  # noqa: E731

    # (a) one geometry for the largest context, a slot per context; (b) a geometry per smaller context (the
    # largest one is (a)'s). Each has a spare slot for timing prefill chunks; all compile every chunk size.
    big = max(contexts)
    buckets = tuple(sorted(set(chunks) | {fill_chunk}))
    setups = {"a": (geometry(cfg, len(contexts) + 1, big + margin), list(contexts))}
    setups |= {f"b/{ctx}": (geometry(cfg, 2, ctx + margin), [ctx]) for ctx in contexts if ctx != big}
    sequences, chunk_calls = {}, {}
    out["geometry_pages"] = {}
    for name, (geo, filled) in setups.items():
        runner, out["compile_s"][name] = make_runner(cfg, weights, geo, mesh, buckets, (1,))
        out["geometry_pages"][name] = pages = geo.max_pages_per_seq
        out["page_size"] = geo.page_size
        log(
            f"geometry {name}: {pages} pages of {geo.page_size} tokens per sequence, compiled in "
            f"{out['compile_s'][name]:.1f} s"
        )
        for slot, ctx in enumerate(filled):
            key = f"{name[0]}/{ctx}"
            out["fill"][key] = fill(runner, geo, slot, tokens, 0, ctx, fill_chunk)
            sequences[key] = Sequence(runner, geo, slot, tokens[:ctx])
            log(f"{key}: filled {ctx} tokens in {sum(c['s'] for c in out['fill'][key]):.1f} s")
        spare = len(filled)  # a fresh sequence at position 0
        for size in chunks:
            request = slot_request(geo, spare, tokens[:size])  # a fresh sequence at position 0
            chunk_calls[f"{pages}/{size}"] = lambda runner=runner, request=request, size=size: prefill_step(
                runner, request, 0, size
            )

    for seq in sequences.values():  # warm-up step, untimed
        seq.step()
    log(f"timing decode: {repeats} rounds x {steps} steps, {len(sequences)} sequences interleaved")
    decode = alternate({name: seq.step for name, seq in sequences.items()}, repeats, calls=steps)
    out["decode"] = {name: spread(times) for name, times in decode.items()}
    out["decode"][f"b/{big}"] = out["decode"][f"a/{big}"]

    for call in chunk_calls.values():  # warm-up
        call()
    log(f"timing prefill chunks {chunks} in geometries of {sorted(out['geometry_pages'].values())} pages")
    prefill = alternate(chunk_calls, max(2, repeats // 2))
    out["prefill_chunk"] = {
        key: spread(times) | {"tokens_per_s": round(int(key.split("/")[1]) / median(times), 1)}
        for key, times in prefill.items()
    }
    out["machine"]["load_average_1min_at_end"] = load_average()
    return out


def run_child(devices: int, args: argparse.Namespace) -> dict:
    """Run `measure` for one device count in a fresh interpreter; its JSON comes back through a file."""
    with tempfile.TemporaryDirectory() as folder:
        target = Path(folder) / "out.json"
        cmd = [
            sys.executable,
            __file__,
            "--devices",
            str(devices),
            "--contexts",
            args.contexts,
            "--chunks",
            args.chunks,
            "--fill-chunk",
            str(args.fill_chunk),
            "--repeats",
            str(args.repeats),
            "--steps",
            str(args.steps),
            "--tp",
            str(args.tp),
            "--ep",
            str(args.ep),
            "--json-out",
            str(target),
        ]
        subprocess.run(cmd, check=True)
        return json.loads(target.read_text())


def chunk_sizes(res: dict) -> list[int]:
    return sorted({int(key.split("/")[1]) for key in res["prefill_chunk"]})


def report(results: list[dict], contexts: list[int]) -> tuple[str, str, str, dict]:
    """Markdown tables (decode, prefill chunk, fill) and the decode ratios largest/smallest context."""
    small, big = min(contexts), max(contexts)
    decode_rows, ratios = [], {}
    for res in results:
        for mode, label in (("a", f"(a) geometry for {big // 1024}K"), ("b", "(b) geometry = context")):
            ms = [res["decode"][f"{mode}/{c}"]["median_ms"] for c in contexts]
            ratio = ms[-1] / ms[0]
            ratios[f"{res['devices']}dev/{mode}"] = round(ratio, 3)
            decode_rows.append([res["devices"], label, *ms, f"{ratio:.2f}"])
    decode_table = markdown_table(
        [
            "devices",
            "cache geometry",
            *[f"decode ms @ {c // 1024}K" for c in contexts],
            f"t({big // 1024}K)/t({small // 1024}K)",
        ],
        decode_rows,
    )
    chunk_rows = []
    for res in results:
        for pages in sorted(set(res["geometry_pages"].values())):
            cells = [res["prefill_chunk"][f"{pages}/{size}"] for size in chunk_sizes(res)]
            chunk_rows.append(
                [
                    res["devices"],
                    f"{pages} pages ({pages * res['page_size']:,} tokens)",
                    *[f"{c['median_ms']:.0f} ms ({c['tokens_per_s']:.0f} tok/s)" for c in cells],
                ]
            )
    chunk_table = markdown_table(
        ["devices", "cache geometry", *[f"chunk {c}" for c in chunk_sizes(results[0])]], chunk_rows
    )
    fill_rows = []
    for res in results:
        record = res["fill"][f"a/{big}"]
        full = [c for c in record if c["tokens"] == record[0]["tokens"]]
        fill_rows.append(
            [
                res["devices"],
                record[0]["tokens"],
                f"{1e3 * full[0]['s']:.0f}",
                f"{1e3 * median([c['s'] for c in full]):.0f}",
                f"{1e3 * full[-1]['s']:.0f}",
            ]
        )
    fill_table = markdown_table(
        [
            "devices",
            "fill chunk",
            "first chunk ms (position 0)",
            "median chunk ms",
            f"last chunk ms (position ~{big // 1024}K)",
        ],
        fill_rows,
    )
    return decode_table, chunk_table, fill_table, ratios


def plot(results: list[dict], contexts: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for res in results:
        for mode, style in (("a", "-o"), ("b", "--s")):
            ms = [res["decode"][f"{mode}/{c}"]["median_ms"] for c in contexts]
            label = f"{res['devices']} dev, " + ("geometry for max context" if mode == "a" else "geometry = context")
            left.plot(contexts, ms, style, label=label)
        sizes = chunk_sizes(res)
        for pages in sorted(set(res["geometry_pages"].values())):
            right.plot(
                sizes,
                [res["prefill_chunk"][f"{pages}/{c}"]["median_ms"] for c in sizes],
                "-o",
                label=f"{res['devices']} dev, {pages} pages",
            )
    left.set(xscale="log", xlabel="context (tokens)", ylabel="decode step (ms)", title="decode step vs context")
    left.set_xticks(contexts, [f"{c // 1024}K" for c in contexts])
    left.set_ylim(bottom=0)
    right.set(
        xscale="log",
        yscale="log",
        xlabel="chunk (tokens)",
        ylabel="prefill chunk (ms)",
        title="prefill chunk time, by cache geometry",
    )
    right.set_xticks(sizes, [str(c) for c in sizes])
    for ax in (left, right):
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("jaxserve `small` preset, float32, CPU (2 cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="contexts 1K and 4K, chunks 256 and 1024, fewer repeats")
    parser.add_argument("--devices", type=int, choices=(1, 8), help="run one device count only (default: both)")
    parser.add_argument("--contexts", default=None, help="comma-separated (default 1024,8192,32768)")
    parser.add_argument("--chunks", default=None, help="prefill chunk sizes (default 256,512,1024,2048)")
    parser.add_argument("--fill-chunk", type=int, default=2048, help="chunk used to fill contexts")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved decode rounds (default 5)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps per round (default 3)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the 8-device mesh")
    parser.add_argument("--ep", type=int, default=4, help="expert-parallel size of the 8-device mesh")
    parser.add_argument("--json-out", help=argparse.SUPPRESS)  # child mode: write this device count's JSON here
    args = parser.parse_args(argv)
    args.contexts = args.contexts or ("1024,4096" if args.quick else "1024,8192,32768")
    args.chunks = args.chunks or ("256,1024" if args.quick else "256,512,1024,2048")
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.steps = args.steps or (2 if args.quick else 3)
    if args.quick and args.fill_chunk == 2048:
        args.fill_chunk = 1024
    contexts = sorted(int(c) for c in args.contexts.split(","))
    chunks = sorted(int(c) for c in args.chunks.split(","))

    if args.json_out:
        res = measure(args.devices, contexts, chunks, args.fill_chunk, args.repeats, args.steps, args.tp, args.ep)
        Path(args.json_out).write_text(json.dumps(res))
        return

    results = [run_child(n, args) for n in ([args.devices] if args.devices else [1, 8])]
    decode_table, chunk_table, fill_table, ratios = report(results, contexts)
    small, big = min(contexts), max(contexts)
    notes = (
        f"Decode: medians of {args.repeats} interleaved rounds x {args.steps} steps (batch 1, greedy, through "
        f"the ModelRunner). Goal t({big // 1024}K)/t({small // 1024}K) <= {GOAL_RATIO:.0f}: "
        + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
        + f". 8 fake devices share the machine's 2 cores (mesh tensor={args.tp} x expert={args.ep}): they "
        "measure the sharded program's overheads, not a speed-up. Prefill chunk: a fresh sequence at position 0 "
        "in each geometry (a spare slot), sizes and geometries interleaved; the fill table shows that a chunk's "
        "cost does not depend on its position, only on the geometry."
    )
    markdown = (
        f"# Decode scaling and prefill chunk time (`small`, float32, CPU)\n\n## Decode step\n\n{decode_table}"
        f"\n\n## Prefill chunk\n\n{chunk_table}\n\n## Filling geometry (a) to {big // 1024}K\n\n{fill_table}"
        f"\n\n{notes}\n\n![decode scaling](decode_scaling.png)\n"
    )
    print("\n" + markdown)
    png = RESULTS / "decode_scaling.png"
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(results, contexts, png)
    paths = write_results(
        "decode_scaling",
        {
            "contexts": contexts,
            "chunks": chunks,
            "fill_chunk": args.fill_chunk,
            "ratios_largest_over_smallest": ratios,
            "goal_ratio": GOAL_RATIO,
            "goal_met": max(ratios.values()) <= GOAL_RATIO,
            "results": results,
        },
        markdown,
    )
    print("wrote " + ", ".join(str(p.relative_to(REPO)) for p in (*paths, png)))


if __name__ == "__main__":
    main()
