"""Train the embedded default model (`checkpoints/default/`) from nothing, deterministically:

    python -m training.train_default [--out DIR] [--steps N]

On the standard library's sources (training.corpus): a byte-level BPE tokenizer, then a small DeepSeek-V4
(training.default_model) trained with AdamW on next-token prediction plus its MTP block's next-next-token loss
(weight MTP_WEIGHT, as DeepSeek-V3 trained its MTP). Writes the checkpoint (BF16, as the release stores it), the
model card (README.md: data, steps, held-out perplexity, seed) and the log (`training_log.jsonl`, one line per
LOG_EVERY steps and the evaluation). The held-out perplexity it reports is of the weights as written, read back.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.checkpoints.deepseek import load_weights
from jaxserve.checkpoints.writer import write_checkpoint
from jaxserve.config import ModelConfig, config_from_dict, load_config
from jaxserve.model.cache import CacheGeometry, abstract_cache, abstract_mtp_cache, zeros_of
from jaxserve.model.forward import final_norm, hidden_streams, mtp_block, vocab_logits
from jaxserve.model.inputs import StepInputs
from jaxserve.model.weights import Weights, init_weights
from training.corpus import Corpus, stdlib_corpus
from training.default_model import model_config, tokenizer_config, train_tokenizer

SEED = 4
STEPS = 1500
BATCH = 16
LENGTH = 256  # tokens per training window (each window reads LENGTH + 2: the targets of the main model and MTP)
PEAK_LR = 3e-3
WARMUP = 100
WEIGHT_DECAY = 0.1
MTP_WEIGHT = 0.3
LOG_EVERY = 25
EVAL_WINDOWS = 64  # held-out windows of LENGTH tokens (the first ones of the held-out text)
PAGE = 16  # the KV page the training forward uses: a multiple of every compress rate


def encode(tok: Any, files_text: list[str], eos: int) -> np.ndarray:
    """The files' tokens, one end-of-sentence token after each file."""
    ids: list[int] = []
    for encoding in tok.encode_batch(files_text):
        ids.extend(encoding.ids)
        ids.append(eos)
    return np.asarray(ids, np.int32)


