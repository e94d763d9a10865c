"""Tool calls under stress: seeded random tool sets through the HTTP server and the openai client, on random weights.

Each of `--sets` tool sets (1 to 3 tools, 1 to 4 parameters each, drawn from enums, bounded strings and integers,
booleans, arrays, nested objects, `$defs`/`$ref` and `anyOf`) is asked four ways: tool_choice required and auto,
each streamed and not (the same seed, so the same tokens), with thinking mode on for every other set. The model is
the embedded default's shape with random weights: nothing but the grammar makes its calls valid. A random model
never opens a block under auto (none in 200 answers), so one bigram chain is planted in its weights (`planted`):
after `</think>` it tends to spell a block's opening, which 40 of its 200 auto answers complete, the grammar holding
the rest. Reported:

- calls valid / total: every call's arguments parse as JSON and validate against its tool's schema (jsonschema);
- streamed == whole: each streamed answer's calls (ids aside), content and reasoning equal the non-streamed one's;
- reasoning kept apart: no DSML tag and no `</think>` in any content, reasoning or arguments piece.

    python benchmarks/tool_calls.py [--sets 200]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time

from common import configure_jax, machine_info, markdown_table, write_results

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "north", "south", "red", "blue", "green", "fast", "slow"]
# An answer ends when its block closes: room enough that none is cut (a random model adds another call after each
# with odds near one half, about 120 tokens each in this tokenizer); an auto answer that opens no block is text up to
# max_tokens. Requests run one at a time: a streamed and a whole answer must see the same batches to give the same
# tokens (batch invariance is not promised yet).
MAX_TOKENS = {"required": 2048, "auto": 1024}
EMBED_SCALE = 2000.0  # the embedding over the blocks' outputs: each last hidden state mostly its own token's
CHAIN_LOGIT = 20.0  # a chain token's successor's logit: far over the 4,096 random ones (e^20 against their ~2e4)


def _value_schema(rng: random.Random, defs: dict, depth: int) -> dict:
    kinds = ["enum", "string", "integer", "boolean", "array", "ref", "any_of"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99, 999])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": {"type": "string", "enum": rng.sample(WORDS, 3)}, "maxItems": 3}
    if kind == "ref":
        name = f"Def{len(defs)}"
        defs[name] = {}  # the name taken before the definition's own refs take theirs
        defs[name] = _value_schema(rng, defs, depth + 1) if depth < 2 else {"type": "boolean"}
        return {"$ref": f"#/$defs/{name}"}
    if kind == "any_of":
        return {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "enum": ["none"]}]}
    properties = {f"{rng.choice(WORDS)}_{k}": _value_schema(rng, defs, depth + 1) for k in range(rng.randint(1, 3))}
    required = [name for name in properties if rng.random() < 0.6]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def tool_set(seed: int) -> list[dict]:
    """1 to 3 tools with random parameter schemas, the same for the same seed."""
    rng = random.Random(seed)
    tools = []
    for t in range(rng.randint(1, 3)):
        defs: dict = {}
        properties = {f"{rng.choice(WORDS)}_{k}": _value_schema(rng, defs, 0) for k in range(rng.randint(1, 4))}
        required = [name for name in properties if rng.random() < 0.5]
        parameters = {"type": "object", "properties": properties, "required": required}
        if defs:
            parameters["$defs"] = defs
        name = f"tool_{t}_{rng.choice(WORDS)}"
        tools.append(
            {"type": "function", "function": {"name": name, "description": f"Tool {t}", "parameters": parameters}}
        )
    return tools


def planted(weights, chain: list[int]):
    """`weights` with a bigram chain planted: the embedding scaled up until each position's last hidden state is
    mostly its own token's embedding (normed), and each chain token's successor given CHAIN_LOGIT more along that
    direction in the head. The opening's `｜` bytes come twice, followed once by `DSML` and once by `tool_calls`, so
    the chain completes the opening at most one time in four; otherwise the answer goes on as text."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np

    embed = np.asarray(weights.embed) * EMBED_SCALE
    head = np.array(weights.head)
    norm = np.asarray(weights.norm)
    for token, successor in set(zip(chain, chain[1:])):
        hidden = norm * embed[token] / np.sqrt(np.mean(embed[token] ** 2))  # the final norm's output
        head[:, successor] += CHAIN_LOGIT * hidden / np.sum(hidden * hidden)
    return dataclasses.replace(weights, embed=jnp.asarray(embed), head=jnp.asarray(head))


