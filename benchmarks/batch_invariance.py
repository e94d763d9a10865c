"""Batch-invariant serving (issue #44) on the embedded default, on CPU: how far a request's output is from
batch-invariant with `--batch-invariant` off and on, and what turning it on costs.

Invariance: each of a few seeded requests (greedy and sampled, with logprobs) is served alone, then all of them at
once with some other requests (mixed steps on, then off), and alone with another chunk size; how many of its tokens
and of its sampled tokens' logprobs come out bitwise the same as alone. A request's logprobs are compared where its
tokens still agree with its run alone (after a token differs, the rest is another continuation).

Cost: one runner per setting, each as the engine builds it (batch-invariant decode buckets start at a tile of 16
rows); 64 sequences filled with 128-token prompts; decode steps at batch 1, 8 and 64 and a 256-token prefill chunk,
timed off and on interleaved round by round, medians (and the spread) of the rounds.

    .venv/bin/python benchmarks/batch_invariance.py      # about 15 minutes on 2 cores

Writes benchmarks/results/batch_invariance.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses

from common import (
    alternate,
    configure_jax,
    decode_step,
    geometry,
    machine_info,
    make_runner,
    markdown_table,
    median,
    prefill_step,
    slot_request,
    spread,
    write_results,
)

TARGETS = 6  # half greedy, half sampled
MAX_TOKENS = 24
OTHERS = (1, 3, 7)
DECODE_BATCHES = (1, 8, 64)
PREFILL_CHUNK = 256
PROMPT = 128  # tokens each sequence holds before the decode steps are timed
ROUNDS = 15


class Server:
    """One loaded model's runners (one per chunk size and mixed-step choice, compiled on first use) and the engines
    that serve a batch of requests on them."""

    def __init__(self, loaded):
        self.loaded = loaded
        self.runners: dict = {}

    def serve(self, cfg, specs) -> list[tuple[list[int], list[float]]]:
        """Each request's (tokens, its sampled tokens' logprobs), all submitted at once."""
        from jaxserve.engine import Engine
        from jaxserve.model.sharding import make_mesh
        from jaxserve.runner import build_runner

        key = (cfg.chunked_prefill_size, cfg.mixed_steps, cfg.batch_invariant)
        if key not in self.runners:
            self.runners[key] = build_runner(cfg, self.loaded.config, self.loaded.weights, make_mesh(1, 1))
            self.runners[key].warmup()
        engine = Engine(cfg, self.loaded.config, self.runners[key], self.loaded.tokenizer.eos_ids).start()
        try:
            handles = [engine.submit(p, s, request_id=f"r{i}") for i, (p, s) in enumerate(specs)]
            out = []
            for handle in handles:
                tokens, logprobs = [], []
                for event in handle.sync_events(timeout=300):
                    tokens += event.token_ids
                    logprobs += [entry.logprob for entry in event.logprobs or ()]
                out.append((tokens, logprobs))
            return out
        finally:
            engine.shutdown()


def invariance(loaded, batch_invariant: bool, rng) -> list[dict]:
    """Each setting's agreement of the targets with their runs alone."""
    from jaxserve.config import EngineConfig
    from jaxserve.request import SamplingParams

    vocab = loaded.config.vocab_size
    targets = [
        (
            rng.integers(2, vocab, int(rng.integers(20, 90))).tolist(),
            SamplingParams(
                max_tokens=MAX_TOKENS,
                temperature=0.0 if i < TARGETS // 2 else 0.8,
                seed=100 + i,
                ignore_eos=True,
                logprobs=2,
            ),
        )
        for i in range(TARGETS)
    ]
    others = [
        (
            rng.integers(2, vocab, int(rng.integers(5, 120))).tolist(),
            SamplingParams(max_tokens=int(rng.integers(4, 40)), temperature=0.7, ignore_eos=True),
        )
        for _ in range(max(OTHERS))
    ]
    base = EngineConfig(
        dtype=loaded.config.dtype, max_num_seqs=8, chunked_prefill_size=64, page_size=16, max_model_len=256,
        decode_log_interval=10**6, enable_prefix_caching=False, batch_invariant=batch_invariant,
    )  # fmt: skip
    serve = Server(loaded).serve
    alone = [serve(base, [target])[0] for target in targets]
    settings = {f"all {TARGETS} at once with {n} more": (base, n) for n in OTHERS}
    no_mixed = dataclasses.replace(base, mixed_batches=False)
    settings[f"all {TARGETS} at once with 7 more, mixed steps off"] = (no_mixed, 7)
    settings["alone, chunks of 16"] = (dataclasses.replace(base, chunked_prefill_size=16), 0)
    rows = []
    for name, (cfg, n) in settings.items():
        if n:  # the targets among the others, so each has different neighbours and places in the batch
            got = serve(cfg, others[:n] + targets)[n:]
        else:
            got = [serve(cfg, [target])[0] for target in targets]
        same_tokens = agreeing = equal = 0
        worst = 0.0
        for (want_tokens, want_lp), (tokens, lp) in zip(alone, got, strict=True):
            same_tokens += tokens == want_tokens
            prefix = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b), len(tokens))
            agreeing += prefix
            equal += sum(a == b for a, b in zip(lp[:prefix], want_lp[:prefix]))
            worst = max([worst] + [abs(a - b) for a, b in zip(lp[:prefix], want_lp[:prefix])])
        rows.append(
            dict(
                dtype=loaded.config.dtype,
                batch_invariant=batch_invariant,
                setting=name,
                same_tokens=same_tokens,
                positions=agreeing,
                bitwise_equal=equal,
                max_abs_diff=worst,
            )  # fmt: skip
        )
        print(rows[-1], flush=True)
    return rows


