"""Make tests/data/v41_tiny/reference.json: transformers' DeepSeek-V4.1 on the tiny checkpoint of tests/v41_tiny.py.

Not a test: run by hand when the tiny checkpoint or the reference changes, and commit the JSON it writes.

    .venv/bin/python tests/v41_make_reference.py --transformers-src PATH

Needs torch and transformers (the `test` extra: torch 2.13, transformers 5.24) and the DeepSeek-V4.1 modeling code
of huggingface/transformers main at commit 0a2080b43eb64e6d448186a4f3f0bc9c618f4797, which no release has yet.
PATH is a checkout of that commit (its src/transformers/models/deepseek_v41/ is read) or that folder itself (any
folder holding its modeling_deepseek_v41.py and configuration_deepseek_v41.py). The two files are copied into a
temporary package with their relative imports (`from ...x`, `from ..auto`) made absolute `transformers.` imports,
and run under the installed transformers; nothing is written into PATH or the venv. The files' sha256 must be
those of that commit (SOURCE_SHA256), unless --any-source.

What it does, all on CPU in float32 (the conditioning also in float64), one thread (so two runs give the same JSON):
- writes the tiny checkpoint (`write_tiny_v41`, --seed) to a temporary folder and builds HF's
  DeepseekV41ForCausalLM from its config.json's text_config;
- loads every tensor by decoding the file itself: its own reading of the safetensors layout and its own numpy
  decoding of e4m3 codes, e2m1 nibbles and ue8m0 scales, independent of jaxserve's and ml_dtypes' decoders (so the
  parity test checks jaxserve's), asserting that every HF parameter is filled exactly once and every file tensor
  used;
- binds the checkpoint's tokenizer (the engram hashes need it) and, for each of 3 prompts (BOS first), records
  the prompt logprobs of one full forward (entry i > 0: log p(token i | tokens before it); float32 log-softmax),
  then 32 greedy tokens (argmax; EOS is not special) decoded one at a time through a hand-built cache, with each
  token's logprob. Every greedy step is cross-checked against a full re-forward of the sequence so far with a
  fresh cache (the same token and the logits within 1e-4 at every step), and each greedy token must lead the
  runner-up by MIN_MARGIN, or the script fails;
- measures the conditioning of each prompt (below) and fails unless its margin is at least MARGIN; writes each
  prompt's margin and where it is (`conditioning`);
- writes the engram hashing as HF has it: the compressed token map, the compressed pad id, the hash multipliers,
  primes, per-layer bucket offsets, and the hash ids of every position of prompt 0;
- writes each prompt's `alternatives` (below): every rounding or top-k decision of one full forward of the prompt +
  its greedy tokens within float32 noise of its boundary, taken the other way, and the logprobs that moves.

Conditioning. HF's forward is quantization-aware, also in float32: it rounds the window KV to FP8 e4m3 (ue8m0 scale
per 32 channels), the compressed KV to FP4 e2m1 (e4m3 scale per 16 channels), the indexer's queries and keys to FP4
(ue8m0 scale per 32), all active at this config's sizes; and it picks top-k sets: the indexer's `index_topk`
entries, `select_candidate_blocks`' blocks, the MoE router's experts. Each is a discontinuity. A value within
float32 noise of a rounding midpoint, or two top-k scores within noise of each other, has no
implementation-independent float32 answer: the order of the arithmetic decides, so such a point tests rounding
noise, not an implementation, and its flip moves the logits of later positions by 1e-4 to 1 (the window's next 8
positions for one KV element; far more where the indexer's picks change). So the script measures every such
decision HF takes on each prompt + its greedy tokens, in one full forward and in the cached greedy decode, with the
model in float32 and again in float64 (`model.double()`; HF still computes its norms, RoPE, router, compressor
pooling and indexer scores in float32, so this is a second, differently rounded evaluation rather than an exact
one), through wrappers of HF's `_fake_quant_fp8_block`, `_fake_quant_fp4_block`, `select_candidate_blocks` and
`Tensor.topk`. The margin of a rounded element is |v - m| / |v|, v its value / scale and m the nearest midpoint of
its grid (e4m3 or e2m1); of a block scale, the relative distance of amax / (grid max) to where the scale jumps (a
power of two for ue8m0 scales, an e4m3 midpoint for e4m3 scales); of a top-k, (s_k - s_k+1) / max(|s_k|, |s_k+1|)
for each row's k-th and (k+1)-th scores where both are finite (exact ties are counted apart). A prompt's margin is
the least of them all.

MARGIN is 1e-6, not the 1e-5 (CLEAR) that would keep every decision an order of magnitude clear of float32 noise
(the float32 and float64 evaluations' values differ by 5e-7 of a value at the median, 3e-6 at the 90th percentile):
no prompt of these lengths reaches 1e-5. Prompt + greedy tokens take 1e5 (13-token prompt) to 3e5 (100-token
prompt) decisions per path, and about 1 in 12000 falls within 1e-5 of its boundary: each of the 715 candidates
measured had 5 to 80 such decisions over its two float32 paths, and their least margins had medians of 1.1e-7
(100-token code), 2.4e-7 (41-token prose) and 6e-7 (13-token line). The prompts here are, among those candidates,
ones with large margins that also pass every cross-check above. Even so, noise remains: it scales with a block's
largest value, not with the element (about 5e-7 of the largest value between two float32 evaluations), so an element
of 2% of its block's largest has a relative noise of 2.5e-5, above even CLEAR. For another 100-token candidate
(least margin 1.3e-6), HF's own full re-forward of its first 128 tokens rounded a layer-2 window-KV element of 4% of
its block's largest the other way than the cached decode had (4.6e-6 and 3.2e-6 of the value from the midpoint, on
either side), the indexer then picked other entries, and the logits moved by 0.46. So another implementation's noise
may still cross a boundary; `alternatives` records what each crossing within reach of float32 noise gives.

Alternatives. A value within float32 noise of a rounding boundary has two right answers, and so has everything
computed from it: the reference records the other one. In one full forward (float32) of each prompt + its greedy
tokens, S, `Decisions` finds every decision within NEAR (1e-5, twenty times the noise) of its boundary, measured
against what the noise scales with: a rounded element with |x / scale - m| * scale < NEAR * its block's largest |x|
(m its grid's nearest midpoint), a block scale whose amax / (grid max) is within NEAR (relative) of where the scale
jumps, a top-k row (the indexer's picks, the candidate blocks, the router's experts) whose k-th and (k+1)-th scores
differ by less than NEAR of the larger (exact ties too). Then, nearest first and at most MAX_FLIPS per prompt, it runs
a full forward of S with that one decision taken the other way (the element on the grid value across its midpoint,
the block requantized at the other scale, the k-th entry swapped for the (k+1)-th) and takes the logprob of S[i] for
every i >= 1 (the log-softmax of the logits at i - 1). `alternatives` holds, per prompt, one {"where": the decision
and its margin, "positions": the i whose logprob it moves by more than MOVED, "logprobs": its logprobs there} per flip
that moves any; a parity test accepts a served logprob at i within its tolerance of the reference's or of one
alternative's at i. This tiny random model is chaotic at that scale: one flip moves the logits of the positions
that read it by 1e-6 to 1, which carries later decisions across their boundaries (the indexer's picks above all), so
a flip can move later logprobs by up to about 3 and change the argmax at greedy positions; the script prints the
flips that do, and marks them in "where" (the greedy tokens are checked exactly, so where an implementation's noise
crosses such a decision, its greedy tokens differ from the reference's).

The cache is built by hand (`Cache(layers=[...])`, DeepseekV41CSACache for the KV-source layers) because
transformers 5.24's DynamicCache(config=...) cannot build DeepseekV41CSACache (its layer types get `config=` only
for DeepSeek-V4's), and `use_cache=False` is not an option: without a cache each KV source appends its compressed
entries to one shared list, so with two KV-source layers the second group attends to both groups' entries.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import json
import math
import os
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the generator quantizes with jaxserve's (JAX) quantizer

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from v41_tiny import engram_primes, write_tiny_v41  # noqa: E402

ORIGINAL_TOPK = torch.Tensor.topk

TRANSFORMERS_COMMIT = "0a2080b43eb64e6d448186a4f3f0bc9c618f4797"
MODELING, CONFIGURATION = "modeling_deepseek_v41.py", "configuration_deepseek_v41.py"
SOURCE_SHA256 = {
    CONFIGURATION: "c9a2a19da6caf600c8b5705d97ccd341a37e9718eef78763dd4611031877eb67",
    MODELING: "b06cef1007cba028030ee3914fa955b1d237c5d9c8498582b2be9e7877099f92",
}
PACKAGE = "hf_deepseek_v41_reference"
OUT = Path(__file__).resolve().parent / "data" / "v41_tiny" / "reference.json"
BOS = 0
N_GREEDY = 32
TOLERANCE = 1e-4
STRICT_STEPS = N_GREEDY  # greedy steps whose re-forward must be within TOLERANCE: all (see "Conditioning")
MIN_MARGIN = 5e-3
CHUNK = 7
MARGIN = 1e-6  # the least relative distance of any rounding or top-k decision from its boundary (see "Conditioning")
CLEAR = 1e-5  # decisions nearer than this to their boundaries are counted and printed (see "Conditioning")

# (text, tokens kept with the BOS): Python code, English prose, a short English line. Chosen among 288, 288 and 144
# candidates (a first line or sentence of 24 kinds before 12 texts; 12 greetings and 12 questions) as ones with large
# margins (see "Conditioning" in the module docstring) that pass every cross-check: every greedy step of the cached
# decode within TOLERANCE of a full re-forward, and each greedy token ahead of the runner-up by at least MIN_MARGIN.
PROMPTS = [
    (
        "import math\n"
        "\n"
        "def retry(function, attempts=3, delay=1.0):\n"
        '    """Call function until it succeeds, waiting between the attempts."""\n'
        "    for attempt in range(attempts):\n"
        "        try:\n"
        "            return function()\n"
        "        except Exception as error:\n"
        '            print("attempt", attempt + 1, "failed:", error)\n'
        "            time.sleep(delay)\n"
        '    raise RuntimeError("all attempts failed")\n',
        100,
    ),
    (
        "The day was cold. The recipe calls for two cups of flour, one egg, a pinch of salt and enough milk to make a "
        "smooth batter. Bake it for twenty minutes.",
        41,
    ),
    ("Hey, friend! Do you like coffee?", 13),
]


# ---- the HF modeling code, imported from a temporary copy -------------------------------------------------------


def _absolute_imports(text: str) -> str:
    """`from ...x import` -> `from transformers.x import`, `from ..x import` -> `from transformers.models.x import`;
    `from .x` (the sibling configuration module) stays relative inside the temporary package."""

    def repl(match: re.Match[str]) -> str:
        indent, dots, rest = match.group(1), match.group(2), match.group(3)
        base = {2: "transformers.models", 3: "transformers"}.get(len(dots))
        if base is None:
            raise SystemExit(f"unexpected relative import {match.group(0)!r}")
        return f"{indent}from {base}{'.' + rest if rest else ''} import"

    return re.sub(r"^(\s*)from (\.{2,})([\w.]*) import", repl, text, flags=re.M)


def import_hf(src: Path, into: Path, any_source: bool) -> tuple[ModuleType, ModuleType]:
    folder = src if (src / MODELING).exists() else src / "src" / "transformers" / "models" / "deepseek_v41"
    package = into / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in (CONFIGURATION, MODELING):
        if not (folder / name).exists():
            raise SystemExit(f"--transformers-src {src}: no {name} in {folder}")
        raw = (folder / name).read_bytes()
        digest = hashlib.sha256(raw).hexdigest()
        if digest != SOURCE_SHA256[name] and not any_source:
            raise SystemExit(
                f"{folder / name}: sha256 {digest} is not the file of transformers@{TRANSFORMERS_COMMIT} "
                f"({SOURCE_SHA256[name]}); pass --any-source to use it anyway"
            )
        (package / name).write_text(_absolute_imports(raw.decode()))
    sys.path.insert(0, str(into))
    modeling = importlib.import_module(f"{PACKAGE}.modeling_deepseek_v41")
    configuration = importlib.import_module(f"{PACKAGE}.configuration_deepseek_v41")
    return modeling, configuration


# ---- the checkpoint, decoded here (not by jaxserve, safetensors or ml_dtypes) ---------------------------------


def read_safetensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype string, shape, raw little-endian bytes), from the file's own header."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    return {
        name: (h["dtype"], tuple(h["shape"]), raw[base + h["data_offsets"][0] : base + h["data_offsets"][1]])
        for name, h in header.items()
    }


def _e4m3_table() -> np.ndarray:
    """The 256 float8 e4m3fn values: bias 7, subnormals at exponent 0, S.1111.111 NaN, no infinities."""
    out = np.empty(256, np.float64)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        exponent, mantissa = (b >> 3) & 0xF, b & 0x7
        if exponent == 0xF and mantissa == 0x7:
            out[b] = np.nan
        elif exponent == 0:
            out[b] = sign * (mantissa / 8.0) * 2.0**-6
        else:
            out[b] = sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    return out


def _e2m1_table() -> np.ndarray:
    """The 16 float4 e2m1 values: bias 1, sign in bit 3, subnormal 0.5 at exponent 0."""
    out = np.empty(16, np.float64)
    for n in range(16):
        sign = -1.0 if n & 0x8 else 1.0
        exponent, mantissa = (n >> 1) & 0x3, n & 0x1
        out[n] = sign * (mantissa * 0.5 if exponent == 0 else (1.0 + mantissa / 2.0) * 2.0 ** (exponent - 1))
    return out


E4M3, E2M1 = _e4m3_table(), _e2m1_table()


def _bytes(raw: bytes, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(raw, np.uint8).reshape(shape)


def ue8m0(raw: bytes, shape: tuple[int, ...]) -> np.ndarray:
    u = _bytes(raw, shape)
    if (u == 255).any():
        raise SystemExit("a ue8m0 scale is NaN (255)")
    return np.ldexp(1.0, u.astype(np.int64) - 127)


def _expand(scales: np.ndarray, block: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    return np.repeat(np.repeat(scales, block[0], axis=0)[: shape[0]], block[1], axis=1)[:, : shape[1]]


def decode(
    name: str, tensors: dict[str, tuple[str, tuple[int, ...], bytes]], fp8_block: tuple[int, int], used: Counter[str]
) -> np.ndarray:
    """The float32 values of file tensor `name` (its `.scale` applied, when it is quantized)."""
    dtype, shape, raw = tensors[name]
    used[name] += 1
    if dtype == "F32":
        return np.frombuffer(raw, "<f4").reshape(shape).copy()
    if dtype == "BF16":
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if dtype == "F8_E8M0":  # engram.embed.scale, an HF parameter of its own
        return ue8m0(raw, shape).astype(np.float32)
    scale = name[: -len("weight")] + "scale"
    s_dtype, s_shape, s_raw = tensors[scale]
    used[scale] += 1
    assert s_dtype == "F8_E8M0" and len(shape) == 2, (name, dtype, shape, scale, s_dtype)
    if dtype == "F8_E4M3":
        # the engram table: one scale per 32 channels of a row; linears: the config's weight_block_size
        block = (1, shape[1] // s_shape[1]) if name.endswith("engram.embed.weight") else fp8_block
        assert s_shape == tuple(-(-n // b) for n, b in zip(shape, block)), (name, shape, s_shape, block)
        values = E4M3[_bytes(raw, shape)]
        return (values * _expand(ue8m0(s_raw, s_shape), block, shape)).astype(np.float32)
    if dtype == "I8":  # FP4 e2m1, two per byte along the input dim, low nibble = even element
        packed = _bytes(raw, shape)
        out_dim, in_dim = shape[0], 2 * shape[1]
        values = np.stack([E2M1[packed & 0xF], E2M1[packed >> 4]], axis=-1).reshape(out_dim, in_dim)
        assert s_shape == (out_dim, in_dim // 32), (name, shape, s_shape)
        return (values * _expand(ue8m0(s_raw, s_shape), (1, 32), (out_dim, in_dim))).astype(np.float32)
    raise SystemExit(f"{name}: unexpected dtype {dtype}")


def load_checkpoint(model: torch.nn.Module, folder: Path, fp8_block: tuple[int, int]) -> dict[str, int]:
    """Fill every parameter of `model` from the checkpoint; returns a count of the file's dtypes."""
    tensors = read_safetensors(folder / "model.safetensors")
    used: Counter[str] = Counter()
    filled: Counter[str] = Counter()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for hf_name, param in params.items():
            name = "head.weight" if hf_name == "lm_head.weight" else hf_name.removeprefix("model.")
            if name not in tensors:
                raise SystemExit(f"HF parameter {hf_name} {tuple(param.shape)}: no tensor {name} in the checkpoint")
            values = decode(name, tensors, fp8_block, used)
            if values.shape != tuple(param.shape):
                raise SystemExit(f"{name}: shape {values.shape}, HF's {hf_name} is {tuple(param.shape)}")
            if not np.isfinite(values).all():
                raise SystemExit(f"{name}: non-finite values")
            param.copy_(torch.from_numpy(values))
            filled[hf_name] += 1
    assert set(filled) == set(params) and all(c == 1 for c in filled.values()), "a parameter filled twice or never"
    unused = sorted(set(tensors) - set(used))
    # engram.embed.scale is read twice: to decode the table, and as the HF parameter it also is
    twice = sorted(name for name, c in used.items() if c != (2 if name.endswith("engram.embed.scale") else 1))
    if unused or twice:
        raise SystemExit(f"checkpoint tensors unused: {unused[:8]}, used too often: {twice[:8]}")
    return dict(Counter(dtype for dtype, _, _ in tensors.values()))


