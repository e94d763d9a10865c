"""The prefix cache on multi-turn traces: hit rate and time to first token per turn, with and without it, and the
cost of having it on for a workload that shares nothing.

One runner (the embedded default, float32, one CPU device; its context is 4,096 tokens, pages of 128) is compiled
once; every run is an Engine on it, with --enable-prefix-caching (the default) or --no-enable-prefix-caching.

- chat: a 10-turn conversation on a long system prompt (as long as the context leaves room for the turns), each
  turn the whole conversation so far through DeepSeek-V4's chat encoding plus a new user message; the model's reply
  (16 tokens) becomes the assistant message of the next turn's prompt;
- agent: a system prompt with tools, then 10 turns that each append the assistant's reply and a tool result;
- no sharing: 16 requests of 1,000 distinct random tokens each (16 generated), all at once: tokens per second with
  the cache on over off, rounds alternating the order.

Per turn: the prompt's length, the tokens it could share (its longest common prefix with an earlier turn's prompt
and output), the tokens the cache found (usage's cached_tokens), and the time to first token with and without the
cache. Hit rate: tokens found over tokens that could be shared, turns 2-10.

    python benchmarks/prefix_cache.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import RESULTS, configure_jax, machine_info, markdown_table, write_results

TURNS = 10
REPLY_TOKENS = 16
SYSTEM_TOKENS = 3300  # of the 4,096-token context
GOAL_HIT_RATE = 0.90
GOAL_TTFT_SPEEDUP = 5.0
GOAL_NO_SHARING_RATIO = 0.97  # cache on / off throughput


def turn(engine, ids: list[int]) -> tuple[float, list[int], int]:
    """(time to first token, output ids, cached prompt tokens) of one greedy request, alone on the engine."""
    from jaxserve.request import SamplingParams

    started = time.perf_counter()
    handle = engine.submit(ids, SamplingParams(max_tokens=REPLY_TOKENS, temperature=0.0, ignore_eos=True))
    ttft, tokens, cached = None, [], 0
    for event in handle.sync_events(timeout=600):
        if ttft is None:
            ttft = time.perf_counter() - started
        tokens += event.token_ids
        cached = event.cached_tokens
    assert ttft is not None and handle.finish_reason == "length", handle.finish_reason
    return ttft, tokens, cached


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_trace(engine, tokenizer, messages_for_turn) -> list[dict]:
    """Each turn's prompt (from the messages so far and the replies before it), run one after the other."""
    from jaxserve.text.chat import ChatOptions

    rows, seen, replies = [], [], []
    for k in range(TURNS):
        ids = tokenizer.apply_chat_template(messages_for_turn(k, replies), ChatOptions())
        shareable = max((common_prefix(ids, earlier) for earlier in seen), default=0)
        ttft, output, cached = turn(engine, ids)
        seen.append(ids + output)
        replies.append(tokenizer.decode(output))
        rows.append(
            {
                "turn": k + 1,
                "prompt": len(ids),
                "shareable": min(shareable, len(ids) - 1),
                "cached": cached,
                "ttft_s": ttft,
            }
        )
    return rows


def chat_messages(system: str):
    def messages(k: int, replies: list[str]) -> list[dict]:
        out = [{"role": "system", "content": system}]
        for i in range(k):
            out += [
                {"role": "user", "content": f"Question {i}: what follows from clause {i}?"},
                {"role": "assistant", "content": replies[i]},
            ]
        return out + [{"role": "user", "content": f"Question {k}: what follows from clause {k}?"}]

    return messages


def agent_messages(system: str, results: list[str]):
    def messages(k: int, replies: list[str]) -> list[dict]:
        out = [{"role": "system", "content": system}, {"role": "user", "content": "Find the failing test and fix it."}]
        for i in range(k):
            out += [{"role": "assistant", "content": replies[i]}, {"role": "tool", "content": results[i]}]
        return out

    return messages


def no_sharing(engine, prompts: list[list[int]]) -> float:
    """Tokens (prompt and generated) per second over the whole run of `prompts`, all submitted at once."""
    from jaxserve.request import SamplingParams

    started = time.perf_counter()
    handles = [
        engine.submit(p, SamplingParams(max_tokens=REPLY_TOKENS, temperature=0.0, ignore_eos=True)) for p in prompts
    ]
    for handle in handles:
        handle.wait(timeout=600)
    return sum(len(p) + REPLY_TOKENS for p in prompts) / (time.perf_counter() - started)


