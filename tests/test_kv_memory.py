"""KV-cache sizing of DeepSeek-V4-Flash (bf16) from the abstract cache description alone: the
fixed per-slot state (window ring + float32 compressor state). The 6880 B of paged KV per token: test_cache.py."""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.model.cache import CacheGeometry, abstract_cache, cache_nbytes
from jaxserve.model.weights import is_info
from jaxserve.presets import preset

FLASH = preset("flash", dtype="bfloat16")
F32_BYTES, BF16_BYTES = 4, 2
# Far more than this machine could hold (1M tokens for each of 64 slots: about 460 GB of paged KV), so the
# sizes can only come from shapes.
SLOTS, PAGE, PAGES_PER_SEQ = 64, 128, 8192
GEO = CacheGeometry(num_slots=SLOTS, num_pages=SLOTS * PAGES_PER_SEQ, page_size=PAGE, max_pages_per_seq=PAGES_PER_SEQ)


def test_flash_fixed_state_per_slot_matches_the_formula():
    assert {k: FLASH.layer_kinds.count(k) for k in ("csa", "hca", "swa")} == {"csa": 21, "hca": 20, "swa": 2}
    n_csa, n_hca = FLASH.layer_kinds.count("csa"), FLASH.layer_kinds.count("hca")
    d, c_i, m_csa, m_hca = FLASH.head_dim, FLASH.index_head_dim, FLASH.csa_rate, FLASH.hca_rate
    window = FLASH.num_layers * FLASH.sliding_window * d * BF16_BYTES  # 43 x 128 x 512 x 2 B

    # Overlapped (CSA) compressor of width c: kv + gate of the partial window [m, 2c], and the last window's
    # A-half [m, c], all float32. HCA: kv + gate of the partial window [m, c].
    def csa_state(c):
        return 2 * m_csa * 2 * c * F32_BYTES + 2 * m_csa * c * F32_BYTES

    hca_state = 2 * m_hca * d * F32_BYTES
    per_slot = window + n_csa * (csa_state(d) + csa_state(c_i)) + n_hca * hca_state
    assert window == 5_636_096 and csa_state(d) + csa_state(c_i) == 60 * 1024 and hca_state == 512 * 1024
    assert cache_nbytes(FLASH, GEO)["per_slot_fixed"] == SLOTS * per_slot == SLOTS * 17_412_096

    # The same, leaf by leaf: every per-slot array leads with the slot axis (after the stacked layers), and the
    # window is the model dtype.
    layers = [layer for segment in abstract_cache(FLASH, GEO) for layer in segment]
    assert sum(layer.window.shape[0] for layer in layers) == FLASH.num_layers
    for layer in layers:
        assert layer.window.shape[1:] == (SLOTS, 128, 512) and np.dtype(layer.window.dtype).itemsize == BF16_BYTES
        for state in (layer.state, layer.index_state):
            for leaf in jax.tree.leaves(state, is_leaf=is_info):
                assert leaf.axes[:2] == ("layers", "slots") and np.dtype(leaf.dtype) == np.float32
