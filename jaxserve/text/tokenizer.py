"""Text <-> token ids for a checkpoint folder, with the `tokenizers` library only (no network, no transformers).

- `load_tokenizer(folder)`: a `Tokenizer` over `tokenizer.json`, or, when the folder has none, a `TokenIdOnly`
  that knows the BOS/EOS ids but refuses text (the server then takes prompts as token ids only).
- BOS/EOS ids come from `generation_config.json`, `config.json` and `tokenizer_config.json`; EOS is their union.
- `IncrementalDetokenizer`: per request, token ids in, only complete text out (never half a UTF-8 character).
- `Tokenizer.apply_chat_template`: the ids of DeepSeek-V4's chat encoding (jaxserve.text.chat.encoding).
- `Tokenizer.detokenizer(keep_markup=True)`: output text for the chat output parser, with the reasoning and
  tool-call markup kept even where the tokenizer marks those tokens special (BOS, EOS and the rest still dropped).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal

import tokenizers
from tokenizers.decoders import DecodeStream

from jaxserve.request.grammar import GrammarCompiler
from jaxserve.text.chat.encoding import (
    CHAT_TOKENS,
    DSML,
    LATEST_REMINDER_TOKEN,
    THINK_END,
    THINK_START,
    ChatOptions,
    ChatTemplateError,
    render_prompt,
)

log = logging.getLogger("jaxserve.text.tokenizer")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used as asked; the message names the file where one applies."""


class NoTokenizerError(TokenizerError):
    """Text was given to a model served without a tokenizer (token-id-only mode)."""


# ---- special ids from the checkpoint's json files ------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as bad:
        raise TokenizerError(f"{path}: not valid JSON ({bad})") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return value


def _ids(raw: dict[str, Any], key: str, path: Path) -> list[int]:
    value = raw.get(key)
    values = value if isinstance(value, list) else [value]
    if not all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) for v in values):
        raise TokenizerError(f"{path}: {key}={value!r} must be a token id or a list of token ids")
    return [v for v in values if v is not None]


def _token_string(value: Any) -> str | None:
    """A tokenizer_config token entry: a string, or {"content": ...} (AddedToken), or absent."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_ids(folder: Path, token_to_id) -> tuple[int | None, tuple[int, ...]]:
    """(bos id, eos ids). EOS: the union of generation_config, config and tokenizer_config, in that order."""
    files = {name: folder / f"{name}.json" for name in ("generation_config", "config", "tokenizer_config")}
    raw = {name: _read_json(path) for name, path in files.items()}

    def ids(name: str, key: str) -> list[int]:
        return _ids(raw[name], key, files[name])

    def from_token(key: str) -> list[int]:
        token = _token_string(raw["tokenizer_config"].get(key))
        found = token_to_id(token) if token is not None else None
        return [] if found is None else [found]

    eos: list[int] = []
    for candidate in (ids("generation_config", "eos_token_id"), ids("config", "eos_token_id"), from_token("eos_token")):
        eos += [i for i in candidate if i not in eos]
    bos = ids("config", "bos_token_id") or ids("generation_config", "bos_token_id") or from_token("bos_token")
    return (bos[0] if bos else None), tuple(eos)


# ---- streaming detokenization ------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """One request's output: feed token ids one at a time, get back the newly completed text (maybe "").

    Bytes of a character split over several byte-level tokens are held back until the character is complete, so
    a stream never carries a broken UTF-8 sequence. `flush()` at the end returns what is still held back.
    Ids in `silent_ids` (the special tokens a caller does not want as text) decode to nothing.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, silent_ids: frozenset[int] = frozenset()):
        self._tokenizer = tokenizer
        self._silent = silent_ids
        self._stream = DecodeStream(skip_special_tokens=False)
        self.ids: list[int] = []
        self.text = ""

    def step(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        if token_id in self._silent:
            return ""
        piece = self._stream.step(self._tokenizer, int(token_id)) or ""
        self.text += piece
        return piece

    def flush(self) -> str:
        """The text still held back at the end of the stream (an incomplete character decodes as U+FFFD)."""
        full = self._tokenizer.decode([i for i in self.ids if i not in self._silent], skip_special_tokens=False)
        rest = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += rest
        return rest


class _NoTextDetokenizer:
    """Token-id-only mode: ids are recorded, no text is ever produced."""

    def __init__(self):
        self.ids: list[int] = []
        self.text = ""

    def step(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return ""

    def flush(self) -> str:
        return ""


def token_id_text(token_id: int) -> str:
    """A token named by its id, as vLLM's `return_tokens_as_token_ids` names it in logprobs."""
    return f"token_id:{int(token_id)}"


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the printable character each byte is written as in the vocabulary,
    mapped back to the byte. Printable Latin-1 bytes stand for themselves; the other 68 are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = (b for b in range(256) if b not in printable)
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + k): b for k, b in enumerate(shifted)})
    return alphabet


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


