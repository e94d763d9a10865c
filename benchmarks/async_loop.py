"""The engine loop with and without overlap scheduling (`--async-scheduling`): the host's share of the decode period
and generated tokens per second, at batch 1 and batch 8.

One runner (the embedded default, float32, one CPU device) is compiled once; every run is an Engine on it, so the
two loops differ in nothing else. Rounds alternate the loops (rotated order) and every number is the median over
rounds, each measured inside its own run:

- loop period: the median time between the ends of consecutive decode steps (the engine's step record);
- device step: the compiled decode call alone on inputs built once (no scheduling, no input building, no
  delivery), waited for each time, measured between the runs; host share: (loop period - device step) / loop
  period, the goal's measure. Below zero, the loop hides even the call's launch, which a step in flight overlaps;
- device pace: the same call 8 times back to back, waited for once, over 8: the device's busy time per step when
  it never waits; idle share: (loop period - device pace) / loop period, the fraction of the period the device
  waits for the host;
- tokens per second: decode tokens over the decode steps' span.

    python benchmarks/async_loop.py [--rounds 7] [--tokens 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from common import configure_jax, machine_info, markdown_table, write_results

GOAL_HOST_SHARE = 0.05  # async
GOAL_SPEEDUP_B8 = 1.12  # async / sync tokens per second at batch 8
PACE_CALLS = 8  # device pace: calls queued before one wait, so their launches overlap the steps before them


def decode_profile(engine) -> tuple[float, float, int]:
    """(median period between decode step ends, decode tokens per second, decode steps) from the step record."""
    from jaxserve.request.step import StepKind

    decodes = [r for r in engine.step_record if r.kind is StepKind.DECODE]
    ends = [r.ended for r in decodes]
    periods = [b - a for a, b in zip(ends, ends[1:])]
    tokens = sum(r.num_tokens for r in decodes[1:])
    return statistics.median(periods), tokens / (ends[-1] - ends[0]), len(decodes)


def run_once(runner, model_cfg, eos, cfg, batch: int, tokens: int) -> dict:
    from jaxserve.engine import Engine
    from jaxserve.request import SamplingParams

    engine = Engine(cfg, model_cfg, runner, eos)
    sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    handles = [engine.submit([5 + i, 6, 7, 8, 9, 10, 11, 12], sampling) for i in range(batch)]
    engine.start()
    try:
        for handle in handles:
            assert handle.wait(timeout=600)[1] == "length"
    finally:
        engine.shutdown()
    period, tok_s, steps = decode_profile(engine)
    return {"period_s": period, "tok_s": tok_s, "decode_steps": steps}


def device_step(runner, batch: int, back_to_back: int, repeats: int = 25) -> float:
    """Median seconds per call of the compiled decode step alone, for `batch` rows, `back_to_back` calls a wait."""
    from jaxserve.request import Request, SamplingParams
    from jaxserve.request.batch import StepBatch
    from jaxserve.request.step import StepPlan

    requests = [
        Request(
            f"d{i}",
            [5, 6, 7, 8],
            SamplingParams(temperature=0.0),
            slot=i,
            num_sampled=1,
            pages=list(range(i * runner.geometry.max_pages_per_seq, (i + 1) * runner.geometry.max_pages_per_seq)),
        )
        for i in range(batch)
    ]
    return statistics.median(runner.device_seconds(StepBatch.of(StepPlan.decode_of(requests)), repeats, back_to_back))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=300, help="tokens each request generates")
    args = parser.parse_args()
    configure_jax(devices=1)
    import dataclasses

    import jax

    from jaxserve.checkpoints.load import load_model
    from jaxserve.config import EngineConfig
    from jaxserve.model.sharding import make_mesh
    from jaxserve.runner import build_runner

    mesh = make_mesh(1, 1)
    loaded = load_model(None, mesh, dtype="float32")
    base = EngineConfig(
        dtype="float32",
        max_num_seqs=8,
        chunked_prefill_size=64,
        max_prefill_rows=8,
        page_size=16,
        max_model_len=512,
        decode_log_interval=10**9,
    )
    runner = build_runner(base, loaded.config, loaded.weights, mesh)
    runner.warmup()
    modes = {
        "sync": dataclasses.replace(base, async_scheduling=False),
        "async": dataclasses.replace(base, async_scheduling=True),
    }
    runs: dict[tuple[str, int], list[dict]] = {(m, b): [] for m in modes for b in (1, 8)}
    devices: dict[int, list[float]] = {1: [], 8: []}
    paces: dict[int, list[float]] = {1: [], 8: []}
    for r in range(args.rounds):
        order = list(modes) if r % 2 == 0 else list(modes)[::-1]
        for batch in (1, 8):
            for mode in order:
                runs[(mode, batch)].append(
                    run_once(runner, loaded.config, loaded.tokenizer.eos_ids, modes[mode], batch, args.tokens)
                )
            devices[batch].append(device_step(runner, batch, 1))
            paces[batch].append(device_step(runner, batch, PACE_CALLS))
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{m} b{b} {runs[(m, b)][-1]['tok_s']:.0f} tok/s" for m, b in runs),
            flush=True,
        )

    rows, data = (
        [],
        {
            "machine": machine_info(),
            "backend": jax.default_backend(),
            "rounds": args.rounds,
            "tokens_per_request": args.tokens,
            "results": {},
        },
    )
    for (mode, batch), results in runs.items():
        device, pace = statistics.median(devices[batch]), statistics.median(paces[batch])
        shares = [(x["period_s"] - device) / x["period_s"] for x in results]
        idle = [(x["period_s"] - pace) / x["period_s"] for x in results]
        tok_s = [x["tok_s"] for x in results]
        entry = {
            "device_step_ms": 1e3 * device,
            "device_pace_ms": 1e3 * pace,
            "period_ms": 1e3 * statistics.median(x["period_s"] for x in results),
            "host_share": statistics.median(shares),
            "host_share_range": [min(shares), max(shares)],
            "idle_share": statistics.median(idle),
            "idle_share_range": [min(idle), max(idle)],
            "tok_s": statistics.median(tok_s),
            "tok_s_range": [min(tok_s), max(tok_s)],
        }
        data["results"][f"{mode}_b{batch}"] = entry
        rows.append(
            [
                mode,
                batch,
                f"{entry['device_step_ms']:.2f}",
                f"{entry['device_pace_ms']:.2f}",
                f"{entry['period_ms']:.2f}",
                f"{entry['host_share']:.1%} ({min(shares):.1%} .. {max(shares):.1%})",
                f"{entry['idle_share']:.1%} ({min(idle):.1%} .. {max(idle):.1%})",
                f"{entry['tok_s']:.0f} ({min(tok_s):.0f} .. {max(tok_s):.0f})",
            ]
        )
    # Paired by round: each async run against the sync run of the same round and batch.
    checks = []
    for batch in (1, 8):
        ratios = [a["tok_s"] / s["tok_s"] for a, s in zip(runs[("async", batch)], runs[("sync", batch)])]
        data["results"][f"speedup_b{batch}"] = {
            "median": statistics.median(ratios),
            "range": [min(ratios), max(ratios)],
        }
        checks.append(
            f"batch {batch}: async / sync tokens per second {statistics.median(ratios):.2f}x "
            f"(rounds {min(ratios):.2f} .. {max(ratios):.2f})"
        )
    share = {b: data["results"][f"async_b{b}"]["host_share"] for b in (1, 8)}
    speedup = data["results"]["speedup_b8"]["median"]
    checks += [
        f"{'ok  ' if share[b] <= GOAL_HOST_SHARE else 'FAIL'} async host share at batch {b}: {share[b]:.1%} "
        f"(<= {GOAL_HOST_SHARE:.0%})"
        for b in (1, 8)
    ]
    checks.append(
        f"{'ok  ' if speedup >= GOAL_SPEEDUP_B8 else 'FAIL'} batch 8 async / sync: {speedup:.2f}x "
        f"(>= {GOAL_SPEEDUP_B8})"
    )
    table = markdown_table(
        [
            "loop",
            "batch",
            "device step ms",
            "device pace ms",
            "loop period ms",
            "host share (range)",
            "device idle share (range)",
            "tok/s (range)",
        ],
        rows,
    )
    markdown = table + "\n\n" + "\n".join(f"- {c}" for c in checks)
    print(markdown)
    backend = jax.default_backend()
    write_results("async_loop" if backend == "cpu" else f"async_loop_{backend}", data, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
