"""The host cost of structured outputs' token masks: decode at batch 8 with no row constrained against half the rows
constrained, in the overlapped loop (the default).

One runner (the embedded default, float32, one CPU device) is compiled once; every run is an Engine on it. A
constrained row follows a regex that cannot end before max_tokens (so it never stops early and every step computes
its mask). Rounds alternate the two workloads (rotated order); every number is the median over rounds:

- tok/s: decode tokens over the decode steps' span (all rows);
- period: the median time between the ends of consecutive decode steps: every running row gets one token a step,
  so this is also the unconstrained rows' time per token when they share steps with constrained ones;
- mask us: the host's time per constrained row per step to compute its mask (GrammarMatcher.fill_mask, timed in
  the run).

    python benchmarks/structured.py [--rounds 5] [--tokens 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from async_loop import decode_profile
from common import configure_jax, machine_info, markdown_table, write_results

BATCH = 8
GOAL_RATIO = 0.85  # half constrained / unconstrained decode tok/s
# Longer than any run (8 characters a token at most): never complete, so EOS is never allowed and every step masks.
REGEX = "[a-z ,.]{1600}"


def run_once(runner, model_cfg, tokenizer, cfg, constrained: int, tokens: int, mask_seconds: list[float]) -> dict:
    from jaxserve.engine import Engine
    from jaxserve.request import SamplingParams
    from jaxserve.request.grammar import Constraint, ConstraintKind, GrammarMatcher

    engine = Engine(cfg, model_cfg, runner, tokenizer.eos_ids, tokenizer.grammar_compiler(model_cfg.vocab_size))
    regex = Constraint(ConstraintKind.REGEX, REGEX, "guided_regex")
    handles = []
    for i in range(BATCH):
        sampling = SamplingParams(
            max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True, constraint=regex if i < constrained else None
        )
        handles.append(engine.submit([5 + i, 6, 7, 8, 9, 10, 11, 12], sampling))
    fill_mask = GrammarMatcher.fill_mask
    GrammarMatcher.fill_mask = _timed(fill_mask, mask_seconds)  # type: ignore[method-assign]  # each mask asked
    engine.start()
    try:
        for handle in handles:
            _, reason, error = handle.wait(timeout=600)
            assert reason == "length", (reason, error)
    finally:
        engine.shutdown()
        GrammarMatcher.fill_mask = fill_mask  # type: ignore[method-assign]
    period, tok_s, steps = decode_profile(engine)
    return {"period_s": period, "tok_s": tok_s, "decode_steps": steps}


def _timed(fill, seconds: list[float]):
    def timed(matcher, words) -> None:
        started = time.perf_counter()
        fill(matcher, words)
        seconds.append(time.perf_counter() - started)

    return timed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=200, help="tokens each request generates")
    args = parser.parse_args()
    configure_jax(devices=1)
    import jax

    from jaxserve.checkpoints.load import load_model
    from jaxserve.config import EngineConfig
    from jaxserve.model.sharding import make_mesh
    from jaxserve.runner import build_runner

    mesh = make_mesh(1, 1)
    loaded = load_model(None, mesh, dtype="float32")
    cfg = EngineConfig(
        dtype="float32",
        max_num_seqs=BATCH,
        chunked_prefill_size=64,
        max_prefill_rows=BATCH,
        page_size=16,
        max_model_len=512,
        decode_log_interval=10**9,
    )
    runner = build_runner(cfg, loaded.config, loaded.weights, mesh)
    runner.warmup()
    workloads = {"none constrained": 0, "half constrained": BATCH // 2}
    runs: dict[str, list[dict]] = {name: [] for name in workloads}
    masks: list[float] = []
    for r in range(args.rounds):
        order = list(workloads) if r % 2 == 0 else list(workloads)[::-1]
        for name in order:
            runs[name].append(
                run_once(runner, loaded.config, loaded.tokenizer, cfg, workloads[name], args.tokens, masks)
            )
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {runs[n][-1]['tok_s']:.0f} tok/s" for n in runs))
    ratios = [h["tok_s"] / n["tok_s"] for h, n in zip(runs["half constrained"], runs["none constrained"])]
    period_ratios = [h["period_s"] / n["period_s"] for h, n in zip(runs["half constrained"], runs["none constrained"])]
    data: dict = {"machine": machine_info(), "backend": jax.default_backend(), "rounds": args.rounds, "results": {}}
    rows = []
    for name, results in runs.items():
        tok_s, periods = [x["tok_s"] for x in results], [x["period_s"] for x in results]
        data["results"][name] = {
            "tok_s": statistics.median(tok_s),
            "tok_s_range": [min(tok_s), max(tok_s)],
            "period_ms": 1e3 * statistics.median(periods),
        }
        rows.append(
            [
                name,
                workloads[name],
                f"{statistics.median(tok_s):.0f} ({min(tok_s):.0f} .. {max(tok_s):.0f})",
                f"{1e3 * statistics.median(periods):.2f}",
            ]
        )
    ratio, period_ratio = statistics.median(ratios), statistics.median(period_ratios)
    mask_us = 1e6 * statistics.median(masks)
    data["results"].update(
        tok_s_ratio=ratio, tok_s_ratio_range=[min(ratios), max(ratios)], period_ratio=period_ratio, mask_us=mask_us
    )
    checks = [
        f"{'ok  ' if ratio >= GOAL_RATIO else 'FAIL'} half constrained / none: decode tok/s {ratio:.3f}x "
        f"(rounds {min(ratios):.3f} .. {max(ratios):.3f}; >= {GOAL_RATIO})",
        f"info unconstrained rows' time per token sharing steps with constrained ones: {period_ratio:.3f}x "
        f"(rounds {min(period_ratios):.3f} .. {max(period_ratios):.3f})",
        f"info host time per mask: {mask_us:.1f} us median over {len(masks)} masks",
    ]
    markdown = (
        markdown_table(["workload", "constrained rows", "decode tok/s (range)", "decode period ms"], rows)
        + "\n\n"
        + "\n".join(f"- {c}" for c in checks)
    )
    print(markdown)
    write_results("structured", data, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
