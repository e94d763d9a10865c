"""What the embedded default is: its tokenizer (a byte-level BPE trained on the training text, DeepSeek-V4's special
tokens at DeepSeek's ids) and its config (a small DeepSeek-V4 with every layer kind and one MTP block)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxserve.presets import preset_dict

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
SPECIAL_TOKENS = [BOS, EOS, PAD, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]  # ids 0, 1, 2, ...
VOCAB_SIZE = 4096
_SWA, _CSA, _HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def train_tokenizer(lines: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE (every byte has a token, so any text encodes) with the special tokens first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(lines, trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size or [tok.token_to_id(t) for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"tokenizer training gave {got} tokens (want {vocab_size}) or moved the special tokens")
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json: no BOS or EOS added by encoding (the chat template and the API add them)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }


def model_config(vocab_size: int = VOCAB_SIZE) -> dict:
    """config.json: the tiny preset's features at a trainable scale (about 3.3M parameters with the MTP block)."""
    return preset_dict(
        "tiny",
        vocab_size=vocab_size,
        hidden_size=128,
        moe_intermediate_size=128,
        num_hidden_layers=5,
        layer_types=[_SWA, _CSA, _HCA, _CSA, _SWA],
        compress_rates={_CSA: 4, _HCA: 16},
        num_hash_layers=2,
        num_attention_heads=4,
        head_dim=64,
        qk_rope_head_dim=16,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        sliding_window=32,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        num_nextn_predict_layers=1,
        rope_scaling={
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )


# Openings of Python the default continues, for tests and benchmarks; the last is longer than a 32-token chunk.
SAMPLE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_files(path):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    '"""Utilities for parsing command line arguments."""\n\nimport sys\n',
    "for i in range(10):\n    if i % 2 == 0:\n",
    "def read_config(filename):\n    with open(filename) as f:\n        return ",
    "    raise ValueError(",
    "# Copyright 2001 by the Python Software Foundation. All rights reserved.\n"
    "# Licensed to the PSF under a contributor agreement.\n\nimport collections\nimport functools\n",
]
