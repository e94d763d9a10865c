"""Train a DSpark block drafter for the embedded default model (`checkpoints/default/dspark/`), deterministically:

    python -m training.train_dspark [--out DIR] [--steps N]

The default model (`checkpoints/default/`, as shipped) is the frozen target. Each step takes BATCH windows of its
training text, runs the target over them once for the drafter's input (its hidden streams after the tapped layers,
`forward.tapped_streams`), and at ANCHORS random positions P of each window builds what serving builds: the
stages' rings from the context's last W positions (`dspark.write_context`) and the block of the token at P and
BLOCK - 1 noise tokens (`dspark.block_logits`). The drafter is distilled from the target, as DSpark's and EAGLE's
drafters are trained on the target's own outputs: the loss is the cross-entropy of the block's logits (plus the
Markov head's of the text's token before each, what an accepted run feeds it) against the target's next-token
distributions at P..P+BLOCK-1, since a draft is accepted when it is the target's token, not the text's. Only the
drafter trains (AdamW); the target's weights are not touched. Writes the drafter as the 0731 release
names its tensors (`mtp.{0,1,2}.*`, `mtp.2.markov_head.*`) with a config.json of the default's plus the `dspark_*`
keys, a card (README.md) and the log (training_log.jsonl) into `checkpoints/default/dspark/`
(`checkpoints.deepseek.DSPARK_FOLDER`, where the loader finds a drafter kept beside its checkpoint).

A second phase (`--phase continuations`, part of the whole run) goes on from the drafter written there on text the
target writes itself: CONTINUATION_WINDOWS cuts of the training text, each continued by the served target (jaxserve's
engine; greedy every other one, the others sampled), as DSpark's and EAGLE's drafters are trained on the target's
regenerated responses: a drafter drafts inside the target's own output, and the first phase's contexts are the
text's (on the target's greedy output it agreed with it 0.78 at the first block position against 0.61 on text).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tokenizers import Tokenizer

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.checkpoints.deepseek import DRAFTER_PREFIXES, DSPARK_FOLDER, load_weights
from jaxserve.checkpoints.load import load_model, model_config
from jaxserve.checkpoints.writer import checkpoint_tensors, save_tensors, write_config
from jaxserve.config import DSparkConfig, EngineConfig, ModelConfig, load_config
from jaxserve.engine import Engine
from jaxserve.model.cache import CacheGeometry, abstract_cache, abstract_dspark_cache, zeros_of
from jaxserve.model.dspark import block_logits, markov_logits, write_context
from jaxserve.model.forward import final_norm, tapped_streams, vocab_logits
from jaxserve.model.inputs import StepInputs
from jaxserve.model.sharding import make_mesh
from jaxserve.model.weights import DSparkDrafter, Weights, init_weights
from jaxserve.request import SamplingParams
from jaxserve.runner import build_runner
from training.corpus import Corpus, stdlib_corpus
from training.train_default import LENGTH, PAGE, encode, training_log, window_geometry

SEED = 5
STEPS = 5000
BATCH = 8  # windows a step
ANCHORS = 16  # blocks a window
BLOCK = 5  # the release's dspark_block_size
PEAK_LR = 2e-3
WARMUP = 50
WEIGHT_DECAY = 0.1
LOG_EVERY = 25
EVAL_WINDOWS = 32
PAD = 2  # the noise token: the tokenizer's PAD (training.default_model), never in the text
# One stage, where the release has three: its drafter is 3 layers beside a target of 43 (7% of the target's layer
# work a drafted token), and three beside the default's 5 would cost 60%; one costs 20%, as the default's MTP block.
STAGES = 1
DRAFTER = DSparkConfig(block_size=BLOCK, noise_token_id=PAD, target_layer_ids=(2, 3, 4), markov_rank=64, stages=STAGES)
# The second phase: windows the target writes (a cut of text, then its own continuation), and their training.
CONTINUATION_WINDOWS = 2048
HELD_CONTINUATIONS = 2 * EVAL_WINDOWS  # of the held-out text: EVAL_WINDOWS greedy and EVAL_WINDOWS sampled
CONTINUATION_PROMPT = 32  # tokens of text a continuation starts from
SAMPLED_TEMPERATURE = 0.8  # every other continuation; the others greedy
CONTINUATION_STEPS = 1500
CONTINUATION_LR = 5e-4
CONTINUATION_WARMUP = 20


def _rows(rows: int, length: int, positions: jax.Array) -> StepInputs:
    """Rows of one chunk each, every row its own state slot; pages enough for a window."""
    pages = -(-LENGTH // PAGE)
    return StepInputs(
        tokens=jnp.zeros((rows, length), jnp.int32),
        positions=positions.astype(jnp.int32),
        lengths=jnp.full(rows, length, jnp.int32),
        slots=jnp.arange(rows, dtype=jnp.int32),
        page_table=1 + jnp.arange(rows * pages, dtype=jnp.int32).reshape(rows, pages),
    )


def taps(target: Weights, windows: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The target over windows [b, LENGTH]: its taps [b, LENGTH, taps * d] and its next-token log-probabilities at
    each position [b, LENGTH, V]."""
    rows = windows.shape[0]
    inputs = dataclasses.replace(_rows(rows, LENGTH, jnp.zeros(rows)), tokens=windows)
    cache = zeros_of(abstract_cache(cfg, window_geometry(rows, LENGTH)))
    (streams,), _, (features,), _ = tapped_streams(target, cache, [inputs], cfg)
    y = final_norm(streams, target.hc_head_fn, target.hc_head_base, target.hc_head_scale, target.norm, cfg)
    return features, jax.nn.log_softmax(vocab_logits(y, target.head, cfg.vocab_size), axis=-1)


