"""vLLM's tokenizer endpoints at the server root: POST /tokenize, POST /detokenize, GET /tokenizer_info.

They let a client work without the tokenizer files (lm-evaluation-harness' `tokenizer_backend=remote`).
/tokenize takes a `prompt` (add_special_tokens defaults to true) or chat `messages` (rendered with the same
encoding, tools and chat_template_kwargs as /v1/chat/completions; add_special_tokens defaults to false) and returns
{count, max_model_len, tokens, token_strs}; /detokenize returns {prompt} with special tokens kept, as vLLM's does.
Behind the API key like /v1: the bodies are parsed and rendered on the server's CPU.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from jaxserve.request import InvalidRequest
from jaxserve.server.auth import require_api_key
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.protocol import parse_chat
from jaxserve.server.routes import chat_prompt_ids, json_body
from jaxserve.server.state import ServerState
from jaxserve.text.tokenizer import Tokenizer

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/tokenize")
async def tokenize(request: Request) -> dict:
    state, tokenizer, body = await _body(request)
    is_chat = "messages" in body
    if is_chat == ("prompt" in body):
        raise bad_request("prompt", "prompt: send either `prompt` (text) or `messages` (a chat), not both or neither")
    add_special = _flag(body, "add_special_tokens", not is_chat)
    return_strs = _flag(body, "return_token_strs", False)
    if is_chat:
        ids = _chat_ids(state, tokenizer, body, add_special)
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request("prompt", f"prompt: must be a string, got {type(prompt).__name__}")
        ids = tokenizer.encode(prompt, add_special_tokens=add_special)
    return {
        "count": len(ids),
        "max_model_len": state.context_limit,
        "tokens": ids,
        "token_strs": [tokenizer.id_to_token(i) for i in ids] if return_strs else None,
    }


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    state, tokenizer, body = await _body(request)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise bad_request("tokens", f"tokens: must be a list of token ids, got {ids!r:.60}")
    try:
        state.engine.check_token_ids("tokens", ids)
    except InvalidRequest as error:
        raise bad_request(error.param, str(error)) from None
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    state: ServerState = request.app.state.server
    if not state.tokenizer.has_text:
        raise APIError(404, "This server has no tokenizer (token-id-only mode), so it has no tokenizer info")
    return state.tokenizer.config()


async def _body(request: Request) -> tuple[ServerState, Tokenizer, dict]:
    """The server state, its tokenizer (refused in token-id-only mode) and the JSON object of the body."""
    state: ServerState = request.app.state.server
    body = await json_body(request)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model", f"model: must be a string, got {model!r:.60}")
    state.check_model(model)
    if not state.tokenizer.has_text:
        raise bad_request(None, "This server has no tokenizer (token-id-only mode): it cannot tokenize or detokenize")
    return state, state.tokenizer, body


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(name, f"{name}: must be true or false, got {value!r:.60}")
    return value


def _chat_ids(state: ServerState, tokenizer: Tokenizer, body: dict[str, Any], add_special: bool) -> list[int]:
    ids = chat_prompt_ids(state, parse_chat(body))
    if add_special and tokenizer.add_bos:
        assert tokenizer.bos_id is not None  # add_bos is only ever set with a BOS id
        return [tokenizer.bos_id] + ids
    return ids
