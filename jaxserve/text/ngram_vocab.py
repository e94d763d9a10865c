"""DeepSeek-V4.1's engram vocabulary: every token id mapped onto a smaller id space where tokens that read alike after
normalization (" The", "the", "THE") share one id, so their n-grams hash to the same engram rows.

The map must be the one the checkpoint was trained with, bit for bit: the engram hash multipliers derive from the
compressed vocabulary's size, and every hash from the ids. So this follows the reference recipe exactly: each id is
decoded alone by the raw `tokenizers` backend (special tokens kept), normalized (NFKC, NFD, accents stripped,
lowercase, whitespace runs to one space, a lone space kept, outer spaces stripped), and the distinct keys numbered in
order of first appearance. A decoded text holding U+FFFD (a partial UTF-8 byte token) is keyed by its raw token
string instead; a text that normalizes to nothing is keyed by itself.
"""

from __future__ import annotations

import numpy as np
import tokenizers
from tokenizers import Regex, normalizers

from jaxserve.text.tokenizer import Tokenizer

# A private-use character: a token that is exactly one space becomes it before Strip() and a space again after, so
# it keeps its own key instead of collapsing to "" with unrelated tokens.
_SENTINEL = "\ue000"


def _normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def compressed_token_map(tokenizer: tokenizers.Tokenizer | Tokenizer) -> tuple[np.ndarray, int]:
    """(compressed id of every token id, int32 [vocab incl. added tokens]; the compressed vocabulary's size).

    Takes the raw `tokenizers.Tokenizer` or jaxserve's `Tokenizer` over one (its backend is used). Compare the size
    with the checkpoint's `engram_compressed_vocab_size`: a mismatch means a different tokenizer, and every hash
    would address the wrong rows.
    """
    backend = tokenizer._tok if isinstance(tokenizer, Tokenizer) else tokenizer
    normalizer = _normalizer()
    vocab = backend.get_vocab_size(with_added_tokens=True)
    keys: dict[str | None, int] = {}
    ids = np.empty(vocab, np.int32)
    for token_id in range(vocab):
        text = backend.decode([token_id], skip_special_tokens=False)
        key: str | None
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        ids[token_id] = keys.setdefault(key, len(keys))
    return ids, len(keys)
