"""The kernel table (jaxserve.kernels.table) is the one place that picks an implementation, and the decode step it
builds has the right algorithms whatever it picks: no branch that a GPU would have to sync on, and no expert stack
decoded whole (XLA's memory analysis of a Flash-shaped layer's compiled step)."""

from __future__ import annotations

import dataclasses
import functools
import subprocess
from pathlib import Path

import jax.numpy as jnp
import pytest
from jax.extend.core import jaxprs_in_params

from jaxserve.kernels import attention, indexer, mhc, moe, quant
from jaxserve.kernels.table import KERNEL_CHOICES, kernels_for
from jaxserve.model.cache import CacheGeometry
from jaxserve.model.sharding import make_mesh, shape_dtype_structs
from jaxserve.model.weights import abstract_weights
from jaxserve.presets import preset
from jaxserve.request.step import GroupShape, StepShape
from jaxserve.runner import Buckets
from jaxserve.runner.plan import AbstractRunner

REPO = Path(__file__).parent.parent
PALLAS_OPS = ("grouped_matmul", "expert_rows", "gated_matmul", "einsum", "sink_attention", "hc_pre", "hc_head")


def test_auto_is_every_reference_on_cpu_and_pallas_where_it_compiles_on_gpus():
    cpu = kernels_for("auto", "cpu")
    assert (
        cpu.grouped_matmul,
        cpu.expert_rows,
        cpu.einsum,
        cpu.sink_attention,
        cpu.indexer_topk,
        cpu.hc_pre,
        cpu.hc_head,
    ) == (
        moe.grouped_matmul,
        moe.expert_rows,
        quant.einsum,
        attention.sink_attention,
        indexer.indexer_topk,
        mhc.hc_pre,
        mhc.hc_head,
    )
    reference_gpu = kernels_for("reference", "gpu")
    # On a GPU the reference expert matmuls decode inside XLA's reduction (kernels.moe's fused_decode form).
    for op, function in (("grouped_matmul", moe.grouped_matmul), ("expert_rows", moe.expert_rows)):
        assert getattr(reference_gpu, op).func is function and getattr(reference_gpu, op).keywords == {
            "fused_decode": True
        }
    # On a GPU the forward traces every layer in line; on CPU it scans a segment's repeats.
    assert reference_gpu.unrolled_layers and not cpu.unrolled_layers and "layers unrolled" in reference_gpu.describe()
    assert (
        dataclasses.replace(
            reference_gpu, grouped_matmul=moe.grouped_matmul, expert_rows=moe.expert_rows, unrolled_layers=False
        )
        == cpu
    )
    gpu = dict(kernels_for("auto", "gpu").implementations)
    assert all(gpu[op] == "pallas" for op in PALLAS_OPS) and gpu["indexer_topk"] == "reference"
    assert kernels_for("pallas", "gpu") == kernels_for("auto", "gpu")
    # Asked for on CPU, the Pallas kernels run interpreted (how the tests run them against the references).
    interpreted = kernels_for("pallas", "cpu")
    for op in PALLAS_OPS:
        kernel = getattr(interpreted, op)
        assert isinstance(kernel, functools.partial) and kernel.keywords == {"interpret": True}, op
    with pytest.raises(ValueError, match=r"kernels='triton': must be one of \('auto', 'reference', 'pallas'\)"):
        kernels_for("triton", "gpu")
    assert KERNEL_CHOICES == ("auto", "reference", "pallas")


