"""jaxserve.runner.hlo_profile on real deviceless H200 compiles: a loop's kernels count once per trip, a fusion
that slices a large operand counts the slice's bytes, an in-place update counts the update, the cost model prices
fusions, and the grouped expert matmul's Pallas call counts only the experts its rows can use (its own statement,
checked here against the work items its grid loads for concrete group sizes)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.kernels.pallas import expert_rows as xr
from jaxserve.kernels.pallas import grouped_matmul as gmm
from jaxserve.kernels.quant import FP4, FP8, Quantized
from jaxserve.runner.hlo_profile import array_bytes, static_profile
from jaxserve.runner.targets import compile_for_target, target_devices


@pytest.fixture(scope="module")
def mesh():
    return Mesh(target_devices("h200", 1), ("x",))


def _profile(mesh, f, *args):
    shardings = NamedSharding(mesh, PartitionSpec())
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings) for a in args]
    return static_profile(compile_for_target(jax.jit(f), *structs).as_text())


def test_a_loop_multiplies_the_kernels_of_its_body(mesh):
    x, w = jnp.zeros((64, 64), jnp.float32), jnp.zeros((64, 64), jnp.float32)

    def looped(trips):
        return lambda x, w: jax.lax.fori_loop(0, trips, lambda i, x: jnp.tanh(x @ w) + i, x)

    three, seven = _profile(mesh, looped(3), x, w), _profile(mesh, looped(7), x, w)
    per_trip = (seven.launches - three.launches) / 4
    assert per_trip >= 1 and per_trip == int(per_trip)
    assert seven.launches - 7 * per_trip == three.launches - 3 * per_trip  # the same kernels outside the loop
    assert seven.model_seconds() > three.model_seconds() > 0


def test_a_sliced_operand_counts_the_slice(mesh):
    big = jnp.zeros((4096, 1024), jnp.float32)  # 16 MiB
    start = jnp.zeros((), jnp.int32)
    profile = _profile(mesh, lambda a, i: jax.lax.dynamic_slice_in_dim(a, i, 8) * 2.0, big, start)
    assert 0 < profile.bytes < 1e6  # 8 rows read, 8 written: 64 KiB, not the 16 MiB operand


def test_an_operand_gathered_through_a_free_reshape_counts_the_gathered_rows(mesh):
    stack = jnp.zeros((2, 64, 64, 256), jnp.float32)  # 8 MiB: two layers' stacks of 64 matrices
    rows = jnp.zeros((3,), jnp.int32)
    flat = lambda s, r: (s.reshape(128, 64, 256)[r + 64] * 2.0).sum(axis=1)  # noqa: E731 (a layer's experts in place)
    profile = _profile(mesh, flat, stack, rows)
    assert 0 < profile.bytes < 3 * 64 * 256 * 4 * 1.5  # three matrices read (192 KiB), not the whole stack


@pytest.mark.parametrize(
    "update, rows, where",
    [
        (lambda a, r, i: jax.lax.dynamic_update_slice_in_dim(a, r * 3.0, i, 0), 1, ()),
        (lambda a, r, i: a.at[i].set(r * 3.0), 2, (2,)),
    ],
    ids=["dynamic-update-slice", "scatter"],
)
def test_an_update_in_place_counts_the_update_at_its_bytes(mesh, update, rows, where):
    big = jnp.zeros((4096, 1024), jnp.float32)  # 16 MiB, donated: updated in place
    args = (big, jnp.zeros((rows, 1024), jnp.float32), jnp.zeros(where, jnp.int32))
    shardings = NamedSharding(mesh, PartitionSpec())
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings) for a in args]
    profile = static_profile(compile_for_target(jax.jit(update, donate_argnums=0), *structs).as_text())
    assert 0 < profile.bytes < 1e6
    (kernel,) = [
        k for k in profile.kernels if k.bytes * k.launches == max(k.bytes * k.launches for k in profile.kernels)
    ]
    assert kernel.model_us is None  # priced at its bytes / bandwidth, not by XLA's model


def test_a_conditional_counts_its_lightest_branch(mesh):
    big = jnp.zeros((4096, 1024), jnp.float32)
    flag = jnp.zeros((), jnp.bool_)

    def step(a, p):
        return jax.lax.cond(p, lambda a: jnp.sum(jnp.sort(a @ a.T, axis=-1)[:, -1]), lambda a: a[0, 0] * 2.0, a)

    profile = _profile(mesh, step, big, flag)
    assert 0 < profile.bytes < 1e6  # the branch that reads one element, not the one that reads 16 MiB


def test_array_bytes_reads_hlo_shapes():
    assert array_bytes("f32[4,8]{1,0}") == 128
    assert array_bytes("(bf16[2]{0}, u8[3]{0}, f8e4m3fn[5]{0})") == 4 + 3 + 5
    assert array_bytes("s4[6]{0}") == 3


def _work_item_reads(group_sizes: np.ndarray, bm: int, m: int) -> int:
    """Expert reads of the kernel's grid for concrete group sizes: its used work items (one expert load each)."""
    count, *_ = gmm._work_items(jnp.asarray(group_sizes, jnp.int32), 0, bm, -(-m // bm))
    return int(count[0])


@pytest.mark.parametrize("m, e", [(8, 256), (48, 256), (300, 16), (12, 4)])
def test_the_grouped_matmul_statement_bounds_the_experts_its_grid_loads(mesh, m, e):
    d, f = 64, 32
    x = jnp.zeros((m, d), jnp.bfloat16)
    codes = jnp.zeros((2 * e, d // 2, f), jnp.uint8)  # two layers' stacks, as the model passes them
    scales = jnp.zeros((2 * e, d // 32, f), jnp.uint8)
    sizes = jnp.zeros((e,), jnp.int32)
    profile = _profile(mesh, lambda x, c, s, g: gmm.grouped_matmul(x, Quantized(c, s, FP4, (1, 32, 1)), g), x, codes,
                       scales, sizes)  # fmt: skip
    (call,) = [k for k in profile.kernels if k.pallas]
    per_expert = (codes.nbytes + scales.nbytes) / (2 * e)
    bm = min(128, max(16, 1 << (-(-m // e) - 1).bit_length()))  # the kernel's default row tile
    items = -(-m // bm) + e
    stated = gmm.experts_read_at_most(items, m, 2 * e)
    assert call.bytes >= stated * per_expert  # the profile counts the statement's experts
    assert call.bytes < (stated + 8) * per_expert + 4 * x.nbytes + 4 * m * f * 4 + 5 * 4 * items  # and not the stack
    one_each = np.r_[np.ones(min(m, e)), np.zeros(e - min(m, e))]
    one_each[0] += m - one_each.sum()
    spreads = [one_each, np.eye(1, e, 0)[0] * m, np.random.default_rng(m).multinomial(m, np.ones(e) / e)]
    reads = [_work_item_reads(s.astype(np.int64), bm, m) for s in spreads]
    assert max(reads) <= stated  # the statement bounds what the grid loads, for any routing
    if m <= e:
        assert reads[0] == stated  # one row per expert: every bound is reached


@pytest.mark.parametrize("m", [6, 48])  # decode rows: one token's top-6, eight tokens' (the gathered form)
def test_the_reference_expert_matmul_on_a_gpu_reads_each_rows_expert_once_and_writes_nothing_decoded(mesh, m):
    """The reference as the kernel table picks it for a GPU: the rows' expert codes are read once, decoded inside
    the reduction; no kernel writes a decoded expert matrix (before: a gather, a convert writing the decoded rows,
    a dot reading them, in passes)."""
    from jaxserve.kernels.table import kernels_for

    e, d, f = 64, 2048, 1024  # the rows' decoded matrices pass DECODE_PASS_BYTES, as Flash's do
    x = jax.ShapeDtypeStruct((m, d), jnp.bfloat16)
    codes = jax.ShapeDtypeStruct((2 * e, d // 2, f), jnp.uint8)  # two layers' stacks, as the model passes them
    scales = jax.ShapeDtypeStruct((2 * e, d // 32, f), jnp.uint8)
    sizes = jax.ShapeDtypeStruct((e,), jnp.int32)
    reference = kernels_for("reference", "cuda").grouped_matmul
    profile = _profile(mesh, lambda x, c, s, g: reference(x, Quantized(c, s, FP4, (1, 32, 1)), g, e), x, codes,
                       scales, sizes)  # fmt: skip
    touched_codes, touched_scales = m * d // 2 * f, m * d // 32 * f
    assert max(k.bytes for k in profile.kernels) < touched_codes + touched_scales + m * d * f // 2  # none decoded
    # Read once: the codes and scales once, the scales at most once more (a compact gathered copy), x and the out.
    assert profile.bytes < touched_codes + 3 * touched_scales + m * d * 2 + 2 * m * f * 4 + 64 * 1024
    assert profile.launches <= 16


def _fp4_grouped_matmul(x, codes, scales, sizes, every_row_grouped):
    return gmm.grouped_matmul(x, Quantized(codes, scales, FP4, (1, 32, 1)), sizes, every_row_grouped=every_row_grouped)


def test_a_vmapped_grouped_matmul_states_one_expert_a_batch(mesh):
    """The model's per-group output projection (wo_a) maps the kernel over its groups, each group's matrices a
    stack of the segment's layers read in place: each batch reads one matrix of its stack, not the stack."""
    groups, layers, m, d, f = 4, 3, 8, 128, 256
    x = jnp.zeros((groups, m, d), jnp.bfloat16)
    codes = jnp.zeros((groups, layers, d, f), jnp.float8_e4m3fn)
    scales = jnp.zeros((groups, layers, 1, 2), jnp.uint8)
    sizes = jnp.full((1,), m, jnp.int32)

    def per_group(x, c, s):
        call = lambda x, c, s: gmm.grouped_matmul(x, Quantized(c, s, FP8, (1, 128, 128)), sizes, 1)  # noqa: E731
        return jax.vmap(call)(x, c, s)

    (call,) = [k for k in _profile(mesh, per_group, x, codes, scales).kernels if k.pallas]
    one_each = groups * (codes.nbytes + scales.nbytes) / (groups * layers)
    assert one_each <= call.bytes < one_each + 4 * x.nbytes + 4 * groups * m * f * 2


def test_the_grouped_matmul_statement_reads_its_operands_with_or_without_the_zeros(mesh):
    m, e, d, f = 48, 4, 64, 32
    x = jnp.zeros((m, d), jnp.bfloat16)
    codes, scales = jnp.zeros((e, d // 2, f), jnp.uint8), jnp.zeros((e, d // 32, f), jnp.uint8)
    sizes = jnp.zeros((e,), jnp.int32)
    calls = []
    for every_row_grouped in (False, True):
        profile = _profile(
            mesh,
            functools.partial(_fp4_grouped_matmul, every_row_grouped=every_row_grouped),
            x, codes, scales, sizes,
        )  # fmt: skip
        (call,) = [k for k in profile.kernels if k.pallas]
        calls.append(call)
    assert calls[0].bytes == calls[1].bytes  # the aliased zeros are written, never read: the same statement
    assert calls[1].bytes >= codes.nbytes + scales.nbytes + x.nbytes + m * f * 4


@pytest.mark.parametrize("a, e", [(6, 256), (48, 256), (64, 16)])
def test_the_expert_rows_statement_bounds_the_experts_its_programs_load(mesh, a, e):
    """Each program whose row is the first of its expert loads that expert (the touched experts, at most
    min(rows, stack) of them: tests/test_pallas_expert_rows.py checks the rows sharing one are computed together):
    the profile counts that statement, not the stack of two layers of e experts."""
    d, f = 64, 32
    x = jnp.zeros((a, d), jnp.bfloat16)
    codes, scales = jnp.zeros((2 * e, d // 2, f), jnp.uint8), jnp.zeros((2 * e, d // 32, f), jnp.uint8)
    experts = jnp.zeros((a,), jnp.int32)

    def fp4_rows(x, c, s, ids):
        return xr.expert_rows(x, (Quantized(c, s, FP4, (1, 32, 1)),), ids)

    (call,) = [k for k in _profile(mesh, fp4_rows, x, codes, scales, experts).kernels if k.pallas]
    per_expert = (codes.nbytes + scales.nbytes) / (2 * e)
    stated = xr.experts_read_at_most(a, 2 * e)
    assert stated * per_expert <= call.bytes < (stated + 8) * per_expert + 4 * x.nbytes + 4 * a * f * 4