def cost(loaded) -> dict:
    """Decode steps at each of DECODE_BATCHES and a PREFILL_CHUNK-token prefill chunk, off and on, interleaved:
    seconds per call of each round."""
    import numpy as np

    from jaxserve.kernels.tiles import ROW_TILE
    from jaxserve.model.sharding import make_mesh

    cfg, weights = loaded.config, loaded.weights
    slots = max(DECODE_BATCHES)
    geo = geometry(cfg, slots, PROMPT + PREFILL_CHUNK + 4 * ROUNDS * len(DECODE_BATCHES) + 64)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, cfg.vocab_size, PROMPT) for _ in range(slots)]
    chunk = rng.integers(2, cfg.vocab_size, PREFILL_CHUNK)
    calls, compile_s = {}, {}
    for on in (False, True):
        # As the engine buckets them: batch-invariant decode buckets start at a tile (smaller ones would save nothing).
        decode_rows = tuple(sorted({max(b, ROW_TILE) if on else b for b in DECODE_BATCHES}))
        runner, compile_s[on] = make_runner(
            cfg, weights, geo, make_mesh(1, 1), (PROMPT, PREFILL_CHUNK), decode_rows, "reference", batch_invariant=on
        )
        requests = [slot_request(geo, slot, prompts[slot]) for slot in range(slots)]
        for request in requests:
            request.output_ids.append(prefill_step(runner, request, 0, PROMPT))
        fresh = slot_request(geo, 0, chunk)  # re-prefills slot 0's first pages each call (the same work every time)
        mode = "on" if on else "off"
        for b in DECODE_BATCHES:
            calls[f"decode {b} {mode}"] = lambda r=runner, q=requests[:b]: decode_step(r, q)
        calls[f"prefill {PREFILL_CHUNK} {mode}"] = lambda r=runner, q=fresh: prefill_step(r, q, 0, PREFILL_CHUNK)
    for fn in calls.values():  # warm: the first call of each shape after compiling
        fn()
    times = alternate(calls, ROUNDS)
    return {"seconds": times, "compile_s": {("on" if k else "off"): v for k, v in compile_s.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    configure_jax(1)

    import numpy as np

    from jaxserve.checkpoints.load import load_model
    from jaxserve.model.sharding import make_mesh

    data: dict = {"machine": machine_info(), "targets": TARGETS, "max_tokens": MAX_TOKENS, "rows": [], "cost": {}}
    table, cost_rows = [], []
    for dtype in args.dtypes.split(","):
        loaded = load_model(None, make_mesh(1, 1), dtype=dtype)
        measured = cost(loaded)
        data["cost"][dtype] = measured
        seconds = measured["seconds"]
        for b in DECODE_BATCHES:
            off, on = median(seconds[f"decode {b} off"]), median(seconds[f"decode {b} on"])
            ratios = [y / x for x, y in zip(seconds[f"decode {b} off"], seconds[f"decode {b} on"])]
            cost_rows.append(
                [dtype, f"decode, batch {b}", f"{b / off:,.0f} tok/s", f"{b / on:,.0f} tok/s", f"{on / off:.2f}x",
                 f"{min(ratios):.2f}-{max(ratios):.2f}x"]
            )  # fmt: skip
        prefill_off, prefill_on = seconds[f"prefill {PREFILL_CHUNK} off"], seconds[f"prefill {PREFILL_CHUNK} on"]
        off, on = median(prefill_off), median(prefill_on)
        ratios = [y / x for x, y in zip(prefill_off, prefill_on)]
        cost_rows.append(
            [dtype, f"prefill, a {PREFILL_CHUNK}-token chunk", f"{PREFILL_CHUNK / off:,.0f} tok/s",
             f"{PREFILL_CHUNK / on:,.0f} tok/s", f"{on / off:.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}x"]
        )  # fmt: skip
        data["cost"][dtype]["spread_ms"] = {name: spread(values) for name, values in seconds.items()}
        print(cost_rows[-4:], flush=True)
        for batch_invariant in (False, True):
            rows = invariance(loaded, batch_invariant, np.random.default_rng(0))
            data["rows"] += rows
            table += [
                [r["dtype"], "on" if batch_invariant else "off", r["setting"], f"{r['same_tokens']} of {TARGETS}",
                 f"{r['bitwise_equal']} of {r['positions']}", f"{r['max_abs_diff']:.2e}"]
                for r in rows
            ]  # fmt: skip

    markdown = (
        "# Batch-invariant serving (CPU, the embedded default)\n\n"
        f"`python benchmarks/batch_invariance.py`, {data['machine']['cpu_cores']} cores, "
        f"jax {data['machine']['jax']}.\n\n"
        "## Invariance\n\n"
        f"{TARGETS} seeded requests (half greedy, half sampled at 0.8, {MAX_TOKENS} tokens, top-2 logprobs) each "
        "served alone, then as below; a request's sampled tokens' logprobs are compared with its run alone where its "
        "tokens still agree.\n\n"
        + markdown_table(
            [
                "dtype",
                "--batch-invariant",
                "served",
                "requests with the same tokens",
                "logprobs bitwise as alone",
                "largest difference",
            ],
            table,
        )  # fmt: skip
        + "\n\n## Cost\n\n"
        f"The runner's steps, {ROUNDS} rounds each, off and on interleaved; 64 sequences of {PROMPT} tokens; medians, "
        "with the spread of the per-round ratios. Decode batches smaller than a tile run in the 16-row bucket when on "
        "(as the engine buckets them).\n\n"
        + markdown_table(["dtype", "step", "off", "on", "on / off", "per-round ratios"], cost_rows)
        + "\n"
    )
    write_results("batch_invariance", data, markdown)


if __name__ == "__main__":
    main()
