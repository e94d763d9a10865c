"""Issue 3: KV-cache bytes the runner allocates for DeepSeek-V4-Flash (bf16), from the abstract cache description
(jaxserve.model.cache.abstract_cache / cache_nbytes): shapes only, nothing is allocated. Compared with the hand
arithmetic of the model card.

- per token: the paged pools (compressed entries, and the indexer's keys on CSA layers), which grow with context;
- per slot (per concurrent sequence), fixed: the sliding-window ring of every layer, plus the compressor state
  (partial window, and for the overlapped CSA kind the previous window's A-half), float32.

    .venv/bin/python benchmarks/kv_memory.py [--preset flash] [--dtype bfloat16] [--context 1048576]
"""

from __future__ import annotations

import argparse
from collections import Counter

from common import REPO, configure_jax, markdown_table, write_results

KIB, MIB, GIB = 2**10, 2**20, 2**30


def yes_no(ok: bool) -> str:
    return "yes" if ok else "NO"


def layer_breakdown(cfg, geo) -> list[dict]:
    """Per layer: kind, and bytes of each part of its abstract cache (window, pools, compressor states); a stack
    of `repeats` layers holds each layer's share."""
    from jaxserve.model.cache import abstract_cache
    from jaxserve.model.segments import layer_segments
    from jaxserve.model.weights import weights_nbytes  # bytes of every ArrayInfo in an abstract (sub)tree

    parts = ("window", "entries", "index_entries", "state", "index_state")
    by_layer = {}
    for segment, stacks in zip(layer_segments(cfg), abstract_cache(cfg, geo)):
        for position, (kind, stack) in enumerate(zip(segment.pattern, stacks)):
            one = {"kind": kind.attention, **{p: weights_nbytes(getattr(stack, p)) // segment.repeats for p in parts}}
            by_layer.update({segment.layer(k, position): one for k in range(segment.repeats)})
    return [by_layer[layer] for layer in range(cfg.num_layers)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="flash")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--context", type=int, default=2**20, help="context length for the example totals")
    parser.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    args = parser.parse_args(argv)
    configure_jax(devices=1, compile_cache=False)
    import jax
    from common import geometry

    from jaxserve.model.cache import bytes_per_token, cache_nbytes
    from jaxserve.presets import preset

    cfg = preset(args.preset, dtype=args.dtype)
    live_before = len(jax.live_arrays())
    # One page per slot, two slots: anything that scales with slots is per-slot state, with pages, per token.
    geo = geometry(cfg, slots=2, max_tokens=1, spare_pages=0)
    totals = cache_nbytes(cfg, geo)
    layers = layer_breakdown(cfg, geo)
    assert len(jax.live_arrays()) == live_before, "sizing allocated device arrays"
    tokens = geo.num_pages * geo.page_size
    per_token = totals["paged"] / tokens
    per_slot = totals["per_slot_fixed"] / geo.num_slots
    assert sum(layer["entries"] + layer["index_entries"] for layer in layers) == totals["paged"]

    item = jax.numpy.dtype(cfg.dtype).itemsize
    kinds = Counter(cfg.layer_kinds)
    by_kind = []
    for kind in ("csa", "hca", "swa"):
        group = [layer for layer in layers if layer["kind"] == kind]
        if not group:
            continue
        one = group[0]
        by_kind.append(
            [
                kind.upper(),
                len(group),
                (one["entries"] + one["index_entries"]) / tokens,
                one["window"] // geo.num_slots,
                (one["state"] + one["index_state"]) // geo.num_slots,
            ]
        )
    window_total = sum(layer["window"] for layer in layers) // geo.num_slots
    state_total = sum(layer["state"] + layer["index_state"] for layer in layers) // geo.num_slots

    spec_per_token = (
        kinds["csa"] * (cfg.head_dim + cfg.index_head_dim) * item / cfg.csa_rate
        + kinds["hca"] * cfg.head_dim * item / cfg.hca_rate
    )
    spec_window = cfg.num_layers * cfg.sliding_window * cfg.head_dim * item
    # Official buffers [coff*m, coff*c] fp32, kv and score, for the main and (CSA) the indexer compressor.
    official_csa = sum(2 * (2 * cfg.csa_rate) * (2 * c) * 4 for c in (cfg.head_dim, cfg.index_head_dim))
    official_hca = 2 * cfg.hca_rate * cfg.head_dim * 4

    table = markdown_table(
        ["layer kind", "layers", "paged B/token/layer", "window B/slot/layer", "compressor state B/slot/layer"], by_kind
    )
    csa_state = next((r[4] for r in by_kind if r[0] == "CSA"), 0)
    hca_state = next((r[4] for r in by_kind if r[0] == "HCA"), 0)
    comparison = markdown_table(
        ["quantity", "jaxserve (abstract cache)", "hand arithmetic", "match"],
        [
            [
                "paged KV per token",
                f"{per_token:,.0f} B",
                f"{spec_per_token:,.0f} B "
                f"({kinds['csa']} CSA x {(cfg.head_dim + cfg.index_head_dim) * item // cfg.csa_rate} B + "
                f"{kinds['hca']} HCA x {cfg.head_dim * item // cfg.hca_rate} B)",
                yes_no(per_token == spec_per_token),
            ],
            [
                "window ring per slot",
                f"{window_total:,} B ({window_total / MIB:.2f} MiB)",
                f"{cfg.num_layers} x {cfg.sliding_window} x {cfg.head_dim} x {item} B = {spec_window:,} B",
                yes_no(window_total == spec_window),
            ],
            [
                "CSA compressor state per slot per layer",
                f"{csa_state:,} B ({csa_state / KIB:.0f} KiB)",
                f"about 80 KiB (official [2m, 2c] buffers: {official_csa / KIB:.0f} KiB)",
                "smaller: only the m-token partial window + the A-half are kept",
            ],
            [
                "HCA compressor state per slot per layer",
                f"{hca_state:,} B ({hca_state / KIB:.0f} KiB)",
                f"up to 512 KiB ({official_hca / KIB:.0f} KiB)",
                yes_no(hca_state == official_hca),
            ],
            [
                "fixed state per slot",
                f"{per_slot:,.0f} B ({per_slot / MIB:.2f} MiB): window {window_total / MIB:.2f} "
                f"MiB + compressor {state_total / MIB:.2f} MiB",
                "window about 5.4 MiB, plus compressor state",
                "",
            ],
        ],
    )
    context = args.context
    paged = per_token * context
    example = (
        f"One sequence of {context:,} tokens: paged {paged / 1e9:.2f} GB ({paged / GIB:.2f} GiB) "
        f"(+ {per_slot / MIB:.1f} MiB fixed per slot). Paged KV equals the fixed state at "
        f"{per_slot / per_token:,.0f} tokens. bytes_per_token(cfg) = {bytes_per_token(cfg):,.0f} B."
    )
    print(
        f"{args.preset} ({cfg.dtype}): {cfg.num_layers} layers {dict(kinds)}, page size {geo.page_size} tokens; "
        "sizes from abstract_cache/cache_nbytes, nothing allocated\n"
    )
    print(table + "\n\n" + comparison + "\n\n" + example)

    if not args.no_write:
        data = {
            "preset": args.preset,
            "dtype": cfg.dtype,
            "page_size": geo.page_size,
            "layer_kinds": dict(kinds),
            "paged_bytes_per_token": per_token,
            "spec_bytes_per_token": spec_per_token,
            "window_bytes_per_slot": window_total,
            "compressor_state_bytes_per_slot": state_total,
            "fixed_bytes_per_slot": per_slot,
            "csa_state_bytes_per_layer": csa_state,
            "hca_state_bytes_per_layer": hca_state,
            "official_csa_state_bytes_per_layer": official_csa,
            "example_context": context,
            "example_paged_bytes": per_token * context,
        }
        paths = write_results(
            f"kv_memory_{args.preset}",
            data,
            f"# KV cache memory: {args.preset} ({cfg.dtype})\n\n"
            + table
            + "\n\n"
            + comparison
            + "\n\n"
            + example
            + "\n",
        )
        print("\nwrote " + ", ".join(str(p.relative_to(REPO)) for p in paths))


if __name__ == "__main__":
    main()
