"""Text <-> token ids for a checkpoint folder, with the `tokenizers` library only (no network, no transformers).

- `load_tokenizer(folder)`: a `Tokenizer` over `tokenizer.json`, or, when the folder has none, a `TokenIdOnly`
  that knows the BOS/EOS ids but refuses text (the server then takes prompts as token ids only).
- BOS/EOS ids come from `generation_config.json`, `config.json` and `tokenizer_config.json`; EOS is their union.
- `IncrementalDetokenizer`: per request, token ids in, only complete text out (never half a UTF-8 character).
- `render_chat` / `Tokenizer.apply_chat_template`: DeepSeek-V4's chat encoding (official `encoding_dsv4.py`,
  `encode_messages`): BOS, system text, `<｜User｜>` user text, `<｜Assistant｜>` then `</think>` (chat mode) or
  `<think>` (thinking mode); finished assistant turns end with EOS.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterable

import tokenizers
from tokenizers.decoders import DecodeStream

log = logging.getLogger("jaxserve.tokenizer")

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
CHAT_TOKENS = (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, THINK_START, THINK_END)


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
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self.text = ""

    def step(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        piece = self._stream.step(self._tokenizer, int(token_id)) or ""
        self.text += piece
        return piece

    def flush(self) -> str:
        """The text still held back at the end of the stream (an incomplete character decodes as U+FFFD)."""
        full = self._tokenizer.decode(self.ids, skip_special_tokens=self._skip_special)
        rest = full[len(self.text):] if full.startswith(self.text) else ""
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


# ---- chat encoding -------------------------------------------------------------------------------------------------

def _content_text(content: Any, where: str) -> str:
    """OpenAI message content: a string, None, or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise TokenizerError(f"{where}: only text content parts are supported, got {part!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise TokenizerError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def render_chat(messages: list[dict[str, Any]], thinking: bool = False) -> str:
    """DeepSeek-V4's prompt text for `messages` (roles system, developer, user, assistant), as `encode_messages`
    renders it with past reasoning dropped. A conversation ending in a user turn ends with the generation prompt.
    """
    if not messages:
        raise TokenizerError("messages: at least one message is needed")
    for k, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("system", "developer", "user", "assistant"):
            raise TokenizerError(f"messages[{k}]: role {role!r} is not supported (system, developer, user, "
                                 "assistant)")
        if message.get("tool_calls") or message.get("tools"):
            raise TokenizerError(f"messages[{k}]: tool calls are not supported by this chat encoder")

    def last_user(msgs):
        return max((k for k, m in enumerate(msgs) if m["role"] in ("user", "developer")), default=-1)

    if thinking:  # past reasoning is dropped, and so are developer turns before the last user turn
        cut = last_user(messages)
        messages = [m for k, m in enumerate(messages) if k >= cut or m["role"] != "developer"]
    cut = last_user(messages)
    out = [BOS_TOKEN]
    for k, message in enumerate(messages):
        role, text = message["role"], _content_text(message.get("content"), f"messages[{k}]")
        if role == "system":
            out.append(text)
        elif role in ("user", "developer"):
            out.append(USER_TOKEN + text)
        else:
            reasoning = ""
            if thinking and k > cut:
                reasoning = _content_text(message.get("reasoning_content"), f"messages[{k}]") + THINK_END
            out.append(reasoning + text + EOS_TOKEN)
        following = messages[k + 1]["role"] if k + 1 < len(messages) else None
        if role in ("user", "developer") and following in (None, "assistant"):
            out.append(ASSISTANT_TOKEN + (THINK_START if thinking and k >= cut else THINK_END))
    return "".join(out)


# ---- the two tokenizer kinds ---------------------------------------------------------------------------------------

class Tokenizer:
    """`tokenizer.json` through the `tokenizers` library, with the checkpoint's BOS/EOS ids."""

    has_text = True

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.file = self.folder / "tokenizer.json"
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.file))
        except Exception as bad:  # the Rust side raises plain Exception for unreadable or malformed files
            raise TokenizerError(f"{self.file}: cannot load tokenizer ({bad})") from None
        self.bos_id, self.eos_ids = _special_ids(self.folder, self._tok.token_to_id)
        add_bos = _read_json(self.folder / "tokenizer_config.json").get("add_bos_token")
        if add_bos is None:  # no explicit setting: whatever the tokenizer's own post-processor does
            add_bos = self.bos_id is not None and self._tok.encode("", add_special_tokens=True).ids[:1] == [self.bos_id]
        self.add_bos = bool(add_bos) and self.bos_id is not None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS first when the checkpoint asks for it (tokenizer_config `add_bos_token`)."""
        ids = self._encoding(text).ids
        return [self.bos_id] + ids if add_special_tokens and self.add_bos else ids

    def count(self, text: str) -> int:
        """How many tokens `text` encodes to (without BOS), without building the list of ids."""
        return len(self._encoding(text))

    def _encoding(self, text: str) -> tokenizers.Encoding:
        # encode_batch releases the GIL while it tokenizes (encode does not): a long text tokenized on a worker
        # thread then leaves the other threads (the event loop, the engine) running.
        return self._tok.encode_batch([text], add_special_tokens=False)[0]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tok, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], thinking: bool = False) -> list[int]:
        """Token ids of `render_chat(messages)`; needs the DeepSeek-V4 chat tokens in the vocabulary."""
        absent = [t for t in CHAT_TOKENS if self._tok.token_to_id(t) is None]
        if absent:
            raise TokenizerError(f"{self.file}: the tokenizer has no {', '.join(absent)} token(s), so this model "
                                 "has no DeepSeek-V4 chat template")
        return self._encoding(render_chat(messages, thinking)).ids


class TokenIdOnly:
    """A checkpoint without `tokenizer.json`: BOS/EOS ids from its json files, prompts as token ids only."""

    has_text = False

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.bos_id, self.eos_ids = _special_ids(self.folder, lambda token: None)
        self.vocab_size = None

    def _refuse(self) -> NoTokenizerError:
        return NoTokenizerError(f"the model in {self.folder} has no tokenizer (no tokenizer.json): "
                                "send the prompt as a list of token ids")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise self._refuse()

    def count(self, text: str) -> int:
        raise self._refuse()

    def apply_chat_template(self, messages: list[dict[str, Any]], thinking: bool = False) -> list[int]:
        raise self._refuse()

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return ""  # no text output in token-id-only mode; clients read the token ids

    def detokenizer(self, skip_special_tokens: bool = True) -> _NoTextDetokenizer:
        return _NoTextDetokenizer()


def load_tokenizer(folder: str | Path, skip_tokenizer: bool = False) -> Tokenizer | TokenIdOnly:
    """The checkpoint's tokenizer, or token-id-only mode (with one warning) when it has no tokenizer.json or
    `skip_tokenizer` is set."""
    folder = Path(folder)
    if not skip_tokenizer and (folder / "tokenizer.json").exists():
        return Tokenizer(folder)
    why = "tokenizer skipped" if skip_tokenizer else f"no tokenizer.json in {folder}"
    log.warning("%s: token-id-only mode; text prompts, stop strings and text output are disabled", why)
    return TokenIdOnly(folder)