def plot(traces: dict[str, dict[str, list[dict]]], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4), squeeze=False)
    for ax, (name, runs) in zip(axes[0], traces.items()):
        for label, rows in runs.items():
            ax.plot([r["turn"] for r in rows], [1e3 * r["ttft_s"] for r in rows], marker="o", label=label)
        ax.set_title(f"{name}: time to first token per turn")
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT (ms)")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the no-sharing comparison")
    args = parser.parse_args()
    configure_jax(devices=1)
    import dataclasses

    import jax
    import numpy as np

    from jaxserve.checkpoints.load import load_model
    from jaxserve.config import EngineConfig
    from jaxserve.engine import Engine
    from jaxserve.model.sharding import make_mesh
    from jaxserve.runner import build_runner

    mesh = make_mesh(1, 1)
    loaded = load_model(None, mesh, dtype="float32")
    tokenizer = loaded.tokenizer
    cfg = EngineConfig(dtype="float32", max_model_len=4096, decode_log_interval=10**9)
    runner = build_runner(cfg, loaded.config, loaded.weights, mesh)
    runner.warmup()

    def engine(caching: bool) -> Engine:
        config = dataclasses.replace(cfg, enable_prefix_caching=caching)
        return Engine(config, loaded.config, runner, tokenizer.eos_ids).start()

    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(200)]

    def text(prefix: str, tokens: int) -> str:
        """Sentences of random words, as many as fit in `tokens` tokens."""
        out, i = prefix, 0
        while True:
            sentence = f" Clause {i}: " + " ".join(rng.choice(words, 12)) + "."
            if len(tokenizer.encode(out + sentence)) > tokens:
                return out
            out, i = out + sentence, i + 1

    # The longest the context leaves room for: the turns add ~40 tokens of messages and 16 of reply each.
    clauses = text("Answer from these clauses.", SYSTEM_TOKENS)
    tools = text("You may call run_tests(path) and edit(path, diff).", SYSTEM_TOKENS - 800)
    results = [text("Result:", 80) for _ in range(TURNS)]
    traces_spec = {"chat": chat_messages(clauses), "agent": agent_messages(tools, results)}
    traces: dict[str, dict[str, list[dict]]] = {}
    for name, messages in traces_spec.items():
        traces[name] = {}
        for caching in (False, True):
            e = engine(caching)
            try:
                traces[name]["cache" if caching else "no cache"] = run_trace(e, tokenizer, messages)
            finally:
                e.shutdown()
        print(f"{name}: done")

    prompts = [rng.integers(2, loaded.config.vocab_size, 1000).tolist() for _ in range(16)]
    ratios = []
    for r in range(args.rounds):
        speeds = {}
        for caching in (False, True) if r % 2 == 0 else (True, False):
            e = engine(caching)
            try:
                # Fresh prompts each run (the first token differs): nothing to share, within a run or with the last.
                speeds[caching] = no_sharing(e, [[2 + (r * 2 + caching) % 500] + p[1:] for p in prompts])
            finally:
                e.shutdown()
        ratios.append(speeds[True] / speeds[False])
        print(f"no sharing round {r + 1}: on/off {ratios[-1]:.3f}")

    data: dict = {"machine": machine_info(), "backend": jax.default_backend(), "traces": traces, "no_sharing": ratios}
    sections, checks = [], []
    for name, runs in traces.items():
        cached_rows, plain_rows = runs["cache"], runs["no cache"]
        table = [
            [
                c["turn"],
                c["prompt"],
                c["shareable"],
                c["cached"],
                f"{1e3 * p['ttft_s']:.0f}",
                f"{1e3 * c['ttft_s']:.0f}",
                f"{p['ttft_s'] / c['ttft_s']:.1f}x",
            ]
            for c, p in zip(cached_rows, plain_rows)
        ]
        sections.append(
            f"**{name}**\n\n"
            + markdown_table(
                ["turn", "prompt tokens", "could share", "cached", "TTFT no cache (ms)", "TTFT cache (ms)", "speed-up"],
                table,
            )
        )
        later = cached_rows[1:]
        hit_rate = sum(r["cached"] for r in later) / max(1, sum(r["shareable"] for r in later))
        last = cached_rows[-1]["ttft_s"], plain_rows[-1]["ttft_s"]
        speedups = [p["ttft_s"] / c["ttft_s"] for c, p in zip(later, plain_rows[1:])]
        checks += [
            f"{'ok  ' if hit_rate >= GOAL_HIT_RATE else 'FAIL'} {name}: turns 2-{TURNS} found {hit_rate:.1%} of the "
            f"tokens they could share (>= {GOAL_HIT_RATE:.0%})",
            f"{'ok  ' if last[1] / last[0] >= GOAL_TTFT_SPEEDUP else 'FAIL'} {name}: TTFT at the longest prompt "
            f"{last[1] / last[0]:.1f}x lower with the cache (turns 2-{TURNS}: {min(speedups):.1f}x .. "
            f"{max(speedups):.1f}x; >= {GOAL_TTFT_SPEEDUP:.0f}x)",
        ]
    ratio = statistics.median(ratios)
    checks.append(
        f"{'ok  ' if ratio >= GOAL_NO_SHARING_RATIO else 'FAIL'} no sharing: tokens/s with the cache on / off "
        f"{ratio:.3f}x (rounds {min(ratios):.3f} .. {max(ratios):.3f}; >= {GOAL_NO_SHARING_RATIO})"
    )
    plot(traces, RESULTS / "prefix_cache.png")
    markdown = "\n\n".join(sections) + "\n\n" + "\n".join(f"- {c}" for c in checks) + "\n\n![](prefix_cache.png)\n"
    write_results("prefix_cache", data, markdown)
    print(markdown)
    return 0 if all(c.startswith("ok") for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
