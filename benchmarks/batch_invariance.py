"""How far a request's output is from batch-invariant today (issue #44): the embedded default on CPU, each of a few
seeded requests (greedy and sampled, with logprobs) served alone, then all of them at once with some other requests
(mixed steps on, then off), and alone with another chunk size; how many of its tokens and of its sampled tokens'
logprobs come out bitwise the same as alone.

    .venv/bin/python benchmarks/batch_invariance.py      # about 3 minutes on 2 cores

A request's logprobs are compared where its tokens still agree with its run alone (after a token differs, the rest
is another continuation). Writes benchmarks/results/batch_invariance.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses

from common import configure_jax, machine_info, markdown_table, write_results

TARGETS = 6  # half greedy, half sampled
MAX_TOKENS = 24
OTHERS = (1, 3, 7)


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

        key = (cfg.chunked_prefill_size, cfg.mixed_steps)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    configure_jax(1)

    import numpy as np

    from jaxserve.checkpoints.load import load_model
    from jaxserve.config import EngineConfig
    from jaxserve.model.sharding import make_mesh
    from jaxserve.request import SamplingParams

    rng = np.random.default_rng(0)
    rows, data = [], {"machine": machine_info(), "targets": TARGETS, "max_tokens": MAX_TOKENS, "rows": []}
    for dtype in args.dtypes.split(","):
        loaded = load_model(None, make_mesh(1, 1), dtype=dtype)
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
            dtype=dtype, max_num_seqs=8, chunked_prefill_size=64, page_size=16, max_model_len=256,
            decode_log_interval=10**6, enable_prefix_caching=False,
        )  # fmt: skip
        server = Server(loaded)
        serve = server.serve

        alone = [serve(base, [target])[0] for target in targets]
        settings = {f"all {TARGETS} at once with {n} more": (base, n) for n in OTHERS}
        settings[f"all {TARGETS} at once with 7 more, mixed steps off"] = (
            dataclasses.replace(base, mixed_batches=False),
            7,
        )
        settings["alone, chunks of 16"] = (dataclasses.replace(base, chunked_prefill_size=16), 0)
        for name, (cfg, n) in settings.items():
            if n:
                # The targets spread among the others, so each has different neighbours and positions in the batch.
                specs = others[:n] + targets
                got = serve(cfg, specs)[n:]
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
            row = dict(
                dtype=dtype, setting=name, same_tokens=same_tokens, positions=agreeing, bitwise_equal=equal,
                max_abs_diff=worst,
            )  # fmt: skip
            data["rows"].append(row)
            rows.append([dtype, name, f"{same_tokens} of {TARGETS}", f"{equal} of {agreeing}", f"{worst:.2e}"])
            print(rows[-1], flush=True)

    markdown = (
        "# Batch invariance today (CPU, the embedded default)\n\n"
        f"`python benchmarks/batch_invariance.py`: {TARGETS} seeded requests (half greedy, half sampled at 0.8, "
        f"{MAX_TOKENS} tokens, logprobs) each served alone, then as below; a request's sampled tokens' logprobs are "
        "compared with its run alone where its tokens still agree.\n\n"
        + markdown_table(
            ["dtype", "served", "requests with the same tokens", "logprobs bitwise as alone", "largest difference"],
            rows,
        )
        + "\n\nBitwise equality is what batch-invariant serving (issue #44) must reach in every row.\n"
    )
    write_results("batch_invariance", data, markdown)


if __name__ == "__main__":
    main()