def test_no_code_but_the_table_asks_which_backend_it_runs_on():
    found = subprocess.run(
        [
            "git",
            "grep",
            "--untracked",
            "-n",
            "default_backend",
            "--",
            "jaxserve",
            "kernels",
            "server",
            "checkpoints",
            "cli",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout
    assert found == ""
    platform_tests = subprocess.run(
        [
            "git",
            "grep",
            "--untracked",
            "-ln",
            "PALLAS_PLATFORMS\\|\\.platform ==\\|platform in",
            "--",
            "jaxserve",
            "kernels",
            "server",
            "checkpoints",
            "cli",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert platform_tests == ["kernels/table.py"]


def _abstract_runner(cfg, rows: int, kernels: str, max_len: int = 4096) -> AbstractRunner:
    mesh = make_mesh(1, 1)
    pages = rows * -(-max_len // 128)
    geometry = CacheGeometry(num_slots=rows, num_pages=pages, page_size=128, max_pages_per_seq=pages // rows)
    buckets = Buckets(prefill_rows=(1,), prefill_chunks=(16,), decode_rows=(rows,))
    return AbstractRunner(
        cfg, shape_dtype_structs(abstract_weights(cfg), mesh), geometry, mesh, buckets, kernels=kernels
    )


def _primitives(jaxpr) -> set[str]:
    """Every primitive in a jaxpr and the jaxprs nested in it (scan bodies, jitted calls), but not inside a
    pallas_call's kernel: that body becomes one GPU kernel, whose branches are the kernel's own."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name == "pallas_call":
            continue
        for sub in jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


@pytest.mark.parametrize("platform_kernels", ["reference", "pallas"])
def test_a_decode_step_has_no_cond_or_switch(platform_kernels):
    # The tiny FP8 / FP4 model with every layer kind; a batch mixing greedy, sampled and logprob rows is the same
    # compiled step, so the trace covers them all. (Pallas: interpreted on CPU; its kernels' bodies are skipped.)
    cfg = preset("tiny", dtype="float32", hidden_size=128, moe_intermediate_size=64, head_dim=32)
    cfg = cfg.__class__(**{**cfg.__dict__, "linear_format": quant.FP8, "expert_format": quant.FP4})
    runner = _abstract_runner(cfg, rows=4, kernels=platform_kernels, max_len=512)
    decode = set().union(*(_primitives(j.jaxpr) for j in runner.jaxprs(StepShape(decode=GroupShape(4, 1)))))
    assert {"cond", "switch"}.isdisjoint(decode), sorted(decode)
    if platform_kernels == "pallas":  # the walk reached the layers' kernels, inside their jitted wrappers
        assert "pallas_call" in decode
    else:  # the walk reached the layer stack's body (or the Sinkhorn loop's)
        assert "scan" in decode or "while" in decode
    # Prefill steps keep prompt logprobs behind a branch (a chunk's worth of head matmuls): the walk sees it.
    assert "cond" in _primitives(runner.jaxprs(StepShape(prefill=GroupShape(1, 16)))[0].jaxpr)


def test_a_flash_layer_decode_step_never_materialises_a_dequantized_expert_stack():
    # Flash's shapes as released (FP4 experts, FP8 projections, bf16), 4 layers: SWA, SWA, CSA and HCA, hash-routed
    # and learned MoE; decode at batch 8 (48 routed rows, fewer than the 256 experts) with 4K of context. A layer's
    # routed experts (w_gate, w_up, w_down) in bf16 are 12.9 GB; one of the three decoded alone is 4.3 GB. Measured:
    # 0.66 GB of temporaries (the rest is XLA:CPU's f16 copies of FP8 projections); before the experts were read
    # in place and decoded a slice at a time, 4.17 GB.
    cfg = preset("flash", dtype="bfloat16", num_hidden_layers=4)
    expert_stack_bf16 = 3 * cfg.n_routed_experts * cfg.hidden_size * cfg.moe_intermediate_size * 2
    runner = _abstract_runner(cfg, rows=8, kernels="auto")
    temp = runner.temp_bytes(StepShape(decode=GroupShape(8, 1)))
    assert temp < 0.1 * expert_stack_bf16, f"{temp / 1e9:.2f} GB of temporaries"


def _fp8_reads(jaxpr, sliced: list, kernel_operands: list) -> None:
    """The float8 arrays a jaxpr slices out (`sliced`) and those its Pallas calls take (`kernel_operands`), nested
    jaxprs included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            kernel_operands += [v.aval.shape for v in eqn.invars if v.aval.dtype == jnp.float8_e4m3fn]
            continue
        if eqn.primitive.name in ("dynamic_slice", "slice", "gather"):
            sliced += [v.aval.shape for v in eqn.outvars if v.aval.dtype == jnp.float8_e4m3fn]
        for sub in jaxprs_in_params(eqn.params):
            _fp8_reads(sub, sliced, kernel_operands)


def test_on_one_device_the_kernels_read_each_layers_fp8_projections_in_place():
    # Flash's first 4 layers: the two SWA layers are one segment scanned over 2 repeats. Sliced out of their stacks,
    # the projections would be copied every step on a GPU (a Pallas call's operand must exist whole): 12 copies a
    # layer, 126 MB of Flash's weights read and written again.
    cfg = preset("flash", dtype="bfloat16", num_hidden_layers=4)
    reads = {}
    for kernels in ("pallas", "reference"):
        sliced: list = []
        operands: list = []
        for jaxpr in _abstract_runner(cfg, rows=8, kernels=kernels).jaxprs(StepShape(decode=GroupShape(8, 1))):
            _fp8_reads(jaxpr.jaxpr, sliced, operands)
        reads[kernels] = sliced, operands
    assert reads["pallas"][0] == [] and reads["reference"][0]  # the reference slices them (XLA fuses that in)
    assert any(shape[0] == 2 for shape in reads["pallas"][1])  # the scanned segment's stacks, whole