# ---- the two tokenizer kinds ---------------------------------------------------------------------------------------


class Tokenizer:
    """`tokenizer.json` through the `tokenizers` library, with the checkpoint's BOS/EOS ids."""

    has_text: ClassVar[Literal[True]] = True

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.file = self.folder / "tokenizer.json"
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.file))
        except Exception as bad:  # the Rust side raises plain Exception for unreadable or malformed files
            raise TokenizerError(f"{self.file}: cannot load tokenizer ({bad})") from None
        self.bos_id, self.eos_ids = _special_ids(self.folder, self._tok.token_to_id)
        added = self._tok.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        self._added_text = {i: token.content for i, token in added.items()}
        self._byte_level = isinstance(self._tok.decoder, tokenizers.decoders.ByteLevel)
        # Reasoning and tool-call markup the chat output parser reads, whether or not the tokenizer calls it special.
        self._markup_ids = frozenset(
            i for i, token in added.items() if token.content in (THINK_START, THINK_END) or DSML in token.content
        )
        add_bos = _read_json(self.folder / "tokenizer_config.json").get("add_bos_token")
        if add_bos is None:  # no explicit setting: whatever the tokenizer's own post-processor does
            add_bos = self.bos_id is not None and self._tok.encode("", add_special_tokens=True).ids[:1] == [self.bos_id]
        self.add_bos = bool(add_bos) and self.bos_id is not None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def config(self) -> dict[str, Any]:
        """`tokenizer_config.json` as transformers reads it (token entries as their strings), with the BOS and
        EOS tokens this tokenizer resolved and a `tokenizer_class`: what vLLM's /tokenizer_info serves."""
        raw = _read_json(self.folder / "tokenizer_config.json")
        config = {
            key: _token_string(value) if isinstance(value, dict) and "content" in value else value
            for key, value in raw.items()
            if key != "added_tokens_decoder"
        }
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        for key, token_id in (("bos_token", self.bos_id), ("eos_token", self.eos_ids[0] if self.eos_ids else None)):
            if config.get(key) is None and token_id is not None:
                config[key] = self.id_to_token(token_id)
        return config

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS first when the checkpoint asks for it (tokenizer_config `add_bos_token`)."""
        ids = self._encoding(text).ids
        if add_special_tokens and self.add_bos:
            assert self.bos_id is not None  # add_bos is only ever set with a BOS id
            return [self.bos_id] + ids
        return ids

    def count(self, text: str) -> int:
        """How many tokens `text` encodes to (without BOS), without building the list of ids."""
        return len(self._encoding(text))

    def _encoding(self, text: str) -> tokenizers.Encoding:
        # encode_batch releases the GIL while it tokenizes (encode does not): a long text tokenized on a worker
        # thread then leaves the other threads (the event loop, the engine) running.
        return self._tok.encode_batch([text], add_special_tokens=False)[0]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as logprobs name it: its text, special tokens included (a piece of a character is U+FFFD)."""
        return self._tok.decode([int(token_id)], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes: for a token that ends inside a UTF-8 character, that character's bytes it holds
        (its text is U+FFFD, whose bytes these are not)."""
        token_id = int(token_id)
        if token_id in self._added_text:
            return self._added_text[token_id].encode("utf-8")
        piece = self._tok.id_to_token(token_id)
        if self._byte_level and piece is not None and all(c in BYTE_LEVEL_ALPHABET for c in piece):
            return bytes(BYTE_LEVEL_ALPHABET[c] for c in piece)
        if piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # a byte-fallback token (SentencePiece's)
        return self.token_text(token_id).encode("utf-8")

    def detokenizer(self, skip_special_tokens: bool = True, keep_markup: bool = False) -> IncrementalDetokenizer:
        """`keep_markup`: special tokens are skipped except `<think>`, `</think>` and DSML ones (chat output)."""
        silent = self._special_ids - self._markup_ids if keep_markup else self._special_ids
        return IncrementalDetokenizer(self._tok, silent if skip_special_tokens else frozenset())

    def apply_chat_template(self, messages: list[dict[str, Any]], options: ChatOptions = ChatOptions()) -> list[int]:
        """Token ids of `render_prompt(messages, options)`; needs the DeepSeek-V4 chat tokens in the vocabulary.
        Raises ChatTemplateError (naming the request field) for messages or options it cannot render."""
        absent = [t for t in CHAT_TOKENS if self._tok.token_to_id(t) is None]
        if absent:
            raise TokenizerError(
                f"{self.file}: the tokenizer has no {', '.join(absent)} token(s), so this model "
                "has no DeepSeek-V4 chat template"
            )
        if self._tok.token_to_id(LATEST_REMINDER_TOKEN) is None:
            for k, message in enumerate(messages):
                if isinstance(message, dict) and message.get("role") == "latest_reminder":
                    raise ChatTemplateError(
                        "messages",
                        f"messages[{k}]: role 'latest_reminder' needs the {LATEST_REMINDER_TOKEN} token, which this "
                        "model's tokenizer does not have",
                    )
        return self._encoding(render_prompt(messages, options)).ids

    def grammar_compiler(self, vocab_size: int) -> GrammarCompiler:
        """Structured outputs' compiler for this vocabulary (the model's `vocab_size` ids; ids past the tokenizer's
        are never allowed)."""
        return GrammarCompiler(self.file.read_text(), vocab_size, self.eos_ids)


class TokenIdOnly:
    """A checkpoint without `tokenizer.json`: BOS/EOS ids from its json files, prompts as token ids only."""

    has_text: ClassVar[Literal[False]] = False

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.bos_id, self.eos_ids = _special_ids(self.folder, lambda token: None)
        self.vocab_size = None

    def _refuse(self) -> NoTokenizerError:
        return NoTokenizerError(
            f"the model in {self.folder} has no tokenizer (no tokenizer.json): send the prompt as a list of token ids"
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise self._refuse()

    def count(self, text: str) -> int:
        raise self._refuse()

    def apply_chat_template(self, messages: list[dict[str, Any]], options: ChatOptions = ChatOptions()) -> list[int]:
        raise self._refuse()

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return ""  # no text output in token-id-only mode; clients read the token ids

    def token_text(self, token_id: int) -> str:
        return token_id_text(token_id)  # no vocabulary to name it by

    def token_bytes(self, token_id: int) -> bytes:
        return self.token_text(token_id).encode("utf-8")

    def detokenizer(self, skip_special_tokens: bool = True, keep_markup: bool = False) -> _NoTextDetokenizer:
        return _NoTextDetokenizer()

    def grammar_compiler(self, vocab_size: int) -> None:
        return None  # a grammar needs the tokens' text: the engine refuses structured outputs


def load_tokenizer(folder: str | Path, skip_tokenizer: bool = False) -> Tokenizer | TokenIdOnly:
    """The checkpoint's tokenizer, or token-id-only mode (with one warning) when it has no tokenizer.json or
    `skip_tokenizer` is set."""
    folder = Path(folder)
    if not skip_tokenizer and (folder / "tokenizer.json").exists():
        return Tokenizer(folder)
    why = "tokenizer skipped" if skip_tokenizer else f"no tokenizer.json in {folder}"
    log.warning("%s: token-id-only mode; text prompts, stop strings and text output are disabled", why)
    return TokenIdOnly(folder)