def block_loss(
    drafter: DSparkDrafter,
    target: Weights,
    target_out: tuple[jax.Array, jax.Array],
    windows: jax.Array,
    anchors: jax.Array,
    cfg,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Mean cross-entropy against the target's distributions of the blocks at `anchors` [b, a] (positions >= W) of
    windows [b, LENGTH] (`target_out`: the target's taps and log-probabilities there, `taps`), and each block
    position's top-1 agreement with the target's greedy token and accuracy against the text [BLOCK] each."""
    features, target_logprobs = target_out
    b, a = anchors.shape
    window = cfg.sliding_window
    rows = b * a
    starts = anchors.reshape(-1)
    owner = jnp.repeat(jnp.arange(b), a)
    context = jax.vmap(lambda w, p: jax.lax.dynamic_slice_in_dim(features[w], p - window, window))(owner, starts)
    geo = CacheGeometry(num_slots=rows, num_pages=rows + 1, page_size=PAGE, max_pages_per_seq=1)
    rings = write_context(
        drafter, zeros_of(abstract_dspark_cache(cfg, geo)), context, _rows(rows, window, starts - window), cfg
    )
    text = jax.vmap(lambda w, p: jax.lax.dynamic_slice_in_dim(windows[w], p, BLOCK + 1))(owner, starts)
    block = jnp.concatenate([text[:, :1], jnp.full((rows, BLOCK - 1), cfg.dspark.noise_token_id, jnp.int32)], axis=1)
    logits = block_logits(drafter, target.embed, target.head, rings, block, _rows(rows, BLOCK, starts), cfg)
    logits = logits + markov_logits(drafter, text[:, :BLOCK], cfg)
    # The target's distribution of the token after each block position's: at positions P .. P + BLOCK - 1.
    teacher = jnp.exp(jax.vmap(lambda w, p: jax.lax.dynamic_slice_in_dim(target_logprobs[w], p, BLOCK))(owner, starts))
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    loss = -jnp.sum(teacher * logprobs, axis=-1).mean()
    drafts = jnp.argmax(logits, axis=-1)
    agreement = (drafts == jnp.argmax(teacher, axis=-1)).mean(axis=0)
    return loss, (agreement, (drafts == text[:, 1:]).mean(axis=0))


def train(target: Weights, cfg: ModelConfig, tokens: np.ndarray, steps: int, log: Any) -> DSparkDrafter:
    """The first phase: a drafter from the seed, on windows of the text `tokens`."""
    drafter = init_weights(jax.random.key(SEED), cfg).dspark
    assert drafter is not None

    def text_windows(rng: np.random.Generator) -> np.ndarray:
        return np.stack([tokens[s : s + LENGTH] for s in rng.integers(0, len(tokens) - LENGTH, BATCH)])

    return _optimise(target, cfg, drafter, text_windows, steps, PEAK_LR, WARMUP, "step", log)


def train_on_continuations(
    target: Weights, cfg: ModelConfig, drafter: DSparkDrafter, windows: np.ndarray, steps: int, log: Any
) -> DSparkDrafter:
    """The second phase: `drafter` goes on over the target's own continuations `windows` [n, LENGTH]."""
    return _optimise(
        target,
        cfg,
        drafter,
        lambda rng: windows[rng.integers(0, len(windows), BATCH)],
        steps,
        CONTINUATION_LR,
        CONTINUATION_WARMUP,
        "continuation_step",
        log,
    )


def _optimise(
    target: Weights,
    cfg: ModelConfig,
    drafter: DSparkDrafter,
    windows_of: Callable[[np.random.Generator], np.ndarray],
    steps: int,
    peak_lr: float,
    warmup: int,
    step_key: str,
    log: Any,
) -> DSparkDrafter:
    """`steps` AdamW steps of `block_loss` (cosine to a tenth of `peak_lr` after `warmup`) on BATCH windows drawn by
    `windows_of` and ANCHORS random blocks each; log records keyed `step_key`."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup, max(steps, warmup + 1), end_value=peak_lr / 10)
    decayed = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731  matrices, not norms
    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=WEIGHT_DECAY, mask=decayed),
    )
    state = opt.init(drafter)
    tapped = jax.jit(taps, static_argnames="cfg")

    @jax.jit
    def step(drafter, state, target_out, windows, anchors):
        (loss, accuracy), grads = jax.value_and_grad(block_loss, has_aux=True)(
            drafter, target, target_out, windows, anchors, cfg
        )
        updates, state = opt.update(grads, state, drafter)
        return optax.apply_updates(drafter, updates), state, loss, accuracy

    rng = np.random.default_rng(SEED)
    started = time.perf_counter()
    for n in range(1, steps + 1):
        windows = jnp.asarray(windows_of(rng))
        anchors = jnp.asarray(rng.integers(cfg.sliding_window, LENGTH - BLOCK - 1, (BATCH, ANCHORS)))
        drafter, state, loss, (agreement, _) = step(drafter, state, tapped(target, windows, cfg), windows, anchors)
        if n % LOG_EVERY == 0 or n == steps or n <= 3:
            log({step_key: n, "loss": float(loss), "agreement": [round(float(x), 4) for x in agreement],
                 "seconds": time.perf_counter() - started})  # fmt: skip
    return drafter


def continuations(model: Path, tokens: np.ndarray, count: int, seed: int) -> np.ndarray:
    """[count, LENGTH] windows the target writes itself: a CONTINUATION_PROMPT-token cut of `tokens` at a seeded
    offset, then the served target's continuation (float32, drafting off): greedy for even windows, sampled at
    SAMPLED_TEMPERATURE with the window's index as seed for odd ones. One request at a time (about 280 tokens a
    second here), so no window depends on what it was batched with."""
    starts = np.random.default_rng(seed).integers(0, len(tokens) - CONTINUATION_PROMPT, count)
    config = EngineConfig(model=str(model), dtype="float32", max_num_seqs=1, page_size=16, max_model_len=2 * LENGTH)
    mesh = make_mesh(1, 1)
    loaded = load_model(model, mesh, config.dtype)
    runner = build_runner(config, loaded.config, loaded.weights, mesh)
    engine = Engine(config, loaded.config, runner, loaded.tokenizer.eos_ids)
    engine.start()
    rows: list[list[int]] = []
    try:
        for first in range(0, count, config.max_queued_requests):  # no more waiting at once than the queue holds
            prompts = [
                tokens[s : s + CONTINUATION_PROMPT].tolist() for s in starts[first : first + config.max_queued_requests]
            ]
            handles = [
                engine.submit(
                    prompt,
                    SamplingParams(
                        temperature=0.0 if (first + i) % 2 == 0 else SAMPLED_TEMPERATURE,
                        seed=first + i,
                        max_tokens=LENGTH - CONTINUATION_PROMPT,
                        ignore_eos=True,
                    ),
                )
                for i, prompt in enumerate(prompts)
            ]
            rows += [prompt + handle.wait().token_ids for prompt, handle in zip(prompts, handles)]
    finally:
        engine.shutdown()
    return np.array(rows, np.int32)


def evaluate(target: Weights, drafter: DSparkDrafter, tokens: np.ndarray, cfg: ModelConfig) -> dict[str, Any]:
    """Held-out loss and per-block-position top-1 agreement with the target and accuracy against the text (the
    Markov head fed the text's tokens), EVAL_WINDOWS windows with ANCHORS evenly spaced blocks each."""
    windows = np.stack([tokens[i * LENGTH : (i + 1) * LENGTH] for i in range(EVAL_WINDOWS)])
    spots = np.linspace(cfg.sliding_window, LENGTH - BLOCK - 2, ANCHORS).astype(np.int32)
    run = jax.jit(block_loss, static_argnames="cfg")
    tapped = jax.jit(taps, static_argnames="cfg")
    losses, agreements, accuracies = [], [], []
    for i in range(0, EVAL_WINDOWS, BATCH):
        part = jnp.asarray(windows[i : i + BATCH])
        anchors = jnp.asarray(np.broadcast_to(spots, (len(part), ANCHORS)))
        loss, (agreement, accuracy) = run(drafter, target, tapped(target, part, cfg), part, anchors, cfg)
        losses.append(float(loss))
        agreements.append(np.asarray(agreement))
        accuracies.append(np.asarray(accuracy))
    mean = lambda xs: [round(float(x), 4) for x in np.mean(xs, axis=0)]  # noqa: E731  per block position
    return {"loss": float(np.mean(losses)), "agreement": mean(agreements), "accuracy": mean(accuracies)}


def card(summary: dict[str, Any], continued: dict[str, Any] | None = None) -> str:
    """The drafter's README: its first phase's `summary`, and the second's (`continued`) once it has run."""
    s, c = summary, continued
    accuracy = ", ".join(f"{x:.2f}" for x in s["accuracy"])
    agreement = ", ".join(f"{x:.2f}" for x in s["agreement"])
    return f"""# The embedded default's DSpark drafter

A DSpark block drafter ({s["parameters"] / 1e6:.2f}M parameters: {DRAFTER.stages} V4 decoder layer(s) of
sliding-window attention, a Markov head of rank {DRAFTER.markov_rank}) for the model one folder up, trained by
`python -m training.train_dspark` with that model frozen, so that `--speculative-config '{{"method": "dspark",
"num_speculative_tokens": {BLOCK}}}'` drafts on the embedded default as on DeepSeek-V4-Flash-0731. It is kept here,
beside the model, because the model's own `mtp.0` is its MTP block; the loader reads it from this folder when DSpark
drafts. One stage where the release has three: the release's drafter is 3 layers beside a 43-layer target (7% of its
layer work a drafted token), and three beside the default's 5 layers would cost 60%; one costs 20%, as its MTP block.

- **Input**: the target's hidden streams after layers {list(DRAFTER.target_layer_ids)} (averaged over the hc
  streams), context keys over the last {s["window"]} positions; blocks of {BLOCK} tokens (the last token and
  {BLOCK - 1} copies of token {PAD}, the tokenizer's PAD, as noise).
- **Data**: the default's training text (the standard library's sources), {s["train_tokens"]:,} tokens.
- **Training**: {s["steps"]} steps of {BATCH} windows of {LENGTH} tokens x {ANCHORS} blocks each, AdamW (peak lr
  {PEAK_LR}, warmup {WARMUP}, cosine to a tenth, weight decay {WEIGHT_DECAY}, clip 1.0), distilled: cross-entropy
  against the target's next-token distributions at the block's {BLOCK} positions (the Markov head fed the text's
  tokens); seed {SEED}; {s["minutes"]:.1f} minutes on {s["machine"]}.
- **Held-out** after this phase ({EVAL_WINDOWS} windows of the default's held-out files, {ANCHORS} blocks each): loss
  {s["loss"]:.3f}; top-1 agreement with the target's greedy token by block position: {agreement}; accuracy
  against the text: {accuracy}.
{_continuation_card(c) if c else ""}- Acceptance served is in `benchmarks/results/speculative.md`. The log of the run is
  `training_log.jsonl` beside this card.
"""


def _continuation_card(c: dict[str, Any]) -> str:
    greedy, sampled = ({p: ", ".join(f"{x:.2f}" for x in c[p][kind]["agreement"]) for p in ("before", "after")}
                       for kind in ("greedy", "sampled"))  # fmt: skip
    return f"""- **Then on the target's own text** (`--phase continuations`): {c["windows"]:,} windows of
  {LENGTH} tokens, each a {CONTINUATION_PROMPT}-token cut of the training text (seeded offsets) continued by the
  target as jaxserve serves it (float32; every other one greedy, the others sampled at temperature
  {SAMPLED_TEMPERATURE}), as DSpark's and EAGLE's drafters are trained on their target's regenerated responses;
  {c["steps"]} more steps from the first phase's drafter (as written, bf16), peak lr {CONTINUATION_LR}, warmup
  {CONTINUATION_WARMUP}, cosine to a tenth; {c["minutes"]:.1f} minutes with writing the continuations. Held out:
  {EVAL_WINDOWS} greedy and {EVAL_WINDOWS} sampled continuations of cuts of the held-out files; agreement with the
  target by block position, greedy: {greedy["before"]} before this phase, {greedy["after"]} after; sampled:
  {sampled["before"]} before, {sampled["after"]} after.
"""


def frozen_target(model: Path) -> tuple[Weights, ModelConfig]:
    """The target as the drafter trains beside it (float32, no drafter of its own) and the config with DRAFTER."""
    base = load_config(model, dtype="float32")
    target, _ = load_weights(model, base)
    return dataclasses.replace(target, dspark=None), dataclasses.replace(base, dspark=DRAFTER).with_drafter("dspark")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=default_checkpoint_path(), help="target (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=STEPS, help="first-phase steps (default: %(default)s)")
    parser.add_argument(
        "--continuation-steps", type=int, default=CONTINUATION_STEPS, help="second-phase steps (default: %(default)s)"
    )
    parser.add_argument(
        "--phase",
        choices=("all", "text", "continuations"),
        default="all",
        help="both phases, or one: the second goes on from the drafter already in the model's dspark folder",
    )
    args = parser.parse_args()
    out: Path = args.model / DSPARK_FOLDER
    target, cfg = frozen_target(args.model)
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    corpus = stdlib_corpus()
    train_tokens = encode(tok, [Corpus.text([f]) for f in corpus.train], cfg.eos_token_id)
    held_tokens = encode(tok, [Corpus.text([f]) for f in corpus.held_out], cfg.eos_token_id)
    if args.phase != "continuations":
        log, log_file = training_log(out)
        log({"train_tokens": len(train_tokens), "held_out_tokens": len(held_tokens), "steps": args.steps})
        started = time.perf_counter()
        drafter = train(target, cfg, train_tokens, args.steps, log)
        minutes = (time.perf_counter() - started) / 60
        _write(target, cfg, drafter, out)
        summary = {
            **evaluate(target, _shipped(args.model), held_tokens, cfg),
            "parameters": sum(x.size for x in jax.tree.leaves(drafter)),
            "window": cfg.sliding_window,
            "train_tokens": len(train_tokens),
            "steps": args.steps,
            "minutes": minutes,
            "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}",
        }
        log({"evaluation": summary, "perplexity_equivalent": math.exp(summary["loss"])})
        (out / "README.md").write_text(card(summary))
        log_file.close()
    if args.phase != "text":
        summary = next(
            r["evaluation"] for r in map(json.loads, (out / "training_log.jsonl").open()) if "evaluation" in r
        )
        log, log_file = training_log(out, append=True)
        started = time.perf_counter()
        windows = continuations(args.model, train_tokens, CONTINUATION_WINDOWS, SEED)
        held = continuations(args.model, held_tokens, HELD_CONTINUATIONS, SEED + 1)
        log({"continuation_windows": len(windows), "generated_in_seconds": time.perf_counter() - started})

        def on_held(drafter: DSparkDrafter) -> dict[str, Any]:
            return {
                "greedy": evaluate(target, drafter, held[0::2].reshape(-1), cfg),
                "sampled": evaluate(target, drafter, held[1::2].reshape(-1), cfg),
            }

        before = _shipped(args.model)
        continued = {
            "before": on_held(before),
            "windows": len(windows),
            "steps": args.continuation_steps,
        }
        drafter = train_on_continuations(target, cfg, before, windows, args.continuation_steps, log)
        continued["minutes"] = (time.perf_counter() - started) / 60
        _write(target, cfg, drafter, out)
        continued["after"] = on_held(_shipped(args.model))
        log({"continuation_evaluation": continued})
        (out / "README.md").write_text(card(summary, continued))
        log_file.close()


def _write(target: Weights, cfg: ModelConfig, drafter: DSparkDrafter, out: Path) -> None:
    """The drafter's tensors (bf16, the release's names) and config into `out`."""
    tensors = checkpoint_tensors(dataclasses.replace(target, dspark=drafter), cfg, dtype="bfloat16")
    save_tensors({name: t for name, t in tensors.items() if name.startswith(DRAFTER_PREFIXES)}, out)
    write_config(dataclasses.replace(cfg, dspark_drafting=False), out)


def _shipped(model: Path) -> DSparkDrafter:
    """The drafter as served: read back by the loader from beside the model (bf16 weights, float32 maths)."""
    shipped, _ = load_weights(model, model_config(model, "float32", drafter="dspark"))
    assert shipped.dspark is not None
    return shipped.dspark


if __name__ == "__main__":
    main()