def streamed(chunks) -> dict:
    out: dict = {"content": "", "reasoning": "", "calls": {}, "pieces": []}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta.model_dump(exclude_none=True)
            out["content"] += delta.get("content", "")
            out["reasoning"] += delta.get("reasoning_content", "")
            out["pieces"] += [delta.get("content", ""), delta.get("reasoning_content", "")]
            for call in delta.get("tool_calls", []):
                entry = out["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += call.get("function", {}).get("name", "")
                entry["arguments"] += call.get("function", {}).get("arguments", "")
                out["pieces"].append(call.get("function", {}).get("arguments", ""))
    out["calls"] = [(c["name"], c["arguments"]) for _, c in sorted(out["calls"].items())]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", type=int, default=200)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--only", type=int, nargs="*", help="these sets alone (a failure's seed)")
    args = parser.parse_args()
    configure_jax(devices=1)

    import jax
    import jsonschema
    import openai

    from jaxserve.checkpoints.load import load_model
    from jaxserve.config import EngineConfig
    from jaxserve.engine import Engine
    from jaxserve.model.sharding import make_mesh, place
    from jaxserve.model.weights import abstract_weights, init_weights
    from jaxserve.runner import build_runner
    from jaxserve.server import create_app
    from jaxserve.server.config import ServerConfig
    from jaxserve.server.serving import BackgroundServer, bind
    from jaxserve.text.chat.encoding import DSML, THINK_END, TOOL_CALLS_OPEN

    mesh = make_mesh(1, 1)
    loaded = load_model(None, mesh, dtype="float32")
    model_cfg, tokenizer = loaded.config, loaded.tokenizer
    think_end = tokenizer.token_to_id(THINK_END)
    chain = [think_end, *tokenizer.encode(TOOL_CALLS_OPEN, add_special_tokens=False)]
    drawn = planted(init_weights(jax.random.key(0), model_cfg, std=0.15), chain)
    weights = place(drawn, abstract_weights(model_cfg), mesh)
    cfg = EngineConfig(
        dtype="float32",
        max_num_seqs=8,
        chunked_prefill_size=512,
        max_prefill_rows=1,
        page_size=16,
        max_model_len=4096,
        decode_log_interval=100000,
        mixed_batches=False,
    )
    runner = build_runner(cfg, model_cfg, weights, mesh)
    started = time.perf_counter()
    runner.warmup()
    compile_s = time.perf_counter() - started
    engine = Engine(cfg, model_cfg, runner, tokenizer.eos_ids, tokenizer.grammar_compiler(model_cfg.vocab_size))
    engine.start()
    app = create_app(engine, tokenizer, "random", ServerConfig(log_stats_interval=0))
    http = BackgroundServer(app, bind("127.0.0.1", 0))
    http.start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http.address[1]}/v1", api_key="-", max_retries=0, timeout=600)
    # A DSML tag (text may hold the chain's stray pieces, such as `<｜DSML｜DSML`) or the end of the reasoning.
    markup = re.compile(f"</?{DSML}(tool_calls|invoke|parameter)|{THINK_END}")
    figures = {
        choice: {"answers": 0, "calling": 0, "calls": 0, "valid": 0, "same": 0, "apart": 0, "cut": 0}
        for choice in ("required", "auto")
    }
    failures: list[str] = []
    started = time.perf_counter()
    try:
        for seed in args.only or range(args.sets):
            tools = tool_set(seed)
            schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
            thinking = seed % 2 == 1
            for choice in ("required", "auto"):
                request = dict(
                    model="random",
                    messages=[{"role": "user", "content": f"Request {seed}: use the tools."}],
                    tools=tools,
                    tool_choice=choice,
                    max_tokens=MAX_TOKENS[choice],
                    temperature=1.0,
                    seed=seed,
                    # A random model seldom ends its reasoning by itself: a bias towards </think> ends it soon.
                    extra_body={"chat_template_kwargs": {"thinking": thinking}, "return_token_ids": True},
                    logit_bias={str(think_end): 6} if thinking else None,
                )
                whole = client.chat.completions.create(**{k: v for k, v in request.items() if v is not None})
                stream = streamed(
                    client.chat.completions.create(**{k: v for k, v in request.items() if v is not None}, stream=True)
                )
                choice_out = whole.choices[0]
                message = choice_out.message
                calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
                reasoning = message.model_extra.get("reasoning_content") or ""
                fig = figures[choice]
                fig["answers"] += 1
                fig["calling"] += bool(calls)
                cut = choice_out.finish_reason == "length"
                fig["cut"] += cut
                for name, arguments in calls:
                    fig["calls"] += 1
                    try:
                        jsonschema.validate(json.loads(arguments), schemas[name])
                        fig["valid"] += 1
                    except (json.JSONDecodeError, jsonschema.ValidationError, KeyError) as e:
                        token_ids = choice_out.model_extra["token_ids"]
                        if not cut:  # a call cut by max_tokens ends as far as it was written
                            failures.append(
                                f"set {seed} {choice}: {name} {arguments!r}: {str(e)[:200]}; "
                                f"content {(message.content or '')[:300]!r}; finish {choice_out.finish_reason}; "
                                f"text {tokenizer.decode(token_ids, skip_special_tokens=False)[-400:]!r}"
                            )
                same = (stream["calls"], stream["content"], stream["reasoning"]) == (
                    calls,
                    message.content or "",
                    reasoning,
                )
                fig["same"] += same
                if not same:
                    failures.append(f"set {seed} {choice}: streamed {stream['calls']} != whole {calls}")
                texts = stream["pieces"] + [message.content or "", reasoning] + [a for _, a in calls]
                bad = [t for t in texts if markup.search(t)]
                apart = not bad
                fig["apart"] += apart
                if not apart:
                    failures.append(f"set {seed} {choice}: markup in a piece: {bad[0][:160]!r}")
    finally:
        http.stop()
        engine.shutdown()
    run_s = time.perf_counter() - started
    rows = [
        [
            choice,
            f"{f['answers']}",
            f"{f['calling']}",
            f"{f['calls']}",
            f"{f['valid']} / {f['calls']}",
            f"{f['cut']}",
            f"{f['same']} / {f['answers']}",
            f"{f['apart']} / {f['answers']}",
        ]
        for choice, f in figures.items()
    ]
    table = markdown_table(
        [
            "tool_choice",
            "answers",
            "answers with calls",
            "calls",
            "calls valid / total",
            "cut by max_tokens",
            "streamed == whole",
            "no markup",
        ],
        rows,
    )
    limits = f"max_tokens {MAX_TOKENS['required']} (required) and {MAX_TOKENS['auto']} (auto)"
    markdown = (
        f"# Tool calls under stress\n\n{args.sets} seeded tool sets, each asked with tool_choice required and auto, "
        "streamed and not, thinking on for every other set; random weights (the embedded default's shape, std 0.15) "
        "with a bigram chain planted that spells a block's opening after </think>, "
        f"temperature 1, {limits}. Compile {compile_s:.0f} s, run {run_s:.0f} s.\n\n{table}\n"
    )
    if failures:
        markdown += "\nFailures:\n\n" + "\n".join(f"- {f}" for f in failures[:20]) + "\n"
    print(markdown)
    data = {"sets": args.sets, "figures": figures, "failures": failures, "machine": machine_info()}
    if not args.no_write:
        write_results("tool_calls", data, markdown)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