# ---- running the model ----------------------------------------------------------------------------------------


class Reference:
    def __init__(self, m: ModuleType, model: Any, cfg: Any) -> None:
        self.m, self.model, self.cfg = m, model, cfg

    def fresh_cache(self) -> Any:
        from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

        # what DynamicCache(config=cfg) dispatches to on transformers main
        return Cache(
            layers=[
                self.m.DeepseekV41CSACache(self.cfg)
                if kind == "shared_compressed_attention"
                else DynamicSlidingWindowLayer(sliding_window=self.cfg.sliding_window)
                for kind in self.cfg.layer_types
            ]
        )

    def start(self) -> Any:
        """A fresh cache, and a fresh engram n-gram history (it lives on the model, not on the cache)."""
        self.model.model.engram_hash_state.history = None
        return self.fresh_cache()

    def logits(self, ids: list[int], cache: Any) -> torch.Tensor:
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        return out.logits[0].float()

    def chunked_logits(self, ids: list[int], chunk: int) -> torch.Tensor:
        """The logits of a prefill `chunk` tokens at a time (a diagnostic: how far float noise moves them)."""
        cache = self.start()
        return torch.cat([self.logits(ids[i : i + chunk], cache) for i in range(0, len(ids), chunk)])

    def run(self, prompt: list[int]) -> dict[str, Any]:
        cache = self.start()
        logits = self.logits(prompt, cache)  # one full forward of the prompt
        logprobs = torch.log_softmax(logits, dim=-1)
        prompt_logprobs: list[float | None] = [None] + [
            float(logprobs[i - 1, prompt[i]]) for i in range(1, len(prompt))
        ]
        last, greedy, greedy_logprobs, step_logits = logits[-1], [], [], []
        for step in range(N_GREEDY):
            token = int(torch.argmax(last))
            top2 = torch.topk(last, 2).values
            if float(top2[0] - top2[1]) < MIN_MARGIN:
                raise SystemExit(
                    f"greedy step {step} of the {len(prompt)}-token prompt: the best two logits are "
                    f"{float(top2[0] - top2[1]):.1e} apart (under {MIN_MARGIN}): a near tie, choose another prompt"
                )
            greedy.append(token)
            greedy_logprobs.append(float(torch.log_softmax(last, dim=-1)[token]))
            step_logits.append(last)
            if step + 1 < N_GREEDY:
                last = self.logits([token], cache)[-1]
        # every decode step against a full re-forward of the sequence so far, with a fresh cache: the same token at
        # every step, the first STRICT_STEPS within TOLERANCE (any later ones are reported)
        diffs = []
        for step in range(N_GREEDY):
            full = self.logits(prompt + greedy[:step], self.start())
            diff = float((full[-1] - step_logits[step]).abs().max())
            diffs.append(max(diff, float((full[: len(prompt)] - logits).abs().max())))
            token = int(torch.argmax(full[-1]))
            if (step < STRICT_STEPS and diffs[-1] > TOLERANCE) or token != greedy[step]:
                raise SystemExit(
                    f"greedy step {step} of the {len(prompt)}-token prompt: the cached decode and a full re-forward "
                    f"differ (max |dlogits| {diffs[-1]:.3e}; tokens {greedy[step]} and {token})"
                )
        return {
            "prompt_logprobs": prompt_logprobs,
            "greedy": greedy,
            "greedy_logprobs": greedy_logprobs,
            "logits_std": float(logits.std()),
            "logits_mean": float(logits.mean()),
            "reforward_diffs": diffs,
        }


