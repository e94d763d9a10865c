"""`jaxserve plan` and the fit check of `serve`: weights per device from the abstract weights (by format), step
temporaries from compiled steps, and the KV left, checked against hand arithmetic and the live arrays; Flash as
released fits 8 x 80 GB on its weights, dequantized it does not; `serve` refuses a model that cannot fit before
loading it; the `pro` preset is DeepSeek-V4-Pro's published geometry, and `plan --num-nodes N --devices-per-node D`
keeps tensor parallelism inside a node."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import pytest

from jaxserve.cli.main import main
from jaxserve.config import ConfigError, EngineConfig, SpeculativeConfig
from jaxserve.kernels.quant import FP4
from jaxserve.model.cache import bytes_per_token
from jaxserve.model.sharding import make_mesh, place
from jaxserve.model.weights import abstract_weights, init_weights
from jaxserve.presets import preset
from jaxserve.runner.plan import (
    LEGACY_MEMORY_FRACTION_ENV,
    MEMORY_FRACTION_ENV,
    Plan,
    give_the_allocator,
    make_plan,
    memory_share,
    node_layout,
    parameter_counts,
    usable_memory,
    weight_bytes,
)

FLASH = preset("flash", dtype="bfloat16")
PRO = preset("pro", dtype="bfloat16")
TINY = preset("tiny", dtype="bfloat16")
SMALL_ENGINE = EngineConfig(
    max_num_seqs=4, chunked_prefill_size=16, max_prefill_rows=1, page_size=16, max_model_len=128
)


def test_flash_as_released_fits_8_devices_on_its_weights_and_dequantized_is_over_three_times_larger():
    per_device, by_format, total = weight_bytes(FLASH, make_mesh(8, 1))
    # Routed experts by hand: 43 layers x 3 matrices x 256 experts x 4096 x 2048 FP4 values, two per byte, over
    # 8 devices; one ue8m0 scale per 32 values.
    expert_values = 43 * 3 * 256 * 4096 * 2048
    assert by_format[FP4] == expert_values // 2 // 8
    assert by_format["scales"] >= expert_values // 32 // 8
    assert per_device <= 24e9
    dense_per_device, _, dense_total = weight_bytes(FLASH.dequantized(), make_mesh(8, 1))
    assert total <= 0.30 * dense_total and per_device <= 0.30 * dense_per_device
    assert dense_per_device > 70e9  # 569 GB of bf16 over 8 devices


MEMORY = 4_000_000


@pytest.fixture(scope="module")
def tiny_plans() -> dict[str, Plan]:
    """Tiny's plan on 2 x 4 devices of MEMORY bytes, by KV cache dtype (each compiles its two steps)."""
    return {
        kv: make_plan(TINY, dataclasses.replace(SMALL_ENGINE, kv_cache_dtype=kv), make_mesh(2, 4), MEMORY)
        for kv in ("bfloat16", "fp8")
    }


