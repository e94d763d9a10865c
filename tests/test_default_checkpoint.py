"""The embedded default checkpoint: small, quick to load, every model feature, a working tokenizer, and exactly what
`checkpoints/make_default.py` generates."""

from __future__ import annotations

import time

import numpy as np
from harness import run_schedule

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.checkpoints.deepseek import load_weights
from jaxserve.checkpoints.make_default import SPECIAL_TOKENS, generate
from jaxserve.config import CSA, HCA, SWA, load_config
from jaxserve.text.tokenizer import Tokenizer, load_tokenizer

FOLDER = default_checkpoint_path()


def test_default_checkpoint_loads_quickly_and_runs():
    started = time.perf_counter()
    cfg = load_config(FOLDER, dtype="float32")
    weights, _ = load_weights(FOLDER, cfg)
    tok = load_tokenizer(FOLDER)
    elapsed = time.perf_counter() - started
    size = sum(p.stat().st_size for p in FOLDER.iterdir())
    print(f"default checkpoint: {size / 2**20:.2f} MiB, config + weights + tokenizer loaded in {elapsed:.2f} s")
    assert elapsed < 5.0 and size < 6 * 2**20
    assert isinstance(tok, Tokenizer) and tok.vocab_size == cfg.vocab_size
    prompt = np.array(tok.apply_chat_template([{"role": "user", "content": "Where does the river run?"}]), np.int32)
    (logits,) = run_schedule(weights, cfg, [prompt], [[len(prompt)]], buckets=(32,))
    assert logits.shape == (len(prompt), cfg.vocab_size) and np.isfinite(logits).all()


def test_default_checkpoint_has_every_feature():
    cfg = load_config(FOLDER)
    assert set(cfg.layer_kinds) == {SWA, CSA, HCA}
    assert True in cfg.hash_layers and False in cfg.hash_layers  # hash and score routing
    assert cfg.hc_mult > 1 and cfg.n_routed_experts > cfg.num_experts_per_tok
    tok = Tokenizer(FOLDER)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (tok.bos_id, tok.eos_ids) == (cfg.bos_token_id, (cfg.eos_token_id,)) == (0, (1,))


def test_make_default_regenerates_identical_files(tmp_path):
    written = generate(tmp_path)
    shipped = sorted(p for p in FOLDER.iterdir() if p.is_file())
    assert [p.name for p in written] == [p.name for p in shipped]
    for new, old in zip(written, shipped):
        assert new.read_bytes() == old.read_bytes(), (
            f"{old.name} differs: run python -m jaxserve.checkpoints.make_default"
        )