def instrument(m: ModuleType, cond: Conditioning, decisions: Decisions) -> dict[str, Counter[tuple[Any, ...]]]:
    """Count the calls of HF's fake-quantizers by (format, block, scale format, whether the shape let it quantize),
    measure their inputs' margins while `cond` is measuring, and hand their outputs to `decisions` while it runs (to
    find the near decisions, or flip one): HF looks those module globals up at call time."""
    seen: dict[str, Counter[tuple[Any, ...]]] = {"fake_quant": Counter()}
    fp8, fp4 = m._fake_quant_fp8_block, m._fake_quant_fp4_block

    def fp8_wrapper(x: torch.Tensor, block_size: int = 32) -> torch.Tensor:
        seen["fake_quant"][("fp8", block_size, "ue8m0", x.shape[-1] % block_size == 0)] += 1
        if cond.active and x.shape[-1] % block_size == 0:
            cond.fp8(x, block_size)
        out = fp8(x, block_size)
        if decisions.mode and x.shape[-1] % block_size == 0:
            out = decisions.quantized(x, out, block_size, "window-KV FP8")
        return out

    def fp4_wrapper(x: torch.Tensor, block_size: int, e4m3_scales: bool = False) -> torch.Tensor:
        key = ("fp4", block_size, "e4m3" if e4m3_scales else "ue8m0", x.shape[-1] % block_size == 0)
        seen["fake_quant"][key] += 1
        if cond.active and x.shape[-1] % block_size == 0:
            cond.fp4(x, block_size, e4m3_scales)
        out = fp4(x, block_size, e4m3_scales)
        if decisions.mode and x.shape[-1] % block_size == 0:
            kind = "compressed-KV FP4" if e4m3_scales else ("indexer-q FP4" if x.dim() == 4 else "indexer-k FP4")
            out = decisions.quantized(x, out, block_size, kind)
        return out

    vars(m).update(_fake_quant_fp8_block=fp8_wrapper, _fake_quant_fp4_block=fp4_wrapper)
    return seen


