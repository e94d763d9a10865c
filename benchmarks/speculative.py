"""Speculative decoding on the trained embedded default, as a client sees it (CPU): no drafts, MTP k = 1..3 and
DSpark N = 3..7 (its drafter trained by training/train_dspark.py), at batch 1 and 8.

One real `jaxserve serve` process per configuration (benchmarks/serving.py), all started up front on the same
flags but --speculative-config; the client streams greedy completions through HTTP and stamps every chunk as it
arrives. Rounds alternate the configurations (one round: each configuration serves the same requests once; at batch
1 each of the eight prompts alone, the configurations taking turns request by request), so drift of the machine lands
on every configuration alike. Per configuration and batch:
- decode tok/s per stream: tokens after the first chunk / the time from the first chunk to the last (what one user
  sees), the median over the streams of all rounds, and its min .. max over rounds (each round's median);
- request seconds: from sending to the last chunk, the median;
- acceptance length: 1 + accepted drafts / verify rows that carried drafts (vLLM's mean acceptance length), from the
  server's own /metrics counters over the whole run; and the acceptance per draft position.
Greedy outputs are checked to be identical across configurations.

    .venv/bin/python benchmarks/speculative.py             # 4 rounds, 128 tokens per request
    .venv/bin/python benchmarks/speculative.py --quick     # 2 rounds, 48 tokens
"""

from __future__ import annotations

import argparse
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from common import configure_jax, load_average, machine_info, markdown_table, median, write_results
from serving import Server, streamed_tokens

GOALS = {"dspark_over_mtp": 1.2, "dspark_over_none": 1.5}  # the bars at batch 1 (DSpark's best over each)
FLAGS = ["--dtype", "float32", "--max-num-seqs", "8", "--chunked-prefill-size", "64", "--max-prefill-rows", "1"]
FLAGS += ["--page-size", "16", "--max-model-len", "512", "--decode-log-interval", "1000", "--log-stats-interval", "0"]
CONFIGS = (
    {"none": None} | {f"mtp {k}": ("mtp", k) for k in (1, 2, 3)} | {f"dspark {n}": ("dspark", n) for n in range(3, 8)}
)
COUNTER = re.compile(r"^jaxserve:spec_decode_num_(\w+)_total\{([^}]*)\} ([0-9.e+]+)$")


