"""Issue 28: MTP speculative decoding on the trained embedded default, on CPU: decode tokens per second with and
without drafts (k = 1, 2, 3) at batch 1 and 8, and the acceptance rate per draft position.

Every configuration gets its own compiled runner on the same weights; rounds alternate the configurations (one
round: each configuration generates the same greedy completions once), so drift of the machine lands in every
configuration alike. Decode tokens per second = tokens generated after each request's first / the time from the
batch's last first token to its last token (prefill is not in it). Reported: the median over rounds, min and max,
and each k's ratio to no drafts. Greedy outputs are checked to be identical across configurations.

    .venv/bin/python benchmarks/speculative.py             # 5 rounds, 64 tokens per request
    .venv/bin/python benchmarks/speculative.py --quick     # 2 rounds, 24 tokens
"""

from __future__ import annotations

import argparse
import dataclasses

from common import configure_jax, load_average, machine_info, markdown_table, median, write_results

GOAL_BATCH_1 = 1.3  # the bar: decode tok/s with drafts / without, at batch 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--tokens", type=int)
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    max_tokens = args.tokens or (24 if args.quick else 64)
    configure_jax(1)

    from jaxserve.checkpoints.load import load_model
    from jaxserve.config import EngineConfig, SpeculativeConfig
    from jaxserve.engine import Engine
    from jaxserve.model.sharding import make_mesh
    from jaxserve.request import SamplingParams
    from jaxserve.request.step import StepKind
    from jaxserve.runner import build_runner
    from training.default_model import SAMPLE_PROMPTS

    base = EngineConfig(
        dtype="float32",
        max_num_seqs=8,
        chunked_prefill_size=64,
        max_prefill_rows=1,
        page_size=16,
        max_model_len=512,
        mixed_batches=False,  # prefill first, then decode-only steps, with and without drafts alike
    )
    mesh = make_mesh(1, 1)
    loaded = load_model(None, mesh, dtype=base.dtype, drafter="mtp")
    ks = (None, 1, 2, 3)
    configs = {k: dataclasses.replace(base, speculative_config=k and SpeculativeConfig("mtp", k)) for k in ks}
    runners = {}
    for k, cfg in configs.items():
        runners[k] = build_runner(cfg, loaded.config, loaded.weights, mesh)
        runners[k].warmup()
    prompts = [loaded.tokenizer.encode(p) for p in SAMPLE_PROMPTS]
    load_before = load_average()

    def run(k, batch: int):
        """(decode tok/s, outputs, draft stats) of one batch of greedy requests."""
        engine = Engine(configs[k], loaded.config, runners[k], loaded.tokenizer.eos_ids).start()
        try:
            greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            handles = [engine.submit(p, greedy) for p in prompts[:batch]]
            outputs = [handle.wait(300)[0] for handle in handles]
            # The decode window as the engine's step record stamps it: from the first decode step's start (every
            # prompt is prefilled by then: prefill comes first and carries no decode rows) to the last one's end.
            steps = [s for s in engine.step_record if s.kind is StepKind.DECODE]
            window = steps[-1].ended - steps[0].started
            generated = sum(len(t) - 1 for t in outputs)
            return generated / window, outputs, engine.stats().drafts
        finally:
            engine.shutdown()

    results = {}
    for batch in (1, 8):
        speeds: dict = {k: [] for k in ks}
        drafts: dict = {}
        reference = None
        for _ in range(rounds):
            for k in ks:
                speed, outputs, stats = run(k, batch)
                speeds[k].append(speed)
                drafts[k] = stats
                if reference is None:
                    reference = outputs
                assert outputs == reference, f"k={k} batch={batch}: greedy outputs differ from the first run's"
        results[batch] = {
            str(k): {
                "tok_s_median": round(median(speeds[k]), 1),
                "tok_s_min": round(min(speeds[k]), 1),
                "tok_s_max": round(max(speeds[k]), 1),
                "ratio_to_no_drafts": round(median(speeds[k]) / median(speeds[None]), 3),
                "acceptance_rate": round(drafts[k].acceptance_rate, 3),
                "acceptance_per_position": [
                    round(n / drafts[k].drafts, 3) if drafts[k].drafts else 0.0 for n in drafts[k].accepted_per_position
                ],
            }
            for k in ks
        }
    data = {
        "machine": machine_info(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "rounds": rounds,
        "max_tokens": max_tokens,
        "results": results,
        "goal_batch_1": GOAL_BATCH_1,
        "batch_1_meets_goal": max(results[1][str(k)]["ratio_to_no_drafts"] for k in (1, 2, 3)) >= GOAL_BATCH_1,
    }
    rows = []
    for batch, by_k in results.items():
        for k, r in by_k.items():
            label = "none" if k == "None" else k
            rows.append(
                [
                    batch,
                    label,
                    r["tok_s_median"],
                    f"{r['tok_s_min']} .. {r['tok_s_max']}",
                    r["ratio_to_no_drafts"],
                    r["acceptance_rate"],
                    ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"]) or "-",
                ]
            )
    markdown = (
        "# MTP speculative decoding on the trained default (CPU)\n\n"
        f"`python benchmarks/speculative.py`: {rounds} rounds, {max_tokens} greedy tokens per request, rounds "
        "alternate the configurations; decode tok/s is generated tokens after the first over the decode steps' "
        "time. Acceptance per position: the share of verify rows whose draft at that position was kept.\n\n"
        + markdown_table(
            ["batch", "drafts k", "decode tok/s (median)", "min .. max", "x no drafts", "acceptance", "per position"],
            rows,
        )
        + f"\n\nGoal at batch 1: >= {GOAL_BATCH_1}x; met: {data['batch_1_meets_goal']}. Load average "
        f"{load_before} before, {data['load_average_after']} after; {data['machine']['cpu_cores']} CPU cores.\n"
    )
    print(markdown)
    write_results("speculative", data, markdown)


if __name__ == "__main__":
    main()