def routing(model: Any, ids: list[int], ref: Reference) -> list[list[int]]:
    """Tokens per routed expert in each layer, for one full forward of `ids`."""
    counts: list[list[int]] = []
    hooks = [
        layer.ffn.gate.register_forward_hook(
            lambda mod, args, out: counts.append(torch.bincount(out[1].flatten(), minlength=mod.bias.shape[0]).tolist())
        )
        for layer in model.model.layers
    ]
    ref.logits(ids, ref.start())
    for hook in hooks:
        hook.remove()
    return counts


# ---- conditioning: how far each rounding and top-k decision sits from its boundary ----------------------------

E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
INF = float("inf")


def e4m3_midpoint_distance(a: torch.Tensor) -> torch.Tensor:
    """Relative distance of each magnitude of `a` (float64, at most 448) to the rounding midpoint of the e4m3 interval
    holding it: the grid spacing is 2^(e-3) in the binade [2^e, 2^(e+1)), 2^-9 among the subnormals below 2^-6. Zero
    (exactly representable, no midpoint at it) gives inf."""
    exponent = torch.frexp(a).exponent.to(torch.float64) - 1  # floor(log2 a)
    spacing = torch.exp2(exponent.clamp_min(-6) - 3)
    return (a - (torch.floor(a / spacing) + 0.5) * spacing).abs() / a


def e2m1_midpoint_distance(a: torch.Tensor) -> torch.Tensor:
    """Relative distance of each magnitude of `a` (float64, clamped at 6 as HF clamps) to the nearest e2m1 midpoint."""
    a = a.clamp_max(6.0)
    return (a.unsqueeze(-1) - E2M1_MIDPOINTS).abs().amin(-1) / a


def pow2_distance(t: torch.Tensor) -> torch.Tensor:
    """Relative distance of each `t > 0` to the nearest power of two (where the ue8m0 scale 2^ceil(log2 t) jumps)."""
    mantissa = torch.frexp(t).mantissa  # t = mantissa * 2^e, mantissa in [0.5, 1)
    return torch.minimum(1 - 0.5 / mantissa, 1 / mantissa - 1)


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    mantissa, exponent = torch.frexp(t)
    return torch.where(mantissa == 0.5, t, torch.exp2(exponent.to(torch.float64)))