def test_plan_matches_hand_arithmetic_and_the_live_arrays(tiny_plans):
    mesh = make_mesh(2, 4)
    plan = tiny_plans["bfloat16"]
    weights = place(init_weights(jax.random.key(0), TINY), abstract_weights(TINY), mesh)
    live = sum(shard.data.nbytes for leaf in jax.tree.leaves(weights) for shard in leaf.addressable_shards)
    assert plan.weights_bytes_per_device * mesh.size >= live >= plan.weights_bytes_per_device  # some replicated
    assert plan.weights_bytes_per_device == max(
        sum(s.data.nbytes for leaf in jax.tree.leaves(weights) for s in leaf.addressable_shards if s.device == d)
        for d in mesh.devices.flat
    )
    # Tiny's layers: SWA, CSA, HCA, CSA, SWA; bf16 entries: a CSA token adds (32 + 16) x 2 bytes / 4, an HCA one
    # 32 x 2 / 8.
    assert plan.kv_bytes_per_token == 2 * (32 + 16) * 2 / 4 + 32 * 2 / 8
    assert plan.temp_bytes_per_device > 0 and len(plan.compiled_steps) == 2
    left = MEMORY - plan.weights_bytes_per_device - plan.temp_bytes_per_device - plan.state_bytes_per_device
    assert plan.max_kv_tokens == int(left // plan.kv_bytes_per_token) // 16 * 16
    assert plan.max_concurrent_requests == min(4, plan.max_kv_tokens // 128) and plan.fits


def test_with_drafting_the_plan_counts_the_verify_steps_temporaries():
    """With --speculative-config every decode step is one verify step (k drafts, a forward of k+1 tokens per row,
    acceptance), compiled whole: the plan counts its temporaries, more than the plain decode step's."""
    drafting = dataclasses.replace(TINY, nextn_layers=1).with_mtp(1)
    decode = dataclasses.replace(SMALL_ENGINE, mixed_batches=False)
    plain = make_plan(drafting, decode, make_mesh(1, 1, jax.devices()[:1]), MEMORY)
    verify = make_plan(
        drafting,
        dataclasses.replace(decode, speculative_config=SpeculativeConfig("mtp", 2)),
        make_mesh(1, 1, jax.devices()[:1]),
        MEMORY,
    )
    assert verify.compiled_steps == plain.compiled_steps == ["decode rows=4 chunk=1", "prefill rows=1 chunk=16"]
    assert verify.temp_bytes_per_device > plain.temp_bytes_per_device > 0


def test_step_temporaries_hold_one_layer_of_converted_weights_not_a_copy_of_every_layer():
    """XLA:CPU computes bf16 dots in f32; were the conversion hoisted out of the layer scan, the plan would count an
    f32 copy of every layer's weights (here 2x the weights) as temporaries, which no accelerator needs."""
    hca = "heavily_compressed_attention"
    experts_heavy = preset(
        "tiny",
        dtype="bfloat16",
        hidden_size=256,
        moe_intermediate_size=512,
        n_routed_experts=64,
        num_hash_layers=0,
        num_hidden_layers=6,
        layer_types=[hca] * 6,
    )
    plan = make_plan(experts_heavy, SMALL_ENGINE, make_mesh(1, 1, jax.devices()[:1]), 10**12)
    assert plan.temp_bytes_per_device < plan.weights_bytes_per_device / 4


def test_fp8_kv_fits_more_tokens_in_the_same_memory(tiny_plans):
    bf16, fp8 = tiny_plans["bfloat16"], tiny_plans["fp8"]
    # Tiny's fp8 entries: 24 e4m3 non-RoPE dims + one ue8m0 scale + 8 bf16 RoPE dims = 41 B; indexer keys 16 e4m3
    # dims + a float32 scale = 20 B; two CSA layers at rate 4 and one HCA layer at rate 8.
    assert fp8.kv_bytes_per_token == 2 * (41 + 20) / 4 + 41 / 8 < bf16.kv_bytes_per_token
    assert fp8.state_bytes_per_device < bf16.state_bytes_per_device  # the window rings are fp8 too
    assert fp8.temp_bytes_per_device > 0 and fp8.fits
    left = MEMORY - fp8.weights_bytes_per_device - fp8.temp_bytes_per_device - fp8.state_bytes_per_device
    assert fp8.max_kv_tokens == int(left // fp8.kv_bytes_per_token) // 16 * 16 > bf16.max_kv_tokens


def test_cli_plan_reports_fp8_kv_bytes_per_token(capsys):
    # 1 GB devices: Flash's weights alone do not fit, so nothing is compiled; the KV sizes are reported anyway.
    status = main(
        [
            "plan",
            "--preset",
            "flash",
            "--tensor-parallel-size",
            "8",
            "--device-memory",
            "1GB",
            "--kv-cache-dtype",
            "fp8",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert status == 1 and report["reason"].startswith("weights need")
    assert report["kv_bytes_per_token"] == bytes_per_token(FLASH, "fp8") == 3844.84375


def test_cli_plan_json_and_serve_refuse_a_model_that_does_not_fit(capsys, tmp_path):
    status = main(
        [
            "plan",
            "--preset",
            "tiny",
            "--tensor-parallel-size",
            "2",
            "--expert-parallel-size",
            "4",
            "--device-memory",
            "100KB",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert status == 1 and not report["fits"] and report["reason"].startswith("weights need")
    for key in (
        "weights_bytes_per_device",
        "temp_bytes_per_device",
        "kv_bytes_per_token",
        "max_kv_tokens",
        "compile_s",
    ):
        assert key in report

    status = main(["serve", "--device-memory", "100KB", "--port", "0"])
    err = capsys.readouterr().err
    assert status == 2 and "does not fit" in err and "weights need" in err


def test_only_jax_share_of_a_device_is_usable_so_flash_in_bf16_does_not_fit_80gib_on_its_weights(capsys, monkeypatch):
    flash_bf16 = [
        "plan",
        "--preset",
        "flash",
        "--tensor-parallel-size",
        "8",
        "--device-memory",
        "80GiB",
        "--quantization",
        "none",
        "--json",
    ]
    monkeypatch.delenv(MEMORY_FRACTION_ENV, raising=False)
    monkeypatch.delenv(LEGACY_MEMORY_FRACTION_ENV, raising=False)
    status = main(flash_bf16)
    report = json.loads(capsys.readouterr().out)
    assert report["device_memory"] == int(80 * 2**30 * 0.75)  # JAX's GPU allocator takes 75% unless told
    assert status == 1 and not report["fits"] and report["reason"].startswith("weights need 74.9 GB per device")
    monkeypatch.setenv(MEMORY_FRACTION_ENV, "most")
    assert main(flash_bf16) == 2 and f"{MEMORY_FRACTION_ENV}='most'" in capsys.readouterr().err
    # --gpu-memory-utilization is the share when given: the variable (still 'most') is not read.
    assert main([*flash_bf16, "--gpu-memory-utilization", "0.5"]) == 1
    assert json.loads(capsys.readouterr().out)["device_memory"] == int(80 * 2**30 * 0.5)


@pytest.mark.parametrize(
    "flag, env, share",
    [
        (None, {}, (0.75, "JAX's default")),
        (None, {LEGACY_MEMORY_FRACTION_ENV: "0.6"}, (0.6, f"${LEGACY_MEMORY_FRACTION_ENV}")),
        (None, {MEMORY_FRACTION_ENV: "0.5"}, (0.5, f"${MEMORY_FRACTION_ENV}")),
        (0.9, {MEMORY_FRACTION_ENV: "0.5", LEGACY_MEMORY_FRACTION_ENV: "0.6"}, (0.9, "--gpu-memory-utilization")),
    ],
)
def test_the_memory_share_is_the_flag_else_jax_allocators_variables(flag, env, share, monkeypatch):
    for name in (MEMORY_FRACTION_ENV, LEGACY_MEMORY_FRACTION_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert memory_share(flag) == share
    # The allocator is told the flag's share under jaxlib's name alone (it refuses both names at once); unset, the
    # variables are left as they are.
    give_the_allocator(flag)
    told = {name: os.environ.get(name) for name in (MEMORY_FRACTION_ENV, LEGACY_MEMORY_FRACTION_ENV)}
    if flag is None:
        assert told == {name: env.get(name) for name in told}
    else:
        assert told == {MEMORY_FRACTION_ENV: str(flag), LEGACY_MEMORY_FRACTION_ENV: None}
    assert memory_share()[0] == share[0]  # what JAX's allocator takes is what the plan counts


def test_a_memory_share_out_of_range_is_refused():
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=1.2: must be a number in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=1.2)


def test_device_memory_sizes_parse():
    from jaxserve.config import ConfigError, parse_bytes

    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("141GB") == 141 * 10**9 and parse_bytes("24e9") == 24e9
    with pytest.raises(ConfigError, match="not a size"):
        parse_bytes("lots")


def test_pro_is_the_published_geometry_of_about_1_6t_parameters_49b_active():
    # DeepSeek reports V4-Pro as about 1.6T parameters, 49B active (the team's notes, dsv4-model.md 1.3). Our count
    # leaves out the MTP block (about one more layer, 1.6% of the whole) and rounds nothing: within 3% and 5%.
    total, active = parameter_counts(PRO)
    assert abs(total - 1.6e12) <= 0.03 * 1.6e12
    assert abs(active - 49e9) <= 0.05 * 49e9
    # Of them, the routed experts by hand: 61 layers x 3 matrices x 384 experts x 7168 x 3072, 6 of 384 active.
    routed = 61 * 3 * 384 * 7168 * 3072
    assert total - active == routed - routed * 6 // 384
    # The published layer schedule, not HF's default (off by one): layers 0-1 HCA, then CSA on the even layers and
    # HCA on the odd ones, 30 and 31 in all; the first three layers route by the hash table.
    assert PRO.layer_kinds == tuple("hca" if i < 2 or i % 2 else "csa" for i in range(61))
    assert (PRO.layer_kinds.count("csa"), PRO.layer_kinds.count("hca")) == (30, 31)
    assert PRO.hash_layers == (True,) * 3 + (False,) * 58
    assert (PRO.n_routed_experts, PRO.num_experts_per_tok, PRO.routed_scaling_factor, PRO.index_topk) == (
        384,
        6,
        2.5,
        1024,
    )


def test_a_node_layout_keeps_tensor_parallelism_inside_a_node_and_holds_the_least_weights():
    two = node_layout(PRO, 2, 8)
    assert (two.tensor_parallel_size, two.expert_parallel_size) == (8, 2)
    # Every TP dividing the node, EP the rest of the 16 devices; the experts split over all 16 whichever, so a wider
    # TP (attention and the vocabulary split further) holds strictly less.
    assert list(two.candidates) == ["8 x 2", "4 x 4", "2 x 8", "1 x 16"]
    held = list(two.candidates.values())
    assert all(isinstance(b, int) for b in held) and held == sorted(set(held))
    # Nodes of 6: Pro's 128 heads split neither 6 nor 3 ways, so TP 2 within the node, its 384 experts over 12.
    six = node_layout(PRO, 2, 6)
    assert (six.tensor_parallel_size, six.expert_parallel_size) == (2, 6)
    assert "cannot split heads (128) over tensor_parallel_size=6" in str(six.candidates["6 x 2"])
    # Nodes of 3: Flash's 64 heads do not split 3 ways, nor its 256 experts over 6 devices.
    with pytest.raises(ConfigError, match="--num-nodes 2 --devices-per-node 3: no layout") as refused:
        node_layout(FLASH, 2, 3)
    assert "heads (64)" in str(refused.value) and "experts (256)" in str(refused.value)
    with pytest.raises(ConfigError, match="--num-nodes=0: must be a positive integer"):
        node_layout(PRO, 0, 8)


def test_cli_plan_on_two_nodes_reports_the_layout_and_the_per_device_figures(capsys):
    """16 devices, more than the tests' 8 fake ones: the plan compiles on a CPU client of its own."""
    argv = ["plan", "--preset", "pro", "--num-nodes", "2", "--devices-per-node", "8", "--device-memory", "141GB"]
    status = main([*argv, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["fits"] and report["devices"] == 16
    layout = report["layout"]
    assert (layout["num_nodes"], layout["devices_per_node"]) == (2, 8)
    assert (layout["tensor_parallel_size"], layout["expert_parallel_size"]) == (8, 2)
    # Per device: the routed experts by hand, 61 x 3 x 384 x 7168 x 3072 FP4 values, two a byte, over 16 devices.
    assert report["weights_bytes_by_format"][FP4] == 61 * 3 * 384 * 7168 * 3072 // 2 // 16
    assert report["weights_bytes_per_device"] == layout["candidates"]["8 x 2"]
    assert report["device_memory"] == usable_memory(141 * 10**9)
    assert report["kv_bytes_per_token"] == bytes_per_token(PRO, "bfloat16")
    assert report["temp_bytes_per_device"] > 0 and len(report["compiled_steps"]) == 2
    left = (
        report["device_memory"]
        - report["weights_bytes_per_device"]
        - report["temp_bytes_per_device"]
        - report["state_bytes_per_device"]
    )
    page = EngineConfig().page_size
    assert report["max_kv_tokens"] == int(left // report["kv_bytes_per_token"]) // page * page > 8 * 16384


def test_cli_plan_on_nodes_prints_the_layout_and_refuses_bad_node_flags_naming_them(capsys):
    # 10 GB devices: Pro's weights alone do not fit 2 x 6 of them, so nothing is compiled; the layout is printed.
    status = main(["plan", "--preset", "pro", "--num-nodes", "2", "--devices-per-node", "6", "--device-memory", "10GB"])
    out = capsys.readouterr().out
    assert status == 1
    assert "layout: 2 node(s) x 6 devices: tensor parallel 2 within each node, expert parallel 6" in out
    assert "6 x 2: cannot split heads (128)" in out and "12 device(s) of 10.0 GB" in out
    assert "tensor x expert = 2 x 6" in out and "fits: no: weights need" in out
    for argv, message in (
        (["--num-nodes", "2"], "jaxserve plan: --num-nodes needs --devices-per-node too"),
        (["--devices-per-node", "8"], "jaxserve plan: --devices-per-node needs --num-nodes too"),
        (
            ["--num-nodes", "2", "--devices-per-node", "8", "--tensor-parallel-size", "8"],
            "--num-nodes and --devices-per-node choose the layout",
        ),
        (["--num-nodes", "2", "--devices-per-node", "3"], "jaxserve: error: --num-nodes 2 --devices-per-node 3:"),
    ):
        assert main(["plan", "--preset", "flash", "--device-memory", "80GB", *argv]) == 2
        assert message in capsys.readouterr().err


def test_each_disaggregated_role_is_sized_by_its_own_steps(tiny_plans):
    """A prefill server compiles prefill steps only, a decode server decode steps only: each plan's temporaries are
    its own kind's, and the colocated plan's are the larger of the two."""
    mesh = make_mesh(2, 4)
    roles = {
        mode: make_plan(
            TINY, dataclasses.replace(SMALL_ENGINE, disaggregation_mode=mode, kv_cache_dtype="bfloat16"), mesh, MEMORY
        )
        for mode in ("prefill", "decode")
    }
    colocated = tiny_plans["bfloat16"]
    assert roles["prefill"].compiled_steps == ["prefill rows=1 chunk=16"]
    assert roles["decode"].compiled_steps == ["decode rows=4 chunk=1"]
    assert colocated.compiled_steps == ["decode rows=4 chunk=1", "prefill rows=1 chunk=16"]
    temps = [roles[mode].temp_bytes_per_device for mode in ("prefill", "decode")]
    assert max(temps) == colocated.temp_bytes_per_device and all(t is not None and t > 0 for t in temps)
    assert [roles[mode].disaggregation_mode for mode in ("prefill", "decode")] == ["prefill", "decode"]
