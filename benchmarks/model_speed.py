"""Issue 2: prefill and decode tokens/s of jaxserve's jitted forward against transformers' eager forward.

Both run the `small` preset in float32 with the same weights (transformers' DeepseekV4ForCausalLM built by
tests/reference.py, saved, and loaded into jaxserve by the checkpoint loader) on the same CPU, in one process,
their measurements interleaved round by round. jaxserve runs through the ModelRunner on a 1-device mesh (AOT
compiled buckets, donated cache, on-device greedy sampling, the host fetching every token); compile time is
excluded (every bucket is compiled and run once before timing). transformers runs under torch.no_grad() with
its own DynamicCache: `model(ids, cache=cache, use_cache=True)`, greedy argmax on the host.

Rows: prefill of one prompt in one chunk (batch 1), then decode steps at batch 1 and batch 8 continuing from
prompts of that length. `--profile` also prints where a jaxserve decode step and a prefill chunk spend their time.

    .venv/bin/python benchmarks/model_speed.py            # 1-4 minutes on 2 cores (compiles cached)
    .venv/bin/python benchmarks/model_speed.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from common import (
    REPO,
    add_kernels_flag,
    alternate,
    configure_jax,
    cpu_cores,
    decode_step,
    geometry,
    load_average,
    machine_info,
    make_runner,
    markdown_table,
    median,
    prefill_step,
    slot_pages,
    slot_request,
    spread,
    write_results,
)

GOAL_DECODE_B1 = 3.0  # jaxserve / transformers decode tokens/s at batch 1


class JaxRows:
    """Sequences in fixed runner slots, advanced by prefill or by greedy decode steps."""

    def __init__(self, runner, geo, slots: list[int]):
        self.runner, self.geo, self.slots = runner, geo, slots
        self.requests = []

    @property
    def emitted(self) -> list[list[int]]:
        return [r.output_ids for r in self.requests]

    def prefill(self, prompts) -> None:
        self.requests = [slot_request(self.geo, slot, prompt) for slot, prompt in zip(self.slots, prompts)]
        for request in self.requests:
            request.output_ids.append(prefill_step(self.runner, request, 0, request.prompt_len))

    def decode(self) -> None:
        decode_step(self.runner, self.requests)


class ReferenceRows:
    """The same for transformers: one DynamicCache holding a batch of equal-length sequences."""

    def __init__(self, model):
        self.model = model
        self.cache = None
        self.last = None
        self.emitted: list[list[int]] = []

    def prefill(self, prompts) -> None:
        import torch
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        with torch.no_grad():
            logits = self.model(torch.as_tensor(prompts, dtype=torch.long), cache=self.cache, use_cache=True).logits
        self.last = logits[:, -1].argmax(-1, keepdim=True)
        self.emitted = [[int(t)] for t in self.last[:, 0]]

    def decode(self) -> None:
        import torch

        with torch.no_grad():
            logits = self.model(self.last, cache=self.cache, use_cache=True).logits
        self.last = logits[:, -1].argmax(-1, keepdim=True)
        for row, token in zip(self.emitted, self.last[:, 0]):
            row.append(int(token))


def agreeing_prefix(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """(tokens that agree before each row's first divergence, summed over rows; tokens compared)."""
    agree = 0
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        agree += n
    return agree, sum(min(len(x), len(y)) for x, y in zip(a, b))


def profile_step(cfg, weights, chunk: int, position: int, calls: int) -> str:
    """Where one jitted logits_all call (batch 1, `chunk` tokens at `position`, donated cache) spends its time,
    by named scope. The same model code as the runner's step, without sampling."""
    import jax
    import jax.numpy as jnp
    from common import op_time_by_scope, trace_calls

    from jaxserve.model.cache import init_cache
    from jaxserve.model.forward import logits_all
    from jaxserve.model.inputs import StepInputs

    geo = geometry(cfg, 1, position + chunk + 8)
    step = jax.jit(logits_all, static_argnames=("cfg",), donate_argnames=("cache",))
    inputs = StepInputs(
        tokens=jnp.ones((1, chunk), jnp.int32),
        positions=jnp.array([position], jnp.int32),
        lengths=jnp.array([chunk], jnp.int32),
        slots=jnp.zeros((1,), jnp.int32),
        page_table=jnp.asarray([slot_pages(geo, 0)], jnp.int32),
    )
    state = {"cache": init_cache(cfg, geo)}

    def one():
        logits, state["cache"] = step(weights, state["cache"], inputs, cfg=cfg)
        logits.block_until_ready()

    hlo = step.lower(weights, state["cache"], inputs, cfg=cfg).compile().as_text()
    for _ in range(2):
        one()
    return op_time_by_scope(trace_calls(one, calls), hlo, calls)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short prompt, few repeats (a smoke run)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 256; --quick 128)")
    parser.add_argument("--repeats", type=int, default=None, help="alternating rounds (default 5; --quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps per round (default 4; --quick 2)")
    parser.add_argument("--profile", action="store_true", help="also print jaxserve op time by scope (decode, prefill)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    configure_jax(devices=1)  # before add_kernels_flag imports jaxserve (and with it jax)
    add_kernels_flag(parser)
    args = parser.parse_args(argv)
    prompt_len = args.prompt or (128 if args.quick else 256)
    repeats = args.repeats or (2 if args.quick else 5)
    steps = args.steps or (2 if args.quick else 4)
    prefill_repeats = 2 if args.quick else 3

    import numpy as np
    import torch

    sys.path.insert(0, str(REPO / "tests"))
    from reference import build_reference

    from jaxserve.checkpoints.deepseek import load_weights
    from jaxserve.config import config_from_dict
    from jaxserve.model.sharding import make_mesh
    from jaxserve.presets import preset_dict

    threads = cpu_cores()
    torch.set_num_threads(threads)
    info = machine_info() | {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "xla_cpu_threads": f"default pool, one per core ({threads})",
    }
    print(
        f"CPU cores {threads}; torch threads {torch.get_num_threads()}; JAX/XLA:CPU uses its default pool of one "
        f"thread per core ({threads}); load average {info['load_average_1min_at_start']}",
        flush=True,
    )

    raw = preset_dict("small")
    cfg = config_from_dict(raw, dtype="float32")
    model = build_reference(raw)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        weights, _ = load_weights(folder, cfg)

    batch = 8
    max_tokens = prompt_len + 1 + repeats * steps + 8
    geo = geometry(cfg, batch + 1, max_tokens)  # slots 0..7: the batch-8 rows; slot 8: the batch-1 row
    runner, compile_s = make_runner(
        cfg, weights, geo, make_mesh(1, 1), prefill_chunks=(prompt_len,), decode_rows=(1, batch), kernels=args.kernels
    )
    print(
        f"jaxserve compiled {len(runner.buckets.shapes())} buckets in {compile_s:.1f} s (excluded); "
        f"{geo.max_pages_per_seq} KV pages of {geo.page_size} tokens per sequence",
        flush=True,
    )

    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (batch, prompt_len))
    jax1, ref1 = JaxRows(runner, geo, [batch]), ReferenceRows(model)
    jax8, ref8 = JaxRows(runner, geo, list(range(batch))), ReferenceRows(model)

    # Warm-up: one prefill and one decode step of each, untimed.
    for rows, prompt in ((jax1, prompts[:1]), (ref1, prompts[:1]), (jax8, prompts), (ref8, prompts)):
        rows.prefill(prompt)
        rows.decode()

    def torch_threads(n: int, fn):
        def call():
            torch.set_num_threads(n)
            return fn()

        return call

    # transformers runs with as many threads as XLA:CPU (the comparison), and with 1 thread: on a busy machine
    # its OpenMP threads wait on each other at every op, and the 1-thread figure shows how much that costs.
    engines = {
        "jaxserve": lambda rows: rows[0],
        "transformers": lambda rows: torch_threads(threads, rows[1]),
        "transformers 1 thread": lambda rows: torch_threads(1, rows[1]),
    }
    print("timing prefill ...", flush=True)
    prefill = alternate(
        {
            name: pick((lambda: jax1.prefill(prompts[:1]), lambda: ref1.prefill(prompts[:1])))
            for name, pick in engines.items()
        },
        prefill_repeats,
    )
    jax8.prefill(prompts)
    ref8.prefill(prompts)
    print("timing decode ...", flush=True)
    decode = alternate(
        {
            f"{name} b={b}": pick(pair)
            for b, pair in ((1, (jax1.decode, ref1.decode)), (batch, (jax8.decode, ref8.decode)))
            for name, pick in engines.items()
        },
        repeats,
        calls=steps,
    )
    torch.set_num_threads(threads)

    def tok_s(seconds: list[float], tokens: int) -> float:
        return tokens / median(seconds)

    rows = []  # metric, setting, tokens/s per engine
    rows.append(
        (
            "prefill tok/s",
            f"b=1, {prompt_len}-token prompt",
            {name: tok_s(prefill[name], prompt_len) for name in engines},
        )
    )
    for b in (1, batch):
        rows.append(
            (
                f"decode b={b} tok/s",
                f"context {prompt_len}+",
                {name: tok_s(decode[f"{name} b={b}"], b) for name in engines},
            )
        )
    agree1 = agreeing_prefix(jax1.emitted, ref1.emitted)
    agree8 = agreeing_prefix(jax8.emitted, ref8.emitted)
    load_start, load_end = info["load_average_1min_at_start"], load_average()
    ratio_b1 = rows[1][2]["jaxserve"] / rows[1][2]["transformers"]
    table = markdown_table(
        ["", "setting", "jaxserve", f"transformers ({threads} threads)", "ratio", "transformers (1 thread)", "ratio"],
        [
            [
                name,
                setting,
                v["jaxserve"],
                v["transformers"],
                f"{v['jaxserve'] / v['transformers']:.2f}x",
                v["transformers 1 thread"],
                f"{v['jaxserve'] / v['transformers 1 thread']:.2f}x",
            ]
            for name, setting, v in rows
        ],
    )
    busy = " (busy machine: other processes ran; transformers suffers most)" if max(load_start, load_end) > 1.5 else ""
    notes = (
        f"`small` preset, float32, same weights; {threads} CPU cores; XLA:CPU default pool ({threads} threads), "
        f"torch threads {threads} (and 1 for the last columns); medians of {prefill_repeats} prefill rounds and "
        f"{repeats} rounds x {steps} decode steps, the engines alternating; load average {load_start} -> "
        f"{load_end}{busy}."
        f" Greedy tokens agree (prefix before the first divergence): b=1 {agree1[0]}/{agree1[1]}, "
        f"b={batch} {agree8[0]}/{agree8[1]}. Goal: decode b=1 ratio >= {GOAL_DECODE_B1:.0f}x: "
        f"{ratio_b1:.2f}x, {'met' if ratio_b1 >= GOAL_DECODE_B1 else 'NOT met'}."
    )
    print()
    print(table)
    print()
    print(notes)

    data = {
        "config": "small",
        "dtype": "float32",
        "prompt_tokens": prompt_len,
        "decode_rounds": repeats,
        "decode_steps_per_round": steps,
        "machine": info | {"load_average_1min_at_end": load_end},
        "jaxserve_compile_s": round(compile_s, 2),
        "max_pages_per_seq": geo.max_pages_per_seq,
        "rows": [
            {
                "metric": name,
                "setting": setting,
                **{k: round(x, 2) for k, x in v.items()},
                "ratio": round(v["jaxserve"] / v["transformers"], 3),
                "ratio_1_thread": round(v["jaxserve"] / v["transformers 1 thread"], 3),
            }
            for name, setting, v in rows
        ],
        "timings": {
            "prefill": {k: spread(v) for k, v in prefill.items()},
            "decode_per_step": {k: spread(v) for k, v in decode.items()},
        },
        "greedy_agreement": {"b1": list(agree1), f"b{batch}": list(agree8)},
        "goal_decode_b1_ratio": GOAL_DECODE_B1,
        "goal_met": ratio_b1 >= GOAL_DECODE_B1,
    }
    if args.profile:
        data["profile"] = {}
        for what, chunk, position, calls in (
            ("decode b=1", 1, prompt_len, 10),
            (f"prefill {prompt_len}", prompt_len, 0, 3),
        ):
            profile = profile_step(cfg, runner.weights, chunk, position, calls)
            print(f"\njaxserve {what} (jitted logits_all), XLA op time by scope:\n{profile}")
            data["profile"][what] = profile
    if not args.no_write:
        profiles = "".join(
            f"\n## jaxserve {what}: XLA op time by scope\n\n{text}\n" for what, text in data.get("profile", {}).items()
        )
        paths = write_results(
            "model_speed", data, f"# Model speed: jaxserve vs transformers\n\n{table}\n\n{notes}\n" + profiles
        )
        print("\nwrote " + ", ".join(str(p.relative_to(REPO)) for p in paths))


if __name__ == "__main__":
    main()
