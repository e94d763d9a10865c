"""ModelConfig parsing: both key sets give the same config; bad configs name the field and the value."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jaxserve.config import ConfigError, DSparkConfig, config_from_dict, load_config, to_hf_dict
from jaxserve.presets import preset, preset_dict


def test_legacy_and_current_keys_agree():
    legacy = preset_dict("flash")  # compress_ratios, num_hash_layers, rope_scaling, qk_rope_head_dim
    cfg = config_from_dict(legacy)
    current = to_hf_dict(cfg)
    assert "compress_ratios" not in current and "layer_types" in current
    assert config_from_dict(current) == cfg
    assert cfg.layer_kinds[:4] == ("swa", "swa", "csa", "hca") and cfg.layer_kinds[-1] == "csa"
    assert sum(k == "csa" for k in cfg.layer_kinds) == 21 and sum(k == "hca" for k in cfg.layer_kinds) == 20
    assert cfg.hash_layers[:4] == (True, True, True, False)


# DeepSeek-V4-Flash-0731's keys (the issue's reading of its config.json): the backbone's compress_ratios and the three
# DSpark stages' zeros at the tail, and the drafter's own keys; num_nextn_predict_layers stays 1.
FLASH_0731 = {
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0, 0, 0],
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [40, 41, 42],
    "dspark_markov_rank": 256,
}


def test_a_0731_config_is_the_backbone_with_a_dspark_drafter_mtp_cannot_run():
    cfg = config_from_dict(preset_dict("flash", **FLASH_0731))
    flash = config_from_dict(preset_dict("flash"))
    assert len(FLASH_0731["compress_ratios"]) == 46 and cfg.layer_kinds == flash.layer_kinds
    assert cfg.dspark == DSparkConfig(
        block_size=5, noise_token_id=128799, target_layer_ids=(40, 41, 42), markov_rank=256, stages=3
    )
    assert config_from_dict(to_hf_dict(cfg)) == cfg and flash.dspark is None
    assert cfg.with_mtp(0) == cfg == cfg.with_drafter(None) and not cfg.dspark_drafting
    assert cfg.with_drafter("dspark").dspark_drafting
    with pytest.raises(ConfigError, match=r"dspark_block_size=5: the checkpoint ships a DSpark drafter .* not MTP"):
        cfg.with_drafter("mtp")
    # The stages are the compress_ratios entries past the backbone's layers.
    two = config_from_dict(
        preset_dict("flash", **{**FLASH_0731, "compress_ratios": FLASH_0731["compress_ratios"][:-1]})
    )
    assert two.dspark is not None and two.dspark.stages == 2
    # Or DeepSeek's inference config's n_mtp_layers (what jaxserve writes: an HF config of layer_types has no
    # compress_ratios), which must agree with compress_ratios where both are given.
    one = dataclasses.replace(cfg, dspark=dataclasses.replace(cfg.dspark, stages=1))
    written = to_hf_dict(one)
    assert written["n_mtp_layers"] == 1 and "compress_ratios" not in written and config_from_dict(written) == one
    with pytest.raises(ConfigError, match="n_mtp_layers=1, but compress_ratios has 3 entries past num_hidden_layers"):
        config_from_dict(preset_dict("flash", **FLASH_0731, n_mtp_layers=1))


def test_transformers_rope_parameters_form(tmp_path):
    raw = preset_dict("tiny")
    del raw["rope_scaling"]
    raw["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": 10000.0},
        "compress": {
            "rope_type": "yarn",
            "rope_theta": 160000.0,
            "factor": 16,
            "original_max_position_embeddings": 32,
            "beta_fast": 32,
            "beta_slow": 1,
            "attention_factor": 1.0,
        },
    }
    raw["mlp_layer_types"] = ["hash_moe", "hash_moe", "moe", "moe", "moe"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_config(tmp_path, dtype="float32") == preset("tiny")


@pytest.mark.parametrize(
    "override, field",
    [
        ({"model_type": "llama"}, "model_type='llama'"),
        ({"num_attention_heads": 6, "o_groups": 4}, "o_groups=4"),
        ({"compress_ratios": [0, 4, 64, 4, 0], "layer_types": None}, "compress_ratios contains [64]"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types="),
        ({"layer_types": ["full_attention"] * 5}, "layer_types=['full_attention'"),
        ({"num_key_value_heads": 8}, "num_key_value_heads=8"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling.type='linear'"),
        ({"vocab_size": 0}, "vocab_size=0"),
        (
            {"dspark_block_size": 5},
            "'dspark_markov_rank', 'dspark_noise_token_id', 'dspark_target_layer_ids']: missing",
        ),
        ({**{k: v for k, v in FLASH_0731.items() if k.startswith("dspark")}}, "dspark_noise_token_id=128799"),
        (
            {**{k: v for k, v in FLASH_0731.items() if k.startswith("dspark")}, "dspark_noise_token_id": 7},
            "dspark_target_layer_ids=[40, 41, 42]: must be distinct layer indices below num_hidden_layers=5",
        ),
    ],
)
def test_bad_config_names_field_and_value(override, field):
    raw = preset_dict("tiny")
    raw.update(override)
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert field in str(err.value)


def test_missing_field_and_file(tmp_path):
    raw = preset_dict("tiny")
    del raw["q_lora_rank"]
    with pytest.raises(ConfigError, match="q_lora_rank"):
        config_from_dict(raw)
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'config.json'}: not found \\(the folder has no config.json"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'nope'}: no such checkpoint folder$"):
        load_config(tmp_path / "nope")


def test_a_queue_order_is_one_registration_the_flag_and_the_scheduler_follow(monkeypatch):
    """A new --scheduling-policy is its QueueOrder class registering itself: the flag's choices, EngineConfig's check
    and build_scheduler all read that one registry (jaxserve.config.registry)."""
    from jaxserve.config import SCHEDULING_POLICIES, EngineConfig
    from jaxserve.scheduler import IdAllocator, PrefixCache, QueueOrder, build_scheduler

    assert SCHEDULING_POLICIES.names() == ("fcfs", "priority")
    with pytest.raises(ConfigError, match=r"scheduling_policy='newest': must be one of \('fcfs', 'priority'\)"):
        EngineConfig(scheduling_policy="newest")
    monkeypatch.setattr(SCHEDULING_POLICIES, "_entries", dict(SCHEDULING_POLICIES._entries))  # undone after

    @SCHEDULING_POLICIES.register("newest")
    class NewestFirst(QueueOrder):
        def key(self, request):
            return (-request.arrival_time,)

        def check_priority(self, priority: int) -> None:
            """Any integer (ignored)."""

    cfg = EngineConfig(scheduling_policy="newest")
    scheduler = build_scheduler(cfg, PrefixCache(IdAllocator(8, "KV pages"), 16, [], b""), 16, 16)
    assert isinstance(scheduler.prefill_manager.queue_order, NewestFirst)
    assert "newest" in SCHEDULING_POLICIES and list(SCHEDULING_POLICIES) == ["fcfs", "newest", "priority"]
    with pytest.raises(ValueError, match="--scheduling-policy: 'newest' is registered twice"):
        SCHEDULING_POLICIES.register("newest")(NewestFirst)