class Conditioning:
    """The margins of HF's discontinuous decisions in the forwards run while `measuring`: for every element that a
    fake-quantizer rounds, the relative distance of value / scale to the nearest rounding midpoint of its grid; for
    every block scale, the relative distance of amax / (grid max) to where the scale jumps (a power of two for ue8m0,
    an e4m3 midpoint for e4m3 scales); for every top-k (the indexer's picks, the candidate blocks, the MoE router),
    the relative gap between the k-th and (k+1)-th scores, where both are finite (-inf: unreachable, +inf: the
    pinned newest block) and differ (an exact tie is counted apart). Per kind of decision: how many were measured,
    how many fell under CLEAR, and the tightest with where it is."""

    def __init__(self) -> None:
        self.active = False
        self.layer = -1
        self.positions: list[int] = []  # absolute positions of the current layer call's tokens
        self.groups = (0, 1)  # the current KV source's first compressed entry's position, and its compress ratio
        self.site = ""  # the top-k being run: "index", "candidates", "router" or none
        self.worst: dict[str, tuple[float, str]] = {}
        self.counts: Counter[str] = Counter()
        self.near: Counter[str] = Counter()
        self.ties: Counter[str] = Counter()

    def note(self, kind: str, margins: torch.Tensor, where: Any) -> None:
        """Record the margins of one call; `where(index)` describes the element at `index` of `margins`."""
        finite = torch.isfinite(margins)
        self.counts[kind] += int(finite.sum())
        self.near[kind] += int((margins < CLEAR).sum())
        if bool(finite.any()):
            flat = int(torch.argmin(torch.where(finite, margins, INF)))
            value = float(margins.flatten()[flat])
            if kind not in self.worst or value < self.worst[kind][0]:
                index = tuple(int(i) for i in np.unravel_index(flat, tuple(margins.shape)))
                self.worst[kind] = (value, f"{kind}, layer {self.layer}, {where(index)}")

    def fp8(self, x: torch.Tensor, block_size: int) -> None:
        """HF's window-KV quantizer: x [B, 1, S, D], ue8m0 scales (2^ceil(log2(max(amax, 1e-4) / 448))), e4m3."""
        blocks = x.detach().double().unflatten(-1, (-1, block_size))
        amax = blocks.abs().amax(-1)
        t = amax.clamp_min(1e-4) / 448.0
        pos = self.positions
        self.note(
            "window-KV FP8 scale",
            torch.where(amax >= 1e-4, pow2_distance(t), INF),
            lambda i: f"position {pos[i[2]]}, channels {i[3] * block_size}-{(i[3] + 1) * block_size - 1}",
        )
        q = (blocks.abs() / pow2_ceil(t).unsqueeze(-1)).clamp_max(448.0).flatten(-2)
        self.note("window-KV FP8", e4m3_midpoint_distance(q), lambda i: f"position {pos[i[2]]}, channel {i[3]}")

    def fp4(self, x: torch.Tensor, block_size: int, e4m3_scales: bool) -> None:
        """HF's FP4 quantizer: the indexer's queries [B, S, H, D] and keys [B, G, D] (ue8m0 scales,
        2^ceil(log2(amax / 6))), the compressed KV [B, G, D] (e4m3 scales, e4m3(amax / 6)); e2m1 values."""
        blocks = x.detach().double().unflatten(-1, (-1, block_size))
        amax = blocks.abs().amax(-1)
        if e4m3_scales:
            kind, floor = "compressed-KV FP4", 6.0 * 2.0**-9
            t = amax.clamp_min(floor) / 6.0
            scale_margin, scale = e4m3_midpoint_distance(t), t.float().to(torch.float8_e4m3fn).double()
        else:
            kind, floor = ("indexer-q FP4" if x.dim() == 4 else "indexer-k FP4"), 6.0 * 2.0**-126
            t = amax.clamp_min(floor) / 6.0
            scale_margin, scale = pow2_distance(t), pow2_ceil(t)
        pos, (first, ratio) = self.positions, self.groups

        def where(i: tuple[int, ...], what: str) -> str:
            if x.dim() == 4:  # queries
                return f"position {pos[i[1]]}, head {i[2]}, {what} {i[3]}"
            return f"entry of position {first + ratio * i[1]}, {what} {i[2]}"

        self.note(f"{kind} scale", torch.where(amax >= floor, scale_margin, INF), lambda i: where(i, "block"))
        q = (blocks.abs() / scale.unsqueeze(-1)).flatten(-2)
        self.note(kind, e2m1_midpoint_distance(q), lambda i: where(i, "channel"))

    def topk(self, scores: torch.Tensor, k: int) -> None:
        """A top-k over the last axis of `scores` ([B, S, T] for the indexer and the candidate blocks, [S, E] for the
        router): the gap between the k-th and (k+1)-th largest of each row."""
        if k >= scores.shape[-1]:
            return  # everything is kept: no choice
        top = ORIGINAL_TOPK(scores.detach().double(), k + 1, dim=-1).values
        a, b = top[..., k - 1], top[..., k]
        chosen = torch.isfinite(a) & torch.isfinite(b)  # +inf: the pinned newest block; -inf: not reachable
        kind = f"{self.site} top-{k}"
        self.ties[kind] += int((chosen & (a == b)).sum())
        gap = (a - b) / torch.maximum(a.abs(), b.abs())
        pos = self.positions
        self.note(kind, torch.where(chosen & (a != b), gap, INF), lambda i: f"position {pos[i[-1]]}")

    def attach(self, m: ModuleType, model: Any) -> None:
        """Hooks that tell the measurements where they are (layer, positions, which top-k)."""
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(functools.partial(self._enter_layer, i), with_kwargs=True)
            attn = layer.attn
            if attn.compressor is not None:
                attn.compressor.register_forward_hook(self._compressed)
            for module, site in ((attn.indexer, "index"), (layer.ffn.gate, "router")):
                if module is not None:
                    module.register_forward_pre_hook(functools.partial(self._enter_site, site))
                    module.register_forward_hook(functools.partial(self._enter_site, ""))
        select = m.select_candidate_blocks

        def select_candidate_blocks(*args: Any, **kwargs: Any) -> Any:
            self.site = "candidates"
            try:
                return select(*args, **kwargs)
            finally:
                self.site = "index"

        vars(m)["select_candidate_blocks"] = select_candidate_blocks

    def _enter_layer(self, i: int, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        self.layer, self.positions = i, kwargs["position_ids"][0].tolist()

    def _compressed(self, module: Any, args: Any, out: tuple[Any, int]) -> None:
        self.groups = (out[1], module.compress_ratio)

    def _enter_site(self, site: str, *hook_args: Any) -> None:
        self.site = site

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Measure the forwards run inside; the counts start afresh."""
        self.worst, self.counts, self.near, self.ties = {}, Counter(), Counter(), Counter()

        def topk(tensor: torch.Tensor, k: int, *args: Any, **kwargs: Any) -> Any:
            if self.site:
                assert kwargs.get("dim", -1) == -1 and kwargs.get("largest", True) and not args, (args, kwargs)
                self.topk(tensor, k)
            return ORIGINAL_TOPK(tensor, k, *args, **kwargs)

        self.active = True
        torch.Tensor.topk = topk  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            torch.Tensor.topk = ORIGINAL_TOPK  # type: ignore[method-assign]
            self.active = False

    def margin(self) -> tuple[float, str]:
        """The tightest decision measured: (margin, where)."""
        return min(self.worst.values(), default=(INF, "no decision"))


def conditioning(ref: Reference, cond: Conditioning, prompt: list[int], greedy: list[int]) -> dict[str, Any]:
    """The decisions' margins in one full forward of prompt + greedy tokens and in the cached greedy decode (the
    prompt's prefill, then the greedy tokens one at a time): the least, where it is, and counts over both paths."""
    out: dict[str, Any] = {"margin": INF, "where": "", "decisions": 0, "near": Counter(), "ties": 0}
    for path in ("one full forward", "cached decode"):
        with cond.measuring():
            if path == "one full forward":
                ref.logits(prompt + greedy, ref.start())
            else:
                cache = ref.start()
                ref.logits(prompt, cache)
                for token in greedy[:-1]:
                    ref.logits([token], cache)
        margin, where = cond.margin()
        if margin < out["margin"]:
            out["margin"], out["where"] = margin, f"{where} ({path})"
        out["decisions"] += sum(cond.counts.values())
        out["near"] += +cond.near
        out["ties"] += sum(cond.ties.values())
    return out


# ---- alternatives: each decision within float32 noise of its boundary, taken the other way ---------------------

NEAR = 1e-5  # decisions nearer than this to their boundaries are flipped (see "Alternatives" in the docstring)
MOVED = 1e-5  # a flip records the positions whose logprob it moves by more than this
MAX_FLIPS = 400  # per prompt, the nearest first (a flip costs one forward, 0.1 s)


def _grid(table: np.ndarray) -> torch.Tensor:
    """The non-negative finite values of a float format's value table, ascending."""
    return torch.tensor(np.unique(np.abs(table[np.isfinite(table)])), dtype=torch.float64)


E4M3_GRID, E2M1_GRID = _grid(E4M3), _grid(E2M1)
GRID_MAX = {"e4m3": 448.0, "e2m1": 6.0}


def nearest_midpoint(a: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For magnitudes `a` (float64): the nearest rounding midpoint of `grid` and the two grid values either side of
    it (the two answers a rounding near that midpoint can give)."""
    mids = (grid[1:] + grid[:-1]) / 2
    j = torch.bucketize(a, mids).clamp(1, len(mids) - 1)  # mids[j - 1] < a <= mids[j], or beyond an end
    k = torch.where((a - mids[j - 1]).abs() <= (mids[j] - a).abs(), j - 1, j)
    return mids[k], grid[k], grid[k + 1]


@dataclasses.dataclass(frozen=True)
class Near:
    """One decision within NEAR of its boundary: the `call`-th decision-site call of the forward (a fake-quantizer or
    a top-k), `index` in it (an element, a block, or a top-k row), `margin` its distance from the boundary."""

    margin: float
    call: int
    kind: str
    index: tuple[int, ...]
    where: str


class Decisions:
    """HF's rounding and top-k decisions in a forward, seen through the fake-quantizers' wrappers (`instrument`) and a
    wrapper of `Tensor.topk`. In "find" mode, it lists each decision within NEAR of its boundary (`Near`): a rounded
    element with |x / scale - m| * scale < NEAR * its block's largest |x|, m the nearest midpoint of its grid; a block
    scale whose amax / (grid max) is within NEAR (relative) of where the scale jumps (a power of two for ue8m0 scales,
    an e4m3 midpoint for e4m3 scales); a top-k row (the indexer's picks, the candidate blocks, the router's experts)
    whose k-th and (k+1)-th scores, both finite, differ by less than NEAR of the larger magnitude (exact ties too). In
    "flip" mode, it takes `target` the other way: the element rounded to the grid value on the other side of its
    midpoint; the block requantized (with HF's own e2m1 coder / e4m3 cast) at the other scale; the k-th entry of the
    row swapped for the (k+1)-th. A decision is named by the order of the decision-site calls: the forwards are the
    same computation up to the flipped decision, so the n-th call is the same call in each."""

    def __init__(self, m: ModuleType, cond: Conditioning) -> None:
        self.m, self.cond = m, cond  # cond's hooks say where a call is (layer, positions, which top-k)
        self.mode = ""  # "", "find" or "flip"
        self.calls = 0
        self.near: list[Near] = []
        self.target: Near | None = None
        self.flipped = False

    @contextlib.contextmanager
    def running(self, mode: str, target: Near | None = None) -> Iterator[None]:
        self.mode, self.calls, self.near, self.target, self.flipped = mode, 0, [], target, False

        def topk(tensor: torch.Tensor, k: int, *args: Any, **kwargs: Any) -> Any:
            result = ORIGINAL_TOPK(tensor, k, *args, **kwargs)
            if self.cond.site:
                assert kwargs.get("dim", -1) == -1 and kwargs.get("largest", True) and not args, (args, kwargs)
                result = self.topk(tensor, k, result)
            return result

        torch.Tensor.topk = topk  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            torch.Tensor.topk = ORIGINAL_TOPK  # type: ignore[method-assign]
            self.mode = ""
        assert target is None or self.flipped, f"{target.where}: never reached"

    def _where(self, kind: str, x: torch.Tensor, i: tuple[int, ...], what: str) -> str:
        """Where element (or block) `i` of the fake-quantizer input `x` is."""
        pos, (first, ratio), layer = self.cond.positions, self.cond.groups, self.cond.layer
        if kind.startswith("window-KV"):  # [B, 1, S, D]
            return f"{kind}, layer {layer}, position {pos[i[2]]}, {what} {i[3]}"
        if x.dim() == 4:  # indexer queries [B, S, H, D]
            return f"{kind}, layer {layer}, position {pos[i[1]]}, head {i[2]}, {what} {i[3]}"
        return f"{kind}, layer {layer}, entry of position {first + ratio * i[1]}, {what} {i[2]}"  # [B, G, D]

    def _find(self, margins: torch.Tensor, kind: str, where: Any) -> None:
        for index in (margins < NEAR).nonzero().tolist():
            i = tuple(int(n) for n in index)
            self.near.append(Near(float(margins[i]), self.calls, kind, i, where(i)))

    def quantized(self, x: torch.Tensor, out: torch.Tensor, block_size: int, kind: str) -> torch.Tensor:
        """A fake-quantizer's input `x` and HF's output `out`: the near decisions, or `out` with the target flipped."""
        self.calls += 1
        assert x.dtype == torch.float32, x.dtype  # the flips are of the float32 model
        fmt, e4m3_scales = ("e4m3", False) if kind == "window-KV FP8" else ("e2m1", kind == "compressed-KV FP4")
        top, grid = GRID_MAX[fmt], E4M3_GRID if fmt == "e4m3" else E2M1_GRID
        floor = 1e-4 if fmt == "e4m3" else 6.0 * 2.0**-9 if e4m3_scales else 6.0 * 2.0**-126
        blocks = x.detach().unflatten(-1, (-1, block_size))
        amax = blocks.abs().amax(-1)
        # HF's scales, as HF computes them (the same float32 operations)
        if e4m3_scales:
            scale = (amax.clamp_min(floor) / top).to(torch.float8_e4m3fn).float()
        else:
            scale = self.m._pow2_ceil_scale(amax.clamp_min(floor) * (1.0 / top))
        s64, amax64 = scale.double().unsqueeze(-1), amax.double().unsqueeze(-1)
        a = (blocks.double().abs() / s64).clamp_max(top)
        mid, lo, hi = nearest_midpoint(a, grid)
        t = amax.clamp_min(floor).double() / top  # where the scale jumps, in t: a power of two, or an e4m3 midpoint
        if e4m3_scales:
            t_mid, t_lo, t_hi = nearest_midpoint(t, E4M3_GRID)
        else:
            mantissa, exponent = torch.frexp(t)  # t = mantissa * 2^exponent, mantissa in [0.5, 1)
            t_lo = torch.exp2(exponent.double() - 1)
            t_mid = torch.where(mantissa < 0.75, t_lo, 2 * t_lo)  # the nearest power of two
            t_lo, t_hi = t_mid, 2 * t_mid  # the two scales that power of two separates
        if self.mode == "find":
            element = ((a - mid).abs() * s64 / amax64).where(amax64 > 0, INF).flatten(-2)
            self._find(element, kind, lambda i: self._where(kind, x, i, "channel"))
            jump = ((t - t_mid).abs() / t).where(amax >= floor, INF)
            self._find(jump, f"{kind} scale", lambda i: self._where(f"{kind} scale", x, i, "block"))
            return out
        target = self.target
        if target is None or target.call != self.calls:
            return out
        self.flipped = True
        out = out.clone()
        i = target.index
        if target.kind == kind:  # an element: the grid value on the other side of its midpoint
            b = i[:-1] + (i[-1] // block_size,)
            j = b + (i[-1] % block_size,)
            chosen = float(out[i].abs()) / float(scale[b])
            assert chosen in (float(lo[j]), float(hi[j])), (target, chosen, float(lo[j]), float(hi[j]))
            other = float(hi[j]) if chosen == float(lo[j]) else float(lo[j])
            out[i] = math.copysign(other * float(scale[b]), float(x[i]))
            return out
        assert float(scale[i]) in (float(t_lo[i]), float(t_hi[i])), (target, float(scale[i]))
        flipped = float(t_hi[i]) if float(scale[i]) == float(t_lo[i]) else float(t_lo[i])
        s = torch.tensor(flipped, dtype=torch.float32)
        q = (blocks[i] / s).clamp(-top, top)
        if fmt == "e4m3":
            values = q.to(torch.float8_e4m3fn).float()
        else:
            values = self.m._fp4_lut(q.device)[self.m._e2m1_codes(q).long()]
        first = i[-1] * block_size
        out[i[:-1] + (slice(first, first + block_size),)] = values * s
        return out

    def topk(self, scores: torch.Tensor, k: int, result: Any) -> Any:
        """One top-k over the last axis of `scores` (rows: [B, S] for the indexer and the candidate blocks, [S] for
        the router) and HF's `result`: the near rows, or `result` with the target row's k-th entry swapped."""
        self.calls += 1
        if k >= scores.shape[-1]:
            return result  # everything is kept: no choice
        kind = f"{self.cond.site} top-{k}"
        layer, pos = self.cond.layer, self.cond.positions
        s = scores.detach().double()
        chosen = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, result.indices, True)
        kth = s.masked_fill(~chosen, INF).amin(-1)  # the least chosen score, the greatest one left out
        next_ = s.masked_fill(chosen, -INF).amax(-1)
        if self.mode == "find":
            finite = torch.isfinite(kth) & torch.isfinite(next_)  # +inf: the pinned newest block; -inf: unreachable
            scale = torch.maximum(kth.abs(), next_.abs())
            gap = ((kth - next_) / scale).where(scale > 0, 0.0)  # an exact tie (of zeros too) is a gap of 0
            self._find(gap.where(finite, INF), kind, lambda i: f"{kind}, layer {layer}, position {pos[i[-1]]}")
            return result
        target = self.target
        if target is None or target.call != self.calls:
            return result
        self.flipped = True
        r = target.index
        row = s[r]
        dropped = int(torch.nonzero(row.masked_fill(~chosen[r], INF) == kth[r])[-1])
        added = int(torch.nonzero(row.masked_fill(chosen[r], -INF) == next_[r])[0])
        indices, values = result.indices.clone(), result.values.clone()
        slot = int(torch.nonzero(indices[r] == dropped)[0])
        indices[r + (slot,)], values[r + (slot,)] = added, scores[r + (added,)]
        return torch.return_types.topk((values, indices))


def alternatives(ref: Reference, decisions: Decisions, prompt: list[int], greedy: list[int]) -> dict[str, Any]:
    """The near decisions of one full forward of prompt + greedy tokens (S), and for each of the nearest MAX_FLIPS,
    the logprobs of S[i] (i >= 1) that a full forward with it flipped moves by more than MOVED, and the greedy
    positions whose argmax it changes."""
    seq = prompt + greedy

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        logits = ref.logits(seq, ref.start())
        logprobs = torch.log_softmax(logits, dim=-1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
        return torch.cat([torch.zeros(1), logprobs]), logits.argmax(-1)

    with decisions.running("find"):
        base, _ = forward()
    near = sorted(decisions.near, key=lambda n: (n.margin, n.call, n.index))
    out: dict[str, Any] = {"near": Counter(n.kind for n in near), "flips": 0, "alternatives": [], "changes": []}
    out["largest"] = 0.0
    with decisions.running(""):
        again, argmax = forward()
    assert torch.equal(base, again), "a forward differs from the one before it"
    assert argmax[len(prompt) - 1 : -1].tolist() == greedy, "the full forward's argmax is not the greedy tokens"
    for n in near[:MAX_FLIPS]:
        with decisions.running("flip", n):
            flipped, argmax = forward()
        out["flips"] += 1
        moved = [i for i in range(1, len(seq)) if abs(float(flipped[i]) - float(base[i])) > MOVED]
        changed = [i for i in range(len(prompt), len(seq)) if int(argmax[i - 1]) != seq[i]]
        where = f"{n.where}, margin {n.margin:.1e}" + (f"; the argmax changes at {changed}" if changed else "")
        if changed:
            out["changes"].append(where)
        if moved:
            out["largest"] = max(out["largest"], float((flipped - base).abs().max()))
            logprobs = [round(float(flipped[i]), 6) for i in moved]  # 1e-6: far under any tolerance; a smaller file
            out["alternatives"].append({"where": where, "positions": moved, "logprobs": logprobs})
    return out


# ---- main -------------------------------------------------------------------------------------------------------


def dump(obj: dict[str, Any]) -> str:
    """JSON with one top-level key (and one `engram` key) a line: diffable, and identical for identical data."""
    lines = []
    for key, value in obj.items():
        if key == "alternatives":  # one alternative a line
            per = [",\n".join(f"    {json.dumps(alt)}" for alt in alts) for alts in value]
            lines.append(f"  {json.dumps(key)}: [\n" + ",\n".join(f"   [\n{p}\n   ]" for p in per) + "\n  ]")
        elif isinstance(value, dict):
            inner = ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            lines.append(f"  {json.dumps(key)}: {{\n{inner}\n  }}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transformers-src", type=Path, required=True, help=f"transformers@{TRANSFORMERS_COMMIT}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--any-source", action="store_true", help="accept modeling files of another commit")
    args = parser.parse_args()
    start = time.perf_counter()
    torch.set_num_threads(1)  # one reduction order: the same floats on every run
    torch.manual_seed(0)  # HF's own initialisation (every value is then overwritten from the checkpoint)

    with tempfile.TemporaryDirectory() as tmp:
        m, configuration = import_hf(args.transformers_src.resolve(), Path(tmp), args.any_source)
        folder = write_tiny_v41(Path(tmp) / "checkpoint", seed=args.seed)
        config = json.loads((folder / "config.json").read_text())
        composite = configuration.DeepseekV41Config(**config)  # the composite config.json parses as HF's
        text_config = {k: v for k, v in config["text_config"].items() if k != "model_type"}
        cfg = configuration.DeepseekV41TextConfig(**text_config)
        assert composite.get_text_config().to_dict() == cfg.to_dict()
        model = m.DeepseekV41ForCausalLM(cfg)
        fp8_block = tuple(config["quantization_config"]["weight_block_size"])
        assert len(fp8_block) == 2
        dtypes = load_checkpoint(model, folder, (int(fp8_block[0]), int(fp8_block[1])))
        model = model.float().eval()
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        model.model.bind_tokenizer(tokenizer)
        print(f"transformers {transformers.__version__}, torch {torch.__version__}, source {TRANSFORMERS_COMMIT}")
        print(f"checkpoint: {sum(dtypes.values())} tensors {dtypes}, {sum(p.numel() for p in model.parameters()):,}")

    # the engram hashing as HF has it
    state = model.model.engram_hash_state
    token_map, compressed_vocab = m.build_compressed_token_map(tokenizer)
    assert compressed_vocab == cfg.engram_compressed_vocab_size, compressed_vocab
    assert state.token_map.tolist() == token_map
    layout_primes = [[list(per) for per in layer] for layer in state.layout.primes]
    assert layout_primes == engram_primes(config["text_config"]), (layout_primes, engram_primes(config["text_config"]))
    assert [sum(sum(per) for per in layer) for layer in layout_primes] == list(cfg.engram_num_embeddings)

    prompts = [([BOS] + tokenizer(text, add_special_tokens=False)["input_ids"])[:n] for text, n in PROMPTS]
    assert [len(p) for p in prompts] == [n for _, n in PROMPTS]
    fresh = m.DeepseekV41NgramHashState(cfg, tokenizer)
    positions = torch.arange(len(prompts[0])).unsqueeze(0)
    hash_ids = fresh(torch.tensor([prompts[0]]), positions, None)[0]  # [positions, engram layers, columns]
    engram = {
        "compressed_vocab_size": compressed_vocab,
        "token_map": token_map,
        "pad_id": int(state.pad_id),
        "multipliers": state.multipliers.tolist(),
        "primes": state.primes.tolist(),
        "offsets": state.offsets.tolist(),
        "hash_ids": hash_ids.tolist(),
    }

    cond = Conditioning()
    decisions = Decisions(m, cond)
    seen = instrument(m, cond, decisions)
    cond.attach(m, model)
    ref = Reference(m, model, model.config)
    runs = [ref.run(p) for p in prompts]
    counts = routing(model, prompts[0], ref)

    # sanity: the model is not degenerate, the MoE routes, HF's fake-quantizers run at this size
    for p, run in zip(prompts, runs):
        greedy = run["greedy"]
        print(
            f"prompt of {len(p)} tokens: logits mean {run['logits_mean']:.4f} std {run['logits_std']:.4f}; greedy "
            f"{greedy[:8]}... ({len(set(greedy))} distinct of {len(greedy)}: {tokenizer.decode(greedy)!r})"
        )
        over = [(step, f"{d:.1e}") for step, d in enumerate(run["reforward_diffs"]) if d > TOLERANCE]
        print(f"  greedy steps whose cached decode and full re-forward differ by over {TOLERANCE}: {over or 'none'}")
        chunked = torch.log_softmax(ref.chunked_logits(p, CHUNK), dim=-1)
        moved = [
            (i, f"{abs(float(chunked[i - 1, p[i]]) - lp):.1e}")
            for i, lp in enumerate(run["prompt_logprobs"])
            if lp is not None and abs(float(chunked[i - 1, p[i]]) - lp) > TOLERANCE
        ]
        print(f"  prompt logprobs of a prefill in chunks of {CHUNK} off by over {TOLERANCE}: {moved or 'none'}")
        assert 0.5 < run["logits_std"] < 3.0, run["logits_std"]
        assert len(set(greedy)) >= 4, greedy
    for i, c in enumerate(counts):
        assert sum(n >= 2 for n in c) >= 4, (i, c)
    print("tokens per expert (prompt 0):", " ".join(f"L{i}={c}" for i, c in enumerate(counts)))
    print("HF fake-quant calls (format, block, scales, active):", dict(seen["fake_quant"]))
    assert all(active for (_, _, _, active) in seen["fake_quant"]), "a fake-quantizer skipped its tensor"

    # each decision of one full forward of each prompt + greedy tokens within NEAR of its boundary, taken the other
    # way, one at a time (see "Alternatives" in the module docstring); before model.double()
    flips: list[dict[str, Any]] = []
    for p, run in zip(prompts, runs):
        begun = time.perf_counter()
        flips.append(alternatives(ref, decisions, p, run["greedy"]))
        near, alts = flips[-1]["near"], flips[-1]["alternatives"]
        covered = sorted({i for alt in alts for i in alt["positions"]})
        print(
            f"prompt of {len(p)} tokens: {sum(near.values())} decisions within {NEAR} of their boundaries "
            f"({dict(near)}); {flips[-1]['flips']} flipped{' (the cap)' if flips[-1]['flips'] == MAX_FLIPS else ''} "
            f"in {time.perf_counter() - begun:.1f}s, {len(alts)} moving a logprob by over {MOVED} at "
            f"{len(covered)} of {len(p) + N_GREEDY - 1} positions (the largest move {flips[-1]['largest']:.1e}); "
            f"{len(flips[-1]['changes'])} change the argmax at a greedy position"
            + "".join(f"\n  {change}" for change in flips[-1]["changes"])
        )

    # the conditioning of every decision on each prompt + greedy tokens, in float32, then in float64 (the same model)
    measured: list[list[dict[str, Any]]] = [
        [conditioning(ref, cond, p, run["greedy"])] for p, run in zip(prompts, runs)
    ]
    model.double()
    for p, run, per in zip(prompts, runs, measured):
        per.append(conditioning(ref, cond, p, run["greedy"]))
    conditions: list[dict[str, Any]] = []
    thin: list[str] = []
    for p, per in zip(prompts, measured):
        for dtype, summary in zip(("float32", "float64"), per):
            near = dict(summary["near"]) or "none"
            print(
                f"prompt of {len(p)} tokens, {dtype}: {summary['decisions']} decisions on both paths, least margin "
                f"{summary['margin']:.2e} at {summary['where']}; within {CLEAR}: {near}; "
                f"exact top-k ties: {summary['ties']}"
            )
        margin, where, dtype = min((m["margin"], m["where"], d) for d, m in zip(("float32", "float64"), per))
        conditions.append({"margin": float(f"{margin:.3g}"), "where": f"{where}, {dtype}"})
        if margin < MARGIN:
            thin.append(f"the {len(p)}-token prompt: {margin:.2e} at {where}, {dtype}")
    if thin:
        raise SystemExit(f"decisions within {MARGIN} of their boundaries (choose other prompts): " + "; ".join(thin))

    reference = {
        "transformers_commit": TRANSFORMERS_COMMIT,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "seed": args.seed,
        "prompts": prompts,
        "prompt_logprobs": [run["prompt_logprobs"] for run in runs],
        "greedy": [run["greedy"] for run in runs],
        "greedy_logprobs": [run["greedy_logprobs"] for run in runs],
        "engram": engram,
        "conditioning": conditions,
        "alternatives": [f["alternatives"] for f in flips],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump(reference))
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
