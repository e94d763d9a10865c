"""The OpenAI routes: /v1/models (and /v1/models/{id}), /v1/completions, /v1/chat/completions, and SageMaker's
/invocations, which dispatches to the last two.

Every refusal (bad field, unknown model, loading or draining, context too long, queue full) is decided before the
response starts, so it gets its real status code; only engine failures after that arrive as an SSE error event.
Decoding, validating and tokenizing a body run on worker threads: a large one never stalls the event loop, which
delivers every other request's tokens.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, Protocol, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from jaxserve.engine import EngineDraining, QueueFull
from jaxserve.engine.handoff import StateSource
from jaxserve.request import FinishReason, InvalidRequest
from jaxserve.server.auth import require_api_key
from jaxserve.server.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected, cancel_on_disconnect
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.formats import ChatFormat, CompletionFormat, Echo
from jaxserve.server.protocol import ChatRequest, GenerationParams, parse_chat, parse_completion
from jaxserve.server.sse import sse_response
from jaxserve.server.state import ServerState
from jaxserve.text.chat import ChatTemplateError
from jaxserve.text.generation import Delta, Generation, Output
from jaxserve.text.tokenizer import TokenizerError

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
sagemaker_router = APIRouter(dependencies=[Depends(require_api_key)])

# A text prompt longer than this many characters per token of context is first judged by its head alone (see
# _encode_prompt): real text averages 3-5 characters per token.
HEAD_CHARS_PER_TOKEN = 16
HEAD_CUT_MARGIN_TOKENS = 16


@router.get("/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(request.app.state.server)]}


@router.get("/models/{model_id:path}")  # the openai client's models.retrieve; a served name may hold a '/'
async def model(request: Request, model_id: str) -> dict:
    state: ServerState = request.app.state.server
    if model_id != state.served_model_name:
        raise APIError(404, f"The model `{model_id}` does not exist.", "model")
    return _model_card(state)


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "jaxserve",
        "root": state.model_path,
        "parent": None,
        "max_model_len": state.context_limit,
    }


@sagemaker_router.post("/invocations")
async def invocations(request: Request) -> Response:
    """SageMaker's one inference route: a body with `messages` is a chat completion, any other a completion (as
    vLLM dispatches it). Behind the API key, unlike vLLM's (which guards only /v1): it generates like /v1."""
    body = await json_body(request)
    return await (chat_completions(request) if "messages" in body else completions(request))


@router.post("/completions")
async def completions(request: Request) -> Response:
    arrival = time.monotonic()
    state, parsed = await _parse(request, parse_completion)
    params = parsed.params
    whole = [
        await _encode_prompt(state, p, params.truncate_prompt_tokens is None) if isinstance(p, str) else p
        for p in parsed.prompts
    ]
    prompts = [params.truncated(ids, state.context_limit) for ids in whole]
    echoes = None
    if params.echo:  # a prompt comes back as sent, unless truncation cut it: then what is left of it
        echoes = [
            Echo(sent, True)
            if isinstance(sent, str) and len(ids) == len(all_ids)
            else Echo(state.tokenizer.decode(ids), False)
            for sent, ids, all_ids in zip(parsed.prompts, prompts, whole)
        ]
    fmt = CompletionFormat(state.served_model_name, prompts, state.tokenizer, params, echoes=echoes)
    return await _generate(request, state, fmt, prompts, parsed.params, "prompt", arrival)


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    arrival = time.monotonic()
    engine = request.app.state.server.engine
    state, parsed = await _parse(request, functools.partial(parse_chat, tool_grammar=engine.takes_constraints))
    params = parsed.params
    prompt_ids = params.truncated(await run_in_threadpool(chat_prompt_ids, state, parsed), state.context_limit)
    fmt = ChatFormat(
        state.served_model_name,
        prompt_ids,
        state.tokenizer,
        params,
        options=parsed.options,
        include_reasoning=parsed.include_reasoning,
        echo=parsed.echo,
    )
    return await _generate(request, state, fmt, [prompt_ids], parsed.params, "messages", arrival)


def chat_prompt_ids(state: ServerState, parsed: ChatRequest) -> list[int]:
    """The prompt of a chat request: DeepSeek-V4's encoding of its messages, tools and options."""
    if not state.tokenizer.has_text:
        raise bad_request(
            "messages",
            "messages: this server has no tokenizer, so it has no chat template; use "
            "/v1/completions with the prompt as a list of token ids",
        )
    try:
        return state.tokenizer.apply_chat_template(parsed.messages, parsed.options)
    except ChatTemplateError as error:
        raise bad_request(error.field, str(error)) from None
    except TokenizerError as error:
        raise bad_request("messages", f"messages: {error}") from None