def window_geometry(rows: int, length: int) -> CacheGeometry:
    """The KV geometry of `rows` training windows of `length` tokens, each its own slot and pages."""
    pages = -(-length // PAGE)
    return CacheGeometry(num_slots=rows, num_pages=rows * pages + 1, page_size=PAGE, max_pages_per_seq=pages)


def losses(weights: Weights, windows: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy of the main model (token t+1 from tokens <= t) and of the MTP block (token t+2 from the
    main model's streams at t and token t+1) over windows [b, LENGTH + 2]."""
    rows, length = windows.shape[0], windows.shape[1] - 2
    geo = window_geometry(rows, length)
    page_table = 1 + jnp.arange(rows * geo.max_pages_per_seq, dtype=jnp.int32).reshape(rows, -1)

    def inputs(tokens: jax.Array) -> StepInputs:
        return StepInputs(
            tokens=tokens,
            positions=jnp.zeros(rows, jnp.int32),
            lengths=jnp.full(rows, length, jnp.int32),
            slots=jnp.arange(rows, dtype=jnp.int32),
            page_table=page_table,
        )

    (streams,), _ = hidden_streams(weights, zeros_of(abstract_cache(cfg, geo)), [inputs(windows[:, :length])], cfg)
    y = final_norm(streams, weights.hc_head_fn, weights.hc_head_base, weights.hc_head_scale, weights.norm, cfg)
    (mtp_cache,) = zeros_of(abstract_mtp_cache(cfg, geo))
    _, y_mtp, _ = mtp_block(weights.mtp[0], weights.embed, streams, mtp_cache, inputs(windows[:, 1 : length + 1]), cfg)

    def cross_entropy(hidden: jax.Array, targets: jax.Array) -> jax.Array:
        logprobs = jax.nn.log_softmax(vocab_logits(hidden, weights.head, cfg.vocab_size), axis=-1)
        return -jnp.take_along_axis(logprobs, targets[..., None], axis=-1).mean()

    return cross_entropy(y, windows[:, 1 : length + 1]), cross_entropy(y_mtp, windows[:, 2:])


def _trained(leaf: Any) -> bool:
    return jnp.issubdtype(leaf.dtype, jnp.floating)  # not the hash-routing tables


def _split(weights: Weights) -> tuple[Any, Any]:
    """(the trained leaves, the fixed ones), each with None where the other has a leaf."""
    return (
        jax.tree.map(lambda x: x if _trained(x) else None, weights),
        jax.tree.map(lambda x: None if _trained(x) else x, weights),
    )


def _merge(trained: Any, fixed: Any) -> Weights:
    return jax.tree.map(lambda a, b: b if a is None else a, trained, fixed, is_leaf=lambda x: x is None)


def optimizer(steps: int) -> optax.GradientTransformation:
    # A run shorter than the warm-up follows the full run's ramp: its losses are the full log's first lines.
    schedule = optax.warmup_cosine_decay_schedule(0.0, PEAK_LR, WARMUP, max(steps, WARMUP + 1), end_value=PEAK_LR / 10)
    decayed = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731  matrices, not norms or biases
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=WEIGHT_DECAY, mask=decayed),
    )


def windows_at(tokens: np.ndarray, starts: np.ndarray) -> np.ndarray:
    return np.stack([tokens[s : s + LENGTH + 2] for s in starts])


def held_out_windows(tokens: np.ndarray) -> np.ndarray:
    starts = np.arange(EVAL_WINDOWS) * LENGTH
    if starts[-1] + LENGTH + 2 > len(tokens):
        raise ValueError(f"the held-out text has {len(tokens)} tokens, fewer than {EVAL_WINDOWS} windows need")
    return windows_at(tokens, starts)


def evaluate(weights: Weights, windows: np.ndarray, cfg: ModelConfig) -> dict[str, float]:
    """Held-out perplexity of the main model and the MTP block, BATCH windows at a time."""
    run = jax.jit(losses, static_argnames="cfg")
    parts = [run(weights, jnp.asarray(windows[i : i + BATCH]), cfg) for i in range(0, len(windows), BATCH)]
    main, mtp = (float(np.mean([p[k] for p in parts])) for k in (0, 1))
    return {"perplexity": math.exp(main), "mtp_perplexity": math.exp(mtp)}


def unigram_perplexity(train: np.ndarray, held_out: np.ndarray, vocab_size: int) -> float:
    """The perplexity on `held_out` of token frequencies counted on `train` (add-one smoothed)."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[held_out].mean()))


def train(cfg: ModelConfig, tokens: np.ndarray, steps: int, log: Any) -> Weights:
    weights = init_weights(jax.random.key(SEED), cfg)
    trained, fixed = _split(weights)
    opt = optimizer(steps)
    state = opt.init(trained)

    @jax.jit
    def step(trained: Any, state: Any, windows: jax.Array) -> tuple[Any, Any, jax.Array, jax.Array]:
        def loss(trained: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            main, mtp = losses(_merge(trained, fixed), windows, cfg)
            return main + MTP_WEIGHT * mtp, (main, mtp)

        (_, (main, mtp)), grads = jax.value_and_grad(loss, has_aux=True)(trained)
        updates, state = opt.update(grads, state, trained)
        return optax.apply_updates(trained, updates), state, main, mtp

    rng = np.random.default_rng(SEED)
    started = time.perf_counter()
    for n in range(1, steps + 1):
        starts = rng.integers(0, len(tokens) - LENGTH - 2, BATCH)
        trained, state, main, mtp = step(trained, state, jnp.asarray(windows_at(tokens, starts)))
        if n % LOG_EVERY == 0 or n == steps or n <= 3:
            log({"step": n, "loss": float(main), "mtp_loss": float(mtp), "seconds": time.perf_counter() - started})
    return _merge(trained, fixed)


def training_log(out: Path, append: bool = False) -> tuple[Callable[[dict[str, Any]], None], IO[str]]:
    """(log, its file): each record printed and written as one line of `out`/training_log.jsonl (`out` made; a new
    log, or with `append` the records added to the one there)."""
    out.mkdir(parents=True, exist_ok=True)
    log_file = (out / "training_log.jsonl").open("a" if append else "w")

    def log(record: dict[str, Any]) -> None:
        print(json.dumps(record), flush=True)
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()

    return log, log_file


def model_card(summary: dict[str, Any]) -> str:
    s = summary
    return f"""# The embedded default model

A small DeepSeek-V4 ({s["parameters"] / 1e6:.2f}M parameters: {", ".join(s["layer_kinds"])} layers, hash- and
score-routed MoE with {s["experts"]} experts, mHC, one MTP block), trained from nothing by
`python -m training.train_default` so that `jaxserve` starts with a model that writes Python-like text.

- **Data**: the `.py` sources of Python {s["python"]}'s standard library (code, docstrings, comments; no test
  suites), {s["train_files"]} files ({s["train_tokens"]:,} tokens) for training, every {s["held_out_every"]}th file
  ({s["held_out_files"]} files) held out.
