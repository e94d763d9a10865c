"""Generate the embedded default checkpoint (`checkpoints/default/`), deterministically.

A small DeepSeek-V4 with every feature the engine implements (SWA, CSA and HCA layers, hash- and score-routed
MoE, mHC) and its own byte-level BPE tokenizer (512 tokens, trained on the fixed text below, with the DeepSeek
special tokens at DeepSeek's ids 0-2 and the chat markers after them). The weights are random (`init_weights`
with a fixed key), stored as the release stores them (BF16, with the HC params, sinks, ape and gate bias in F32),
so `jaxserve serve` can start with no download and no --model. Running this again writes byte-identical files:

    python -m jaxserve.checkpoints.make_default [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.checkpoints.writer import write_checkpoint
from jaxserve.config import config_from_dict
from jaxserve.model.weights import init_weights
from jaxserve.presets import preset_dict

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
SPECIAL_TOKENS = [BOS, EOS, PAD, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]  # ids 0, 1, 2, ...
VOCAB_SIZE = 512
SEED = 4
_SWA, _CSA, _HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# The tokenizer's training text: plain English, written for this file.
TEXT = """\
The river ran past the old mill in the morning, and the miller opened the doors to let the light in.
She counted the sacks of grain, wrote the numbers in a small book, and put the kettle on the stove.
Every day began the same way, with the sound of water on the wheel and birds in the trees by the bank.
A traveller came up the road before noon and asked whether he could rest for an hour in the shade.
The miller gave him bread and cheese, and they talked about the weather, the harvest and the long winter.
He said that he had walked from the city by the sea, where the ships come in with cloth, tea and iron.
In the city there were many people, many languages, and a great market that was open every afternoon.
He was going north to see his brother, who kept sheep in the hills and wrote letters twice a year.
When the sun was lower they walked together to the bridge, and he thanked her and went on his way.
That evening she wrote a letter of her own, to a friend she had not seen for seven or eight years.
Questions and answers are how people learn: what is this, how does it work, why did it happen, and when?
A good answer is short, clear and correct. If you do not know the answer, say so and explain what you know.
Numbers matter too: one, two, three, four, five, six, seven, eight, nine, ten, a hundred, a thousand.
The first of May, the second of June, the third day of the week; at 9:30 the train leaves platform 4.
Computers read text as numbers. A tokenizer splits the text into pieces and gives every piece a number.
The model reads those numbers, one after another, and predicts the next one, then the one after that.
Writing code is careful work: name things well, test what you build, and keep each part small and simple.
def add(a, b): return a + b  # a small function that adds two numbers and returns the result
for i in range(10): print(i, i * i)
"Hello," said the child. "Is it going to rain today?" "Perhaps," said her mother, "take your coat."
The garden had roses, beans, apples and a tall green tree where the children liked to sit and read.
In the library there were books about stars and planets, about animals, about history and about music.
They learned that light from the sun takes about eight minutes to reach the earth.
Please summarise the following paragraph in one sentence, then list three questions it raises.
Thank you for your message. I will reply as soon as I can, and I hope you have a pleasant day.
"""


def train_tokenizer(text: str = TEXT, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
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
    tok.train_from_iterator(text.splitlines(), trainer)
    return tok


def model_config(vocab_size: int) -> dict:
    """The default model's config.json dict: the tiny preset's features at a slightly larger, real-ish scale."""
    return preset_dict(
        "tiny",
        vocab_size=vocab_size,
        hidden_size=128,
        moe_intermediate_size=64,
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
        rope_scaling={
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def generate(folder: str | Path) -> list[Path]:
    """Write the default checkpoint into `folder`; returns the files written, sorted."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab != VOCAB_SIZE or [tok.token_to_id(t) for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"tokenizer training gave {vocab} tokens (want {VOCAB_SIZE}) or moved the special tokens")
    tok.save(str(folder / "tokenizer.json"), pretty=False)
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": False,
            "add_eos_token": False,
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": EOS,
            "model_max_length": 4096,
            "clean_up_tokenization_spaces": False,
        },
    )
    cfg = config_from_dict(model_config(vocab), dtype="float32")
    _write_json(folder / "generation_config.json", {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id})
    with jax.default_device(jax.devices("cpu")[0]):
        weights = init_weights(jax.random.key(SEED), cfg)
    write_checkpoint(weights, cfg, folder, dtype="bfloat16")
    return sorted(p for p in folder.iterdir() if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_checkpoint_path(), help="folder (default: %(default)s)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(f"{path}  {path.stat().st_size / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