async def json_body(request: Request) -> dict:
    """The body, a JSON object, decoded on a worker thread (a large body never stalls the event loop). It is kept on
    the request, so a route that dispatches on it (/invocations) decodes it once."""
    _check_content_type(request)
    body: dict | None = getattr(request.state, "json_body", None)
    if body is None:
        body = request.state.json_body = await run_in_threadpool(_decode, await request.body())
    return body


def _check_content_type(request: Request) -> None:
    # As vLLM's validate_json_request, except that a body sent with no Content-Type at all is read as JSON (curl
    # scripts and bare HTTP clients leave it out); one declared as anything else is refused before it is read.
    media_type = request.headers.get("content-type", "application/json").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise bad_request(
            None, f"Unsupported Content-Type {media_type!r}: the body must be JSON, sent as application/json"
        )


def _decode(body: bytes) -> dict:
    try:
        raw = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(None, f"Invalid JSON body: {error}") from None
    if not isinstance(raw, dict):
        raise bad_request("body", f"body: must be a JSON object, got {type(raw).__name__} {raw!r:.60}")
    return raw


class ParsedRequest(Protocol):
    """What the endpoints' shared checks read of a validated request (CompletionRequest, ChatRequest)."""

    @property
    def params(self) -> GenerationParams: ...


RequestT = TypeVar("RequestT", bound=ParsedRequest)


async def _parse(request: Request, parse: Callable[[Any], RequestT]) -> tuple[ServerState, RequestT]:
    """The server state and the validated request, after the checks both endpoints share."""
    state: ServerState = request.app.state.server
    parsed = await run_in_threadpool(parse, await json_body(request))  # validating a large body takes a while too
    state.check_model(parsed.params.model)
    if parsed.params.stop and not state.tokenizer.has_text:
        raise bad_request("stop", "stop: stop strings need a tokenizer and this server has none; use stop_token_ids")
    return state, parsed


async def _encode_prompt(state: ServerState, prompt: str, judge_head: bool = True) -> list[int]:
    """`judge_head`: a prompt too long by its head alone is refused untokenized (not when it will be truncated)."""
    tokenizer = state.tokenizer
    if not tokenizer.has_text:
        raise bad_request("prompt", "prompt: this server has no tokenizer; send the prompt as a list of token ids")
    limit = state.context_limit
    head = prompt[: limit * HEAD_CHARS_PER_TOKEN]
    if judge_head and len(head) < len(prompt):
        # A prompt whose head alone is longer than the context is refused without tokenizing the rest (up to
        # --max-request-bytes of it). Only the last word of the head can tokenize differently in the whole prompt,
        # hence the margin.
        in_head = await run_in_threadpool(tokenizer.count, head) - HEAD_CUT_MARGIN_TOKENS
        if in_head > limit:
            raise bad_request(
                "prompt",
                f"This model's maximum context length is {limit} tokens. However, the "
                f"prompt alone has more than {in_head} tokens. Please reduce the length of "
                "the prompt.",
            )
    ids = await run_in_threadpool(tokenizer.encode, prompt)
    if not ids:
        raise bad_request("prompt", "prompt: encodes to no tokens")
    return ids


async def _generate(
    request: Request,
    state: ServerState,
    fmt,
    prompts: list[list[int]],
    params: GenerationParams,
    prompt_field: str,
    arrival: float,
) -> Response:
    remote = None if state.disaggregation is None else state.disaggregation.source(request)
    generations = _submit(state, fmt, prompts, params, prompt_field, arrival, remote)
    request.state.generations = generations  # for the access log's token counts (each prompt counted once)
    request.state.prompt_tokens = sum(len(p) for p in prompts)
    if params.stream:
        return sse_response(_chunks(generations, fmt, params.include_usage, params.continuous_usage))
    try:
        outputs = await cancel_on_disconnect(request, _outputs(generations))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    for output in outputs:
        if output.finish_reason is FinishReason.ERROR:
            raise APIError(500, f"generation failed: {output.error}")
    if params.best_of == params.n:
        return JSONResponse(fmt.response(outputs))
    # Every candidate's tokens were generated, so the usage counts them all (as OpenAI bills best_of).
    generated = sum(len(o.token_ids) for o in outputs)
    return JSONResponse(fmt.response(_best(outputs, params.best_of, params.n), completion_tokens=generated))