- **Tokenizer**: byte-level BPE, {s["vocab_size"]} tokens, trained on the training files; DeepSeek-V4's special
  tokens at ids 0-{s["special_tokens"] - 1} (BOS, EOS, PAD, the chat roles, think).
- **Training**: {s["steps"]} steps of {s["batch"]} windows of {s["length"]} tokens, AdamW (peak lr {s["peak_lr"]},
  warmup {s["warmup"]}, cosine to a tenth, weight decay {s["weight_decay"]}, clip 1.0), loss = next-token +
  {s["mtp_weight"]} x the MTP block's next-next-token loss; seed {s["seed"]}; {s["minutes"]:.1f} minutes on
  {s["machine"]}.
- **Held-out perplexity** (the first {s["eval_windows"]} windows of {s["length"]} tokens of the held-out files, these
  BF16 weights): **{s["perplexity"]:.2f}** (MTP block, two tokens ahead: {s["mtp_perplexity"]:.2f}); a unigram model
  of the same tokenizer on the same text: {s["unigram_perplexity"]:.1f}
  ({s["unigram_perplexity"] / s["perplexity"]:.1f}x the model's).
- The log of the run is `training_log.jsonl` beside this card.

It is a toy: it continues Python code plausibly and knows nothing else. Chat requests get Python-flavoured text.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_checkpoint_path(), help="folder (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps (default: %(default)s)")
    args = parser.parse_args()
    out: Path = args.out
    log, log_file = training_log(out)
    corpus = stdlib_corpus()
    train_text = [Corpus.text([f]) for f in corpus.train]
    held_text = [Corpus.text([f]) for f in corpus.held_out]
    tok = train_tokenizer([line for text in train_text for line in text.splitlines()])
    tok.save(str(out / "tokenizer.json"), pretty=False)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n")
    cfg = config_from_dict(model_config(), dtype="float32").with_mtp(1)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}, indent=2) + "\n"
    )
    train_tokens = encode(tok, train_text, cfg.eos_token_id)
    held_tokens = encode(tok, held_text, cfg.eos_token_id)
    log({"train_tokens": len(train_tokens), "held_out_tokens": len(held_tokens), "steps": args.steps})

    started = time.perf_counter()
    weights = train(cfg, train_tokens, args.steps, log)
    minutes = (time.perf_counter() - started) / 60
    write_checkpoint(weights, cfg, out, dtype="bfloat16")

    shipped_cfg = load_config(out, dtype="float32")
    shipped, _ = load_weights(out, shipped_cfg.with_mtp(1))
    windows = held_out_windows(held_tokens)
    scores = evaluate(shipped, windows, shipped_cfg.with_mtp(1))
    unigram = unigram_perplexity(train_tokens, windows[:, 1 : LENGTH + 1].ravel(), cfg.vocab_size)
    summary = {
        **scores,
        "unigram_perplexity": unigram,
        "parameters": sum(x.size for x in jax.tree.leaves(weights) if _trained(x)),
        "layer_kinds": list(cfg.layer_kinds),
        "experts": cfg.n_routed_experts,
        "python": platform.python_version(),
        "train_files": len(corpus.train),
        "held_out_files": len(corpus.held_out),
        "held_out_every": 20,
        "train_tokens": len(train_tokens),
        "vocab_size": cfg.vocab_size,
        "special_tokens": 7,
        "steps": args.steps,
        "batch": BATCH,
        "length": LENGTH,
        "peak_lr": PEAK_LR,
        "warmup": WARMUP,
        "weight_decay": WEIGHT_DECAY,
        "mtp_weight": MTP_WEIGHT,
        "seed": SEED,
        "minutes": minutes,
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}",
        "eval_windows": EVAL_WINDOWS,
    }
    log({"evaluation": summary})
    (out / "README.md").write_text(model_card(summary))
    log_file.close()


if __name__ == "__main__":
    main()
