"""jaxserve.text.tokenizer: encode/decode over tokenizer.json, BOS/EOS ids from the checkpoint's json files, streaming
detokenization that never splits a character, token-id-only mode, and DeepSeek-V4's chat encoding."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.config import load_config
from jaxserve.text.chat import ChatOptions, ChatTemplateError, render_prompt
from jaxserve.text.tokenizer import NoTokenizerError, TokenIdOnly, Tokenizer, TokenizerError, load_tokenizer

THINKING = ChatOptions(thinking=True)

BOS, EOS, USER, ASSISTANT, THINK, END_THINK = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
)
TEXT = "The café serves naïve crêpes — 🙂 ok? 東京"


@pytest.fixture
def folder(tmp_path):
    """A copy of the default checkpoint's tokenizer files, to vary."""
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(default_checkpoint_path() / name, tmp_path / name)
    return tmp_path


def _edit_json(path, **changes):
    value = json.loads(path.read_text()) if path.exists() else {}
    value.update(changes)
    path.write_text(json.dumps(value))


def test_encode_decode_round_trip(folder):
    tok = load_tokenizer(folder)
    assert isinstance(tok, Tokenizer) and tok.has_text and tok.vocab_size == load_config(folder).vocab_size
    ids = tok.encode(TEXT)
    assert all(isinstance(i, int) for i in ids) and ids[0] != tok.bos_id  # add_bos_token is false, as in V4
    assert tok.decode(ids) == TEXT
    assert tok.decode([tok.bos_id, *ids, tok.eos_ids[0]]) == TEXT
    assert tok.decode([tok.bos_id, *ids], skip_special_tokens=False) == BOS + TEXT


def test_bos_follows_tokenizer_config(folder):
    _edit_json(folder / "tokenizer_config.json", add_bos_token=True)
    tok = Tokenizer(folder)
    assert tok.encode("hello")[0] == tok.bos_id == 0
    assert tok.encode("hello", add_special_tokens=False)[0] != 0


def test_special_ids_from_the_json_files(folder):
    tok = Tokenizer(folder)
    assert (tok.bos_id, tok.eos_ids) == (0, (1,))
    _edit_json(folder / "generation_config.json", eos_token_id=[5, 1])
    _edit_json(folder / "tokenizer_config.json", eos_token={"content": END_THINK, "special": True})
    tok = Tokenizer(folder)
    assert tok.eos_ids == (5, 1, tok.token_to_id(END_THINK))  # generation_config, then config, then the token
    _edit_json(folder / "config.json", eos_token_id="one")
    with pytest.raises(TokenizerError, match=f"^{folder / 'config.json'}: eos_token_id='one'"):
        Tokenizer(folder)


def test_incremental_detokenizer_never_splits_a_character(folder):
    tok = Tokenizer(folder)
    assert len(tok.encode("🙂")) == 4  # one byte-level token per UTF-8 byte: the character spans four tokens
    stream = tok.detokenizer()
    pieces = [stream.step(i) for i in tok.encode(TEXT)]
    assert "".join(pieces) == TEXT == stream.text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") >= 3 + 1 + 2  # held back while 🙂 (4 bytes), é (2) and 東 (3) were incomplete
    assert "🙂" in pieces
    assert stream.flush() == ""


def test_incremental_detokenizer_flushes_an_unfinished_character(folder):
    tok = Tokenizer(folder)
    stream = tok.detokenizer()
    ids = tok.encode("ok 🙂")
    assert [stream.step(i) for i in ids[:-2]][-1] == ""  # two of the emoji's four bytes
    assert stream.text == "ok "
    assert stream.flush() == "\ufffd" and stream.text == "ok \ufffd"  # the unfinished character, replaced once
    assert stream.step(tok.eos_ids[0]) == ""  # special tokens are skipped


def test_token_id_only_mode(folder, caplog):
    (folder / "tokenizer.json").unlink()
    with caplog.at_level(logging.WARNING, logger="jaxserve.text.tokenizer"):
        tok = load_tokenizer(folder)
    assert isinstance(tok, TokenIdOnly) and not tok.has_text
    assert [r.getMessage() for r in caplog.records] == [
        f"no tokenizer.json in {folder}: token-id-only mode; text prompts, stop strings and text output are disabled"
    ]
    assert (tok.bos_id, tok.eos_ids) == (0, (1,))  # still known, from config.json / generation_config.json
    for call in (lambda: tok.encode("hello"), lambda: tok.apply_chat_template([{"role": "user", "content": "hi"}])):
        with pytest.raises(NoTokenizerError, match="has no tokenizer .*send the prompt as a list of token ids"):
            call()
    stream = tok.detokenizer()
    assert stream.step(17) == "" and stream.ids == [17] and tok.decode([17, 18]) == ""
    assert isinstance(load_tokenizer(default_checkpoint_path(), skip_tokenizer=True), TokenIdOnly)


def test_unreadable_tokenizer_json_is_named(folder):
    (folder / "tokenizer.json").write_text("{ not json")
    with pytest.raises(TokenizerError, match=f"^{folder / 'tokenizer.json'}: cannot load tokenizer"):
        load_tokenizer(folder)


def test_chat_encoding_follows_deepseek_v4():
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
        {"role": "user", "content": [{"type": "text", "text": "Why"}, {"type": "text", "text": "?"}]},
    ]
    assert render_prompt(chat) == (
        f"{BOS}Be brief.{USER}Hi{ASSISTANT}{END_THINK}Hello.{EOS}{USER}Why?{ASSISTANT}{END_THINK}"
    )
    # Thinking mode: past reasoning dropped, the new turn opens with <think>.
    assert render_prompt(chat, THINKING) == (
        f"{BOS}Be brief.{USER}Hi{ASSISTANT}{END_THINK}Hello.{EOS}{USER}Why?{ASSISTANT}{THINK}"
    )
    # A reply after the last user turn keeps its reasoning and ends with EOS.
    done = chat[:2] + [{"role": "assistant", "content": "Yo.", "reasoning_content": "short"}]
    assert render_prompt(done, THINKING) == f"{BOS}Be brief.{USER}Hi{ASSISTANT}{THINK}short{END_THINK}Yo.{EOS}"
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]: role 'wizard'"):
        render_prompt([{"role": "wizard", "content": "42"}])


def test_chat_template_ids_use_the_special_tokens(folder):
    tok = Tokenizer(folder)
    messages = [{"role": "user", "content": "Hello there"}]
    ids = tok.apply_chat_template(messages)
    assert ids[:2] == [tok.bos_id, tok.token_to_id(USER)]
    assert ids[-2:] == [tok.token_to_id(ASSISTANT), tok.token_to_id(END_THINK)]
    assert tok.decode(ids, skip_special_tokens=False) == render_prompt(messages)
    assert tok.decode(ids) == "Hello there"


def test_a_tokenizer_without_the_chat_tokens_has_no_chat_template(tmp_path):
    plain = RustTokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    plain.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("hello") == [1] and (tok.bos_id, tok.eos_ids) == (None, ())
    with pytest.raises(TokenizerError, match=f"^{tmp_path / 'tokenizer.json'}: the tokenizer has no .*<｜User｜>"):
        tok.apply_chat_template([{"role": "user", "content": "hello"}])


def test_jaxserve_never_imports_torch_or_transformers():
    code = (
        "import sys, jaxserve.text.tokenizer, jaxserve.config, jaxserve.model.forward, jaxserve.checkpoints.deepseek, "
        "jaxserve.checkpoints.writer; bad = {'torch', 'transformers'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