def _best(outputs: list[Output], best_of: int, n: int) -> list[Output]:
    """Each prompt's n candidates (of best_of) with the highest log probability per token, best first (OpenAI's
    best_of)."""

    def score(output: Output) -> float:
        return sum(lp.logprob for lp in output.logprobs) / max(1, len(output.logprobs))

    chosen = []
    for start in range(0, len(outputs), best_of):
        candidates = outputs[start : start + best_of]
        chosen += sorted(candidates, key=score, reverse=True)[:n]  # sorted is stable: ties keep candidate order
    return chosen


def _submit(
    state: ServerState,
    fmt,
    prompts: list[list[int]],
    params: GenerationParams,
    prompt_field: str,
    arrival: float,
    remote: StateSource | None = None,
) -> list[Generation]:
    """One engine request per choice, `n` per prompt in the choices' order (choice j of every prompt samples with
    seed + j, so a batch answers what its prompts sent one by one would), or with best_of > n one per candidate;
    if any is refused, those already submitted are aborted and the refusal answered (429, 503 or 400 naming the
    client's field)."""
    generations: list[Generation] = []
    per_prompt = params.best_of
    choices = [state.metrics.prompt_choices(per_prompt) for _ in prompts]
    try:
        for index in range(len(prompts) * per_prompt):
            prompt_ids = prompts[index // per_prompt]
            max_tokens = state.default_max_tokens(len(prompt_ids)) if params.max_tokens is None else params.max_tokens
            generations.append(
                Generation(
                    state.engine,
                    state.tokenizer,
                    prompt_ids,
                    params.sampling(max_tokens, index % per_prompt),
                    params.stop,
                    fmt.request_id(index) if per_prompt == params.n else f"{fmt.id}-candidate-{index}",
                    state.metrics.timer(arrival, choices[index // per_prompt]),
                    keep_markup=fmt.keeps_markup,
                    priority=params.priority,
                    include_stop=params.include_stop_str_in_output,
                    remote=remote,
                )
            )
    except (QueueFull, EngineDraining, InvalidRequest) as error:
        for generation in generations:
            state.engine.abort(generation.handle.request_id)
        if isinstance(error, QueueFull):
            raise APIError(429, f"The request queue is full: {error}") from None
        if isinstance(error, EngineDraining):
            raise APIError(503, f"The server is shutting down: {error}") from None
        error = params.renamed(error, prompt_field)  # the engine's admission: out of range, vocabulary, too long
        raise bad_request(error.param, str(error)) from None
    state.metrics.submitted(params.n, len(prompts))
    return generations


async def _interleaved(generations: list[Generation]) -> AsyncGenerator[tuple[int, Delta], None]:
    """(choice, delta) from every generation as they come. Use under `contextlib.aclosing`: leaving early closes
    every generation, which aborts the requests still running."""
    queue: asyncio.Queue[tuple[int, Delta | Exception | None]] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async with aclosing(generation.deltas()) as deltas:
                async for delta in deltas:
                    queue.put_nowait((index, delta))
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, error))
        else:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _outputs(generations: list[Generation]) -> list[Output]:
    outputs = [Output() for _ in generations]
    async with aclosing(_interleaved(generations)) as deltas:
        async for index, delta in deltas:
            outputs[index].add(delta)
    return outputs


async def _chunks(generations: list[Generation], fmt, include_usage: bool, continuous: bool) -> AsyncIterator[dict]:
    """The stream; `continuous` (vLLM's continuous_usage_stats): every chunk also carries its choice's usage so
    far (its prompt, its tokens), as vLLM's do."""
    for chunk in fmt.opening_chunks():
        yield fmt.with_usage(chunk, 0) if continuous else chunk
    async with aclosing(_interleaved(generations)) as deltas:
        async for index, delta in deltas:
            if delta.finish_reason is FinishReason.ERROR:
                raise APIError(500, f"generation failed: {delta.error}")
            fmt.note_cached(index, delta.cached_tokens)
            chunk = fmt.chunk(index, delta)
            yield fmt.with_usage(chunk, delta.num_generated) if continuous else chunk
    if include_usage:
        yield fmt.usage_chunk(sum(g.num_generated for g in generations))
