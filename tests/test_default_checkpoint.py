"""The embedded default checkpoint: small, quick to load, every model feature and an MTP block, a working tokenizer,
and trained: what its model card says of it holds for the shipped weights, its tokenizer and configs regenerate
from the training script, and the script's first steps reproduce its committed log."""

from __future__ import annotations

import json
import time

import jax
import numpy as np
import pytest
from harness import run_schedule
from tokenizers import Tokenizer as RustTokenizer

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.checkpoints.deepseek import DSPARK_FOLDER, load_weights
from jaxserve.config import CSA, HCA, SWA, config_from_dict, load_config, to_hf_dict
from jaxserve.text.tokenizer import Tokenizer, load_tokenizer
from training import train_dspark
from training.corpus import Corpus, stdlib_corpus
from training.default_model import SPECIAL_TOKENS, model_config, tokenizer_config, train_tokenizer
from training.train_default import encode, evaluate, held_out_windows, train, unigram_perplexity

FOLDER = default_checkpoint_path()
MAX_BYTES = 20 * 10**6  # the bound on the trained default


def _log(folder=FOLDER) -> list[dict]:
    return [json.loads(line) for line in (folder / "training_log.jsonl").read_text().splitlines()]


def _evaluation() -> dict:
    (record,) = [r["evaluation"] for r in _log() if "evaluation" in r]
    return record


@pytest.fixture(scope="module")
def corpus():
    return stdlib_corpus()


@pytest.fixture(scope="module")
def tokens(corpus):
    """(training tokens, held-out tokens) as the training script encodes them with the shipped tokenizer."""
    tok = RustTokenizer.from_file(str(FOLDER / "tokenizer.json"))
    eos = load_config(FOLDER).eos_token_id
    return tuple(encode(tok, [Corpus.text([f]) for f in files], eos) for files in (corpus.train, corpus.held_out))


def test_default_checkpoint_loads_quickly_and_runs():
    started = time.perf_counter()
    cfg = load_config(FOLDER, dtype="float32")
    weights, _ = load_weights(FOLDER, cfg)
    tok = load_tokenizer(FOLDER)
    elapsed = time.perf_counter() - started
    size = sum(p.stat().st_size for p in FOLDER.rglob("*") if p.is_file())  # the DSpark drafter beside it too
    print(f"default checkpoint: {size / 2**20:.2f} MiB, config + weights + tokenizer loaded in {elapsed:.2f} s")
    assert elapsed < 5.0 and size < MAX_BYTES
    assert isinstance(tok, Tokenizer) and tok.vocab_size == cfg.vocab_size
    prompt = np.array(tok.apply_chat_template([{"role": "user", "content": "Where does the river run?"}]), np.int32)
    (logits,) = run_schedule(weights, cfg, [prompt], [[len(prompt)]], buckets=(32,))
    assert logits.shape == (len(prompt), cfg.vocab_size) and np.isfinite(logits).all()


def test_default_checkpoint_has_every_feature():
    cfg = load_config(FOLDER)
    assert set(cfg.layer_kinds) == {SWA, CSA, HCA}
    assert True in cfg.hash_layers and False in cfg.hash_layers  # hash and score routing
    assert cfg.hc_mult > 1 and cfg.n_routed_experts > cfg.num_experts_per_tok
    assert cfg.nextn_layers == 1  # one MTP block, which speculative decoding drafts with
    tok = Tokenizer(FOLDER)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (tok.bos_id, tok.eos_ids) == (cfg.bos_token_id, (cfg.eos_token_id,)) == (0, (1,))


def test_the_tokenizer_and_configs_regenerate_from_the_training_script(corpus):
    lines = [line for f in corpus.train for line in Corpus.text([f]).splitlines()]
    assert train_tokenizer(lines).to_str() == RustTokenizer.from_file(str(FOLDER / "tokenizer.json")).to_str()
    assert json.loads((FOLDER / "tokenizer_config.json").read_text()) == tokenizer_config()
    assert json.loads((FOLDER / "config.json").read_text()) == to_hf_dict(config_from_dict(model_config()))


def test_the_shipped_weights_have_the_model_cards_held_out_perplexity(tokens):
    """Five times below a unigram model's, and what the card and the log say (the log is the run's own)."""
    train_tokens, held_tokens = tokens
    cfg = load_config(FOLDER, dtype="float32").with_mtp(1)
    weights, _ = load_weights(FOLDER, cfg)
    windows = held_out_windows(held_tokens)
    scores = evaluate(weights, windows, cfg)
    unigram = unigram_perplexity(train_tokens, windows[:, 1:-1].ravel(), cfg.vocab_size)
    logged = _evaluation()
    print(f"held-out perplexity {scores['perplexity']:.2f} (MTP {scores['mtp_perplexity']:.2f}), unigram {unigram:.1f}")
    assert unigram / scores["perplexity"] >= 5
    assert scores["perplexity"] == pytest.approx(logged["perplexity"], rel=0.01)
    assert scores["mtp_perplexity"] == pytest.approx(logged["mtp_perplexity"], rel=0.01)
    assert unigram == pytest.approx(logged["unigram_perplexity"], rel=1e-6)
    assert f"**{logged['perplexity']:.2f}**" in (FOLDER / "README.md").read_text()


def test_the_training_script_reproduces_its_logged_first_steps(tokens):
    """Three steps from the seed, on the same data, give the losses the committed log starts with (the full run is
    `python -m training.train_default`, about 55 minutes on 2 CPU cores)."""
    cfg = config_from_dict(model_config(), dtype="float32").with_mtp(1)
    logged = {r["step"]: r for r in _log() if "step" in r}
    records: list[dict] = []
    train(cfg, tokens[0], 3, records.append)
    for record in records:
        expected = logged[record["step"]]
        assert record["loss"] == pytest.approx(expected["loss"], rel=1e-3)
        assert record["mtp_loss"] == pytest.approx(expected["mtp_loss"], rel=1e-3)
    assert [r["step"] for r in records] == [1, 2, 3]
    jax.clear_caches()


def test_the_drafters_training_script_reproduces_its_logged_first_steps(tokens):
    """The DSpark drafter's training (`python -m training.train_dspark`, the target frozen): three steps from the seed
    give the losses its committed log starts with."""
    target, cfg = train_dspark.frozen_target(FOLDER)
    logged = {r["step"]: r for r in _log(FOLDER / DSPARK_FOLDER) if "step" in r}
    records: list[dict] = []
    train_dspark.train(target, cfg, tokens[0], 3, records.append)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["loss"] == pytest.approx(logged[record["step"]]["loss"], rel=1e-3)
    jax.clear_caches()