def counters(url: str) -> dict[str, float]:
    """The server's speculative-decoding counters: drafts, accepted_tokens, and pos<i> (accepted at position i)."""
    found: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if m := COUNTER.match(line):
            position = re.search(r'position="(\d+)"', m.group(2))
            found[m.group(1) if position is None else f"pos{position.group(1)}"] = float(m.group(3))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--tokens", type=int)
    parser.add_argument(
        "--configs", nargs="+", choices=list(CONFIGS), help="a subset with none, an mtp and a dspark (printed only)"
    )
    args = parser.parse_args()
    if args.configs is not None and not all(
        any(c.startswith(m) for c in args.configs) for m in ("none", "mtp", "dspark")
    ):
        parser.error(
            "--configs: the ratios compare DSpark's best with MTP's and with none: name 'none', an mtp and a dspark"
        )
    configs = {name: CONFIGS[name] for name in args.configs or CONFIGS}
    rounds = args.rounds or (2 if args.quick else 4)
    max_tokens = args.tokens or (48 if args.quick else 128)
    configure_jax(1, compile_cache=False)  # this process only tokenizes (and finds the repository's modules)

    from jaxserve.checkpoints import default_checkpoint_path
    from jaxserve.text.tokenizer import load_tokenizer
    from training.default_model import SAMPLE_PROMPTS

    tokenizer = load_tokenizer(default_checkpoint_path())
    prompts = [tokenizer.encode(p) for p in SAMPLE_PROMPTS]
    load_before = load_average()
    servers = {}
    runs: dict = {(name, batch): [] for name in configs for batch in (1, 8)}  # a round's streams: (sent, chunks) each
    drafts: dict = {(name, batch): {} for name in configs for batch in (1, 8)}  # counters summed over the rounds
    # Batch 1 serves every prompt alone in turn, the configurations alternating request by request (so drift between
    # two requests lands on every configuration alike); batch 8 serves the eight prompts at once.
    groups = {1: [[prompt] for prompt in prompts], 8: [prompts]}
    try:
        for name, spec in configs.items():
            print(f"starting jaxserve serve ({name})", flush=True)
            method = (
                []
                if spec is None
                else ["--speculative-config", json.dumps(dict(zip(("method", "num_speculative_tokens"), spec)))]
            )
            servers[name] = Server(FLAGS + method)
            streamed_tokens(servers[name].url, prompts[0], 8)  # the HTTP path's first call
        for r in range(rounds):
            order = list(configs)[r % len(configs) :] + list(configs)[: r % len(configs)]
            for batch in (1, 8):
                before = {name: counters(servers[name].url) for name in order}
                for name in order:
                    runs[name, batch].append([])
                for group in groups[batch]:
                    for name in order:
                        sent = time.perf_counter()
                        with ThreadPoolExecutor(len(group)) as pool:
                            streams = list(
                                pool.map(lambda p, u=servers[name].url: streamed_tokens(u, p, max_tokens), group)
                            )
                        runs[name, batch][-1] += [(sent, chunks) for chunks in streams]
                for name in order:  # each server served only this batch's requests since `before`
                    for key, value in counters(servers[name].url).items():
                        drafts[name, batch][key] = drafts[name, batch].get(key, 0) + value - before[name].get(key, 0)
            print(f"round {r + 1} of {rounds} done", flush=True)
    finally:
        for server in servers.values():
            server.stop()

    def tokens(streams) -> list[list[int]]:
        return [[t for _, ids in chunks for t in ids] for _, chunks in streams]

    results: dict = {}
    for batch in (1, 8):
        expected = tokens(runs["none", batch][0])
        assert all(len(t) == max_tokens for t in expected)
        for name in configs:
            for streams in runs[name, batch]:
                assert tokens(streams) == expected, f"{name} batch {batch}: greedy tokens differ from no drafts'"
        speeds = {
            name: [[decode_speed(chunks) for _, chunks in streams] for streams in runs[name, batch]] for name in configs
        }
        base = median([s for round_speeds in speeds["none"] for s in round_speeds])
        results[batch] = {}
        for name, spec in configs.items():
            every = [s for round_speeds in speeds[name] for s in round_speeds]
            per_round = [median(round_speeds) for round_speeds in speeds[name]]
            counts = drafts[name, batch]
            verify_rows = counts.get("drafts", 0)
            k = 0 if spec is None else spec[1]
            results[batch][name] = {
                "decode_tok_s_per_stream": round(median(every), 1),
                "round_medians": [round(x, 1) for x in per_round],
                "ratio_to_no_drafts": round(median(every) / base, 3),
                "request_s": round(
                    median([chunks[-1][0] - sent for streams in runs[name, batch] for sent, chunks in streams]), 3
                ),
                "acceptance_length": round(1 + counts.get("accepted_tokens", 0) / verify_rows, 3)
                if verify_rows
                else 1.0,
                "acceptance_per_position": [round(counts.get(f"pos{i}", 0) / verify_rows, 3) for i in range(k)]
                if verify_rows
                else [],
            }
    best = {
        method: max(r["decode_tok_s_per_stream"] for n, r in results[1].items() if n.startswith(method))
        for method in ("mtp", "dspark")
    }
    met = {
        "dspark_over_mtp": round(best["dspark"] / best["mtp"], 3),
        "dspark_over_none": round(best["dspark"] / results[1]["none"]["decode_tok_s_per_stream"], 3),
    }
    data = {
        "machine": machine_info(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "rounds": rounds,
        "max_tokens": max_tokens,
        "flags": FLAGS,
        "results": results,
        "batch_1_best_ratios": met,
        "goals": GOALS,
    }
    rows = [
        [batch, name, r["decode_tok_s_per_stream"], ", ".join(map(str, r["round_medians"])), r["ratio_to_no_drafts"],
         r["request_s"], r["acceptance_length"], ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"]) or "-"]
        for batch, by_name in results.items()
        for name, r in by_name.items()
    ]  # fmt: skip
    markdown = (
        "# Speculative decoding on the trained default, as a client sees it (CPU)\n\n"
        f"`python benchmarks/speculative.py`: one `jaxserve serve` per configuration ({' '.join(FLAGS)} and its "
        f"--speculative-config), {rounds} rounds alternating them, {max_tokens} greedy tokens per request streamed "
        "through HTTP (batch 1: each of the eight prompts alone, the configurations taking turns request by request; "
        "batch 8: the eight at once). Decode tok/s per stream: tokens after the first chunk over the time from the "
        "first chunk to the last, median over every stream of every round (then each round's median); request s: "
        "sending to the last chunk, median; acceptance length: 1 + accepted drafts / verify rows (the server's "
        "/metrics), and the share of verify rows that kept the draft at each position.\n\n"
        + markdown_table(
            [
                "batch",
                "drafts",
                "decode tok/s per stream",
                "round medians",
                "x no drafts",
                "request s",
                "acceptance length",
                "per position",
            ],
            rows,
        )  # fmt: skip
        + f"\n\nAt batch 1, DSpark's best over MTP's best: {met['dspark_over_mtp']}x "
        f"(goal {GOALS['dspark_over_mtp']}x); "
        f"over no drafts: {met['dspark_over_none']}x (goal {GOALS['dspark_over_none']}x). Load average {load_before} "
        f"before, {data['load_average_after']} after; {data['machine']['cpu_cores']} CPU cores.\n"
    )
    print(markdown)
    if args.configs is None:  # the results file holds whole runs only
        write_results("speculative", data, markdown)


def decode_speed(chunks: list[tuple[float, list[int]]]) -> float:
    """A stream's tokens after its first chunk over the time from its first chunk to its last."""
    return sum(len(ids) for _, ids in chunks[1:]) / (chunks[-1][0] - chunks[0][0])


if __name__ == "__main__":
    main()
