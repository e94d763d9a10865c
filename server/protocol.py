"""Request bodies of /v1/completions and /v1/chat/completions -> validated parameters.

Types are checked here, by hand, so every mistake is a 400 whose message starts with the field's name (FastAPI's
pydantic models would answer 422). Ranges and what fits the model (sampling ranges, the vocabulary, the context)
are the engine's rules: SamplingParams and Engine.check_admission raise InvalidRequest naming the field, and
the routes answer 400 with it. Fields of OpenAI's and vLLM's APIs that jaxserve does not implement are accepted only
at the value that asks for nothing (NO_OP_VALUES; else a 400 naming them), fields that only label a request
(LABEL_FIELDS) are accepted and not used, and any other field is ignored with a warning in the log, as vLLM does
(benchmark tools send extras).

Logprobs: completions take `logprobs: k` (and with `echo`, the prompt's logprobs too, which is what evaluators
send, often with `max_tokens: 0`); chat takes `logprobs: true` with `top_logprobs: k`. Both map to the engine's
SamplingParams.logprobs / prompt_logprobs, whose range rule names the client's field; vLLM's `prompt_logprobs: k`
works on both (not streaming). A completions `prompt` may be a batch; each prompt has `n` choices, each its own
engine request, and choice j of every prompt samples with seed `seed + j`. vLLM's extras: include_stop_str_in_output,
truncate_prompt_tokens with truncation_side, stream_options.continuous_usage_stats (with include_usage), and for chat
add_generation_prompt, continue_final_message and include_reasoning.

Sampling: SamplingParams is the one definition. Its fields a client sends under their own names as plain JSON values
(a boolean, an integer, a number, a list of token ids) are read as its dataclass fields say (PLAIN_SAMPLING_FIELDS),
so a new one is served with no change here; only those whose HTTP shape differs (SHAPED_SAMPLING_FIELDS) have code.

Structured outputs: OpenAI's `response_format` (`json_object`, `json_schema` with `strict`), vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, in both APIs; at most one of them per request. They become one
`Constraint` the engine compiles (a schema or grammar it cannot compile is a 400 naming the field).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, overload

from jaxserve.request import MAX_LOGPROBS, InvalidRequest, SamplingParams, listed
from jaxserve.request.grammar import Constraint, ConstraintKind
from jaxserve.server.errors import bad_request
from jaxserve.text.chat import ChatOptions, ChatTemplateError, chat_options
from jaxserve.text.chat.tool_grammar import tool_call_grammar

log = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI legacy completions default
MAX_CHOICES = 128  # the most `n` OpenAI's API takes
SEED_RANGE = (-(2**63), 2**63)  # vLLM's: a signed 64-bit integer; reduced to the sampler's uint32 key

# OpenAI's and vLLM's fields for what jaxserve does not do, accepted only at the value that asks for nothing (None
# always is; an empty tuple: None only).
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "suffix": (),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "bad_words": ([],),
    "logits_processors": ([],),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "prompt_embeds": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "mm_processor_kwargs": (),
    "chat_template": (),
    "documents": (),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "functions": (),
    "function_call": (),
    "parallel_tool_calls": (True,),  # chat reads it (ChatOptions); a completion calls no tools
    "store": (False,),
    "service_tier": ("auto", "default"),
}
# Fields that only label a request for the client's own records (or, cache_salt, isolate a prefix cache jaxserve
# does not have yet): accepted with any value and not used.
LABEL_FIELDS = ("user", "metadata", "safety_identifier", "prompt_cache_key", "cache_salt")


# SamplingParams' fields whose HTTP shape is not "the same name, a plain JSON value"; each has its own code here:
# max_tokens (each endpoint's default and names), seed (64 bits, offset per choice), top_k (<= 0 is off, as in
# vLLM), logprobs (chat's logprobs and top_logprobs), prompt_logprobs (the device's MAX_LOGPROBS, cut here),
# logit_bias (an object keyed by token ids as text), constraint (the structured outputs fields, tool_choice). The
# model's eos_token_ids are the engine's to fill in, never a client's.
SHAPED_SAMPLING_FIELDS = frozenset(
    {"max_tokens", "seed", "top_k", "logprobs", "prompt_logprobs", "logit_bias", "constraint", "eos_token_ids"}
)


@dataclass(frozen=True)
class PlainField:
    """A SamplingParams field a client sends under its own name as a plain JSON value, read as its type says."""

    name: str
    kind: type  # bool, int, float, or tuple: a list of token ids
    nullable: bool  # None is one of the field's values: null says it, so a list of token ids must not be empty

    def read(self, fields: _Fields) -> Any:
        """The client's value, its JSON type checked (a 400 naming the field); None when not given, so
        SamplingParams' default stands."""
        if self.kind is bool:
            return fields.boolean(self.name, None)
        if self.kind is int:
            return fields.integer(self.name, None)
        if self.kind is float:
            return fields.number(self.name)
        ids = fields.raw.get(self.name)
        return None if ids is None else tuple(_token_ids(self.name, ids, allow_empty=not self.nullable))


def _plain_field(field: dataclasses.Field) -> PlainField:
    """The field as its type says a client sends it; a type with no plain JSON shape fails the import, so no new
    field is silently left out of the API."""
    hint = field.type
    if isinstance(hint, str):
        # Postponed annotations, evaluated where SamplingParams is defined as typing.get_type_hints would, but one
        # field at a time: a shaped field's type (Constraint) is imported there only for type checking.
        hint = eval(hint, vars(sys.modules[SamplingParams.__module__]))
    args = typing.get_args(hint)
    nullable = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if nullable:
        rest = [a for a in args if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else hint
    kind = tuple if hint == tuple[int, ...] else hint
    if kind not in (bool, int, float, tuple):
        raise TypeError(
            f"SamplingParams.{field.name}: {field.type} has no plain JSON shape; give it its own code in "
            "server/protocol.py and name it in SHAPED_SAMPLING_FIELDS"
        )
    return PlainField(field.name, kind, nullable)


PLAIN_SAMPLING_FIELDS = {
    f.name: _plain_field(f) for f in dataclasses.fields(SamplingParams) if f.name not in SHAPED_SAMPLING_FIELDS
}


@dataclass(frozen=True)
class GenerationParams:
    """What both endpoints share: sampling, stopping and output options."""

    model: str | None
    max_tokens: int | None  # None: the endpoint's default (chat: the rest of the context)
    max_tokens_field: str  # the name the client used for it (chat: max_completion_tokens or max_tokens)
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    # SamplingParams' fields by name as the engine takes them, those the request sets (the others keep their
    # defaults); the ones the server reads or sets per choice are this class's own fields.
    sampling_values: Mapping[str, Any]
    n: int = 1  # choices, each its own engine request
    best_of: int = 1  # candidates per prompt (>= n), each its own engine request; the n best come back
    logprobs: int | None = None  # alternatives per generated token; None: no logprobs
    logprobs_field: str = "logprobs"  # the name the client used for it (chat: top_logprobs)
    echo: bool = False  # completions: the prompt comes back in front of the text (with its logprobs if asked)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens `token_id:<id>`
    priority: int = 0  # vLLM's: lower is admitted first under --scheduling-policy priority (else only 0 is valid)
    constraint: Constraint | None = None  # structured outputs
    include_stop_str_in_output: bool = False  # vLLM's: a matched stop string stays in the text
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk
    truncate_prompt_tokens: int | None = None  # vLLM's: keep k of the prompt's tokens (-1: the context's worth)
    truncation_side: str = "left"  # vLLM's: which end truncate_prompt_tokens cuts (left: keep the last k)
    prompt_logprobs: int | None = None  # vLLM's: each prompt position's logprob and top k, in vLLM's shape

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None or (self.echo and self.logprobs is not None)

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as truncate_prompt_tokens leaves it (its last k tokens; with truncation_side right, its first
        k), or a 400 as vLLM words it."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt_ids
        k = max_model_len if k == -1 else k
        if k > max_model_len:
            raise bad_request(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({max_model_len}). "
                "Please, select a smaller truncation size.",
            )
        return prompt_ids[-k:] if self.truncation_side == "left" else prompt_ids[:k]

    def sampling(self, max_tokens: int, choice: int = 0) -> SamplingParams:
        """The engine's SamplingParams for choice (or best_of candidate) `choice`, with its own seed; a value out of
        range is an InvalidRequest naming the client's field. Candidates beyond n bring their tokens' logprobs (the
        ranking reads them) whether or not the client asked to see them."""
        seed = None if self.seed is None else (self.seed + choice) % 2**32
        logprobs = self.logprobs if self.best_of == self.n or self.logprobs is not None else 0
        try:
            return SamplingParams(
                **self.sampling_values,
                max_tokens=max_tokens,
                seed=seed,
                logprobs=logprobs,
                constraint=self.constraint,
                # Every prompt position's best MAX_LOGPROBS (what the device computes anyway): echo shows the
                # request's k of them, prompt_logprobs its own k, and the ranks come from them.
                prompt_logprobs=MAX_LOGPROBS if self.wants_prompt_logprobs else None,
            )
        except InvalidRequest as error:
            raise self.renamed(error, "prompt") from None

    def renamed(self, error: InvalidRequest, prompt_field: str) -> InvalidRequest:
        """`error` with the engine's field names (prompt, max_tokens, logprobs) replaced by the ones this client
        sent."""
        names = {
            "prompt": prompt_field,
            "max_tokens": self.max_tokens_field,
            "logprobs": self.logprobs_field,
        }
        name = None if error.param is None else names.get(error.param)
        if name is None or error.param is None or name == error.param:
            return error
        message = str(error)
        for old in (error.param, f"parameter={error.param}"):  # the leading field name, the context wording's
            message = message.replace(old, old.replace(error.param, name), 1)
        return InvalidRequest(name, message)


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[str | list[int], ...]  # one or more, each a text or token ids; each gets its own `n` choices
    params: GenerationParams


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    options: ChatOptions  # thinking, reasoning effort, tools and tool_choice
    params: GenerationParams
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the reply
    echo: str = ""  # vLLM's chat echo: the final assistant message's text, put before the reply's


def parse_completion(body: Any) -> CompletionRequest:
    fields = _Fields(body)
    if fields.raw.get("top_logprobs") is not None:
        raise bad_request(
            "top_logprobs",
            "top_logprobs: /v1/completions takes `logprobs` (the number of alternatives per token) instead",
        )
    echo = fields.boolean("echo", False)
    max_tokens = fields.integer("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    if max_tokens == 0 and not echo:
        raise bad_request("max_tokens", "max_tokens: 0 asks for the prompt alone, which only `echo: true` returns")
    params = _generation_params(fields, max_tokens, "max_tokens", fields.integer("logprobs", None), "logprobs", echo)
    prompts = _prompts(fields.raw.get("prompt"))
    fields.warn_unread("/v1/completions")
    return CompletionRequest(prompts, params)


def parse_chat(body: Any, tool_grammar: bool = True) -> ChatRequest:
    """`tool_grammar`: whether the engine takes constraints, so that one may hold the tool calls
    (Engine.takes_constraints)."""
    fields = _Fields(body)
    # vLLM's bench chat client sends max_completion_tokens, others max_tokens; the newer name wins.
    name = "max_completion_tokens" if fields.raw.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = fields.integer(name, None)
    if max_tokens == 0:
        raise bad_request(name, f"{name}: must be >= 1 (a chat completion has no echo of the prompt)")
    echo = fields.boolean("echo", False)
    wants_logprobs = fields.boolean("logprobs", False)
    top_logprobs = fields.integer("top_logprobs", None)
    if top_logprobs is not None and not wants_logprobs:
        raise bad_request("top_logprobs", "top_logprobs: only allowed when logprobs is true")
    logprobs = (top_logprobs or 0) if wants_logprobs else None
    params = _generation_params(fields, max_tokens, name, logprobs, "top_logprobs", echo, ("parallel_tool_calls",))
    messages = fields.raw.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", f"messages: must be a non-empty list of messages, got {_show(messages)}")
    options = _chat_options(fields)
    if params.constraint is not None and options.uses_tools:
        if options.forces_call:
            raise bad_request(
                params.constraint.field,
                f"{params.constraint.field}: tool_choice {options.tool_choice!r} already constrains the answer to a "
                "tool call; a request takes one structured output constraint",
            )
        log.warning(
            "%s constrains the answer, so no grammar holds its tool calls to the tools' schemas (tool_choice auto): "
            "a call the model writes is parsed once its block closes",
            params.constraint.field,
        )
        options = dataclasses.replace(options, tool_grammar_off=True)
    elif not tool_grammar and options.uses_tools and not options.forces_call:
        _warn_tool_calls_unheld()
        options = dataclasses.replace(options, tool_grammar_off=True)  # a forced call is refused by the engine
    tool_call = tool_call_grammar(options)
    if tool_call is not None:  # the calls the model writes must be the tools', their parameters the tools' schemas
        held_by = "tool_choice" if options.forces_call else "tools"  # the field a grammar error names
        params = dataclasses.replace(params, constraint=Constraint(ConstraintKind.GRAMMAR, tool_call, held_by))
    include_reasoning = fields.boolean("include_reasoning", True)
    fields.warn_unread("/v1/chat/completions")
    return ChatRequest(messages, options, params, include_reasoning, _echoed(messages) if echo else "")


@functools.cache
def _warn_tool_calls_unheld() -> None:
    """Once per process: every tools request under auto is served this way."""
    log.warning(
        "this server takes no structured output constraints (speculative decoding, or no grammar compiler), so no "
        "grammar holds tool calls to the tools' schemas under tool_choice auto: a call the model writes is parsed "
        "once its block closes"
    )


def _echoed(messages: list) -> str:
    """What vLLM's chat `echo` puts before the reply: the last message's text when it is the assistant's (the
    reply's role), else nothing."""
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return ""
    content = last.get("content")
    if isinstance(content, list):  # text parts, joined as vLLM joins them
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _chat_options(fields: _Fields) -> ChatOptions:
    """Thinking mode and reasoning effort as the vLLM and SGLang recipes send them (`chat_template_kwargs`, also
    read at the top level), and the tools; DeepSeek-V4's encoding checks the values."""
    kwargs = _Fields(fields.object("chat_template_kwargs"), prefix="chat_template_kwargs.")
    thinking = kwargs.boolean("thinking", None)
    if thinking is None:
        thinking = kwargs.boolean("enable_thinking", False)
    effort_field = "chat_template_kwargs.reasoning_effort"
    effort = kwargs.raw.get("reasoning_effort")
    if effort is None:
        effort_field, effort = "reasoning_effort", fields.raw.get("reasoning_effort")
    try:
        continues = fields.boolean("continue_final_message", False)
        return chat_options(
            thinking,
            effort,
            fields.raw.get("tools"),
            fields.raw.get("tool_choice"),
            # vLLM's default is true, and refuses only both set true by the client.
            fields.boolean("add_generation_prompt", not continues),
            continues,
            fields.boolean("parallel_tool_calls", True),
        )
    except ChatTemplateError as error:
        field = effort_field if error.field == "reasoning_effort" else error.field
        message = str(error).replace("reasoning_effort:", f"{field}:", 1)
        raise bad_request(field, message) from None


def _generation_params(
    fields: _Fields,
    max_tokens: int | None,
    max_tokens_field: str,
    logprobs: int | None,
    logprobs_field: str,
    echo: bool,
    reads: tuple[str, ...] = (),
) -> GenerationParams:
    """`reads`: fields NO_OP_VALUES lists that this endpoint reads itself (chat: parallel_tool_calls)."""
    for name, values in NO_OP_VALUES.items():
        if name in reads:
            continue
        value = fields.raw.get(name)
        if value is not None and not any(_same(value, v) for v in values):
            accepted = ", ".join(repr(v) for v in values) or "null"
            raise bad_request(name, f"{name}={_show(value)} is not supported (accepted: {accepted})")
    stream = fields.boolean("stream", False)
    options = fields.object("stream_options")
    if options is not None and not stream:
        raise bad_request("stream_options", "stream_options: only allowed when stream is true")
    stream_fields = _Fields(options, prefix="stream_options.")
    include_usage = stream_fields.boolean("include_usage", False)
    seed = fields.integer("seed", None)
    if seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise bad_request("seed", f"seed: must be a signed 64-bit integer, in [-2**63, 2**63), got {seed}")
    n = fields.integer("n", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request("n", f"n: must be in [1, {MAX_CHOICES}], got {n}")
    best_of = fields.integer("best_of", n)
    if not n <= best_of <= MAX_CHOICES:
        raise bad_request("best_of", f"best_of: must be in [n, {MAX_CHOICES}] (n={n}), got {best_of}")
    if best_of > n and stream:  # the best are known only once all are done
        raise bad_request("best_of", f"best_of: {best_of} > n ({n}) is not available when stream is true")
    for name in LABEL_FIELDS:
        fields.raw.get(name)
    given = {name: plain.read(fields) for name, plain in PLAIN_SAMPLING_FIELDS.items()}
    sampling = {name: value for name, value in given.items() if value is not None}
    top_k = fields.integer("top_k", -1)
    sampling["top_k"] = top_k if top_k > 0 else -1  # <= 0 means off, as in vLLM
    sampling["logit_bias"] = _logit_bias(fields.object("logit_bias"))
    return GenerationParams(
        model=fields.string("model"),
        max_tokens=max_tokens,
        max_tokens_field=max_tokens_field,
        seed=None if seed is None else seed % 2**32,
        stop=_stop_strings(fields.raw.get("stop")),
        stream=stream,
        include_usage=include_usage,
        return_token_ids=fields.boolean("return_token_ids", False),
        sampling_values=sampling,
        n=n,
        best_of=best_of,
        logprobs=logprobs,
        logprobs_field=logprobs_field,
        echo=echo,
        tokens_as_ids=fields.boolean("return_tokens_as_token_ids", False),
        priority=fields.integer("priority", 0),
        include_stop_str_in_output=fields.boolean("include_stop_str_in_output", False),
        continuous_usage=include_usage and stream_fields.boolean("continuous_usage_stats", False),
        truncate_prompt_tokens=_truncation(fields.integer("truncate_prompt_tokens", None)),
        truncation_side=_truncation_side(fields.string("truncation_side")),
        prompt_logprobs=_prompt_logprobs(fields.integer("prompt_logprobs", None), stream),
        constraint=_constraint(fields),
    )


# vLLM's structured_outputs keys (and the older guided_* fields) -> the constraint kind each asks for.
STRUCTURED_KINDS = {
    "json": ConstraintKind.JSON_SCHEMA,
    "regex": ConstraintKind.REGEX,
    "choice": ConstraintKind.CHOICE,
    "grammar": ConstraintKind.GRAMMAR,
    "json_object": ConstraintKind.JSON_OBJECT,
}
# Options of vLLM's structured outputs that jaxserve does not take: a 400 naming them rather than ignored.
STRUCTURED_OPTIONS_REFUSED = ("whitespace_pattern", "structural_tag")


def _constraint(fields: _Fields) -> Constraint | None:
    """The request's structured output constraint, from whichever of the three spellings it used (one at most)."""
    found = [c for c in (_response_format(fields), *_structured_outputs(fields), *_guided(fields)) if c is not None]
    if len(found) > 1:
        names = ", ".join(c.field for c in found)
        raise bad_request(found[1].field, f"{names}: a request takes one structured output constraint, got several")
    return found[0] if found else None


def _response_format(fields: _Fields) -> Constraint | None:
    fmt = _Fields(fields.object("response_format"), prefix="response_format.")
    kind = fmt.string("type")
    if not fmt.raw or kind == "text":
        return None
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT, "", "response_format")
    if kind != "json_schema":
        raise bad_request(
            "response_format.type",
            f"response_format.type: must be text, json_object or json_schema, got {_show(kind)}",
        )
    spec = _Fields(fmt.object("json_schema"), prefix="response_format.json_schema.")
    if not spec.raw:
        raise bad_request("response_format.json_schema", "response_format.json_schema: required for json_schema")
    schema = spec.object("schema")
    field = "response_format.json_schema.schema"
    if schema is None:  # OpenAI's schema is optional: any JSON object
        return Constraint(ConstraintKind.JSON_OBJECT, "", field)
    strict = spec.boolean("strict", False)
    if not strict:  # keywords the compiler does not implement are ignored, not refused
        schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), "lenient": True}}
    return Constraint.json_schema(schema, field, closed_objects=strict)


def _structured_outputs(fields: _Fields) -> list[Constraint | None]:
    options = _Fields(fields.object("structured_outputs"), prefix="structured_outputs.")
    for name in STRUCTURED_OPTIONS_REFUSED:
        if options.raw.get(name) is not None:
            raise bad_request(f"structured_outputs.{name}", f"structured_outputs.{name}: is not supported")
    if options.raw.get("disable_any_whitespace") is False:
        raise bad_request(
            "structured_outputs.disable_any_whitespace",
            "structured_outputs.disable_any_whitespace: false is not supported (JSON is always written without "
            "free whitespace)",
        )
    return [
        _constraint_of(kind, options.raw.get(key), f"structured_outputs.{key}")
        for key, kind in STRUCTURED_KINDS.items()
    ]


def _guided(fields: _Fields) -> list[Constraint | None]:
    for name in ("guided_whitespace_pattern", "guided_decoding_backend"):
        if fields.raw.get(name) is not None:
            raise bad_request(name, f"{name}: is not supported")
    guided = ("json", "regex", "choice", "grammar")
    return [_constraint_of(STRUCTURED_KINDS[key], fields.raw.get(f"guided_{key}"), f"guided_{key}") for key in guided]


def _constraint_of(kind: ConstraintKind, value: Any, field: str, closed_objects: bool = False) -> Constraint | None:
    """One structured outputs value as a constraint (None: not given), its type checked."""
    if value is None or value is False:
        return None
    if kind is ConstraintKind.JSON_OBJECT:
        if value is not True:
            raise bad_request(field, f"{field}: must be true or false, got {_show(value)}")
        return Constraint(kind, "", field)
    if kind is ConstraintKind.JSON_SCHEMA:
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(field, f"{field}: is not valid JSON") from None
        if not isinstance(value, dict):
            raise bad_request(field, f"{field}: must be a JSON schema (an object), got {_show(value)}")
        return Constraint.json_schema(value, field, closed_objects)
    if kind is ConstraintKind.CHOICE:
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_request(field, f"{field}: must be a non-empty list of strings, got {_show(value)}")
        return Constraint.choice(value, field)
    if not isinstance(value, str) or not value:
        raise bad_request(field, f"{field}: must be a non-empty string, got {_show(value)}")
    return Constraint(kind, value, field)


def _prompt_logprobs(k: int | None, stream: bool) -> int | None:
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise bad_request("prompt_logprobs", f"prompt_logprobs: must be in [0, {MAX_LOGPROBS}], got {k}")
    if k and stream:  # as vLLM: they would all have to come before the first token
        raise bad_request("prompt_logprobs", "prompt_logprobs: not available when stream is true")
    return k


def _truncation(k: int | None) -> int | None:
    if k is not None and k != -1 and k < 1:
        raise bad_request(
            "truncate_prompt_tokens", f"truncate_prompt_tokens: must be -1 (the context's length) or >= 1, got {k}"
        )
    return k


def _truncation_side(side: str | None) -> str:
    """vLLM's: left (its default) keeps the prompt's last tokens, right its first."""
    if side not in (None, "left", "right"):
        raise bad_request("truncation_side", f"truncation_side: must be 'left' or 'right', got {_show(side)}")
    return side or "left"


def _prompts(prompt: Any) -> tuple[str | list[int], ...]:
    """OpenAI's prompt forms: a string, a list of token ids, or a batch: a list of strings or of token-id lists
    (not mixed). Every prompt is checked here, so a bad one refuses the whole call before anything runs."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        kinds = {type(p) for p in prompt}
        if len(kinds) > 1:
            raise bad_request("prompt", "prompt: a batch is a list of strings or a list of token-id lists, not both")
        return tuple(_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt))
    return (_prompt(prompt, "prompt"),)


def _prompt(prompt: Any, where: str) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt", f"{where}: must not be empty")
        return prompt
    if isinstance(prompt, list):
        return _token_ids(where, prompt, param="prompt")
    raise bad_request("prompt", f"{where}: must be a string or a list of token ids, got {_show(prompt)}")


def _token_ids(name: str, ids: Any, allow_empty: bool = False, param: str | None = None) -> list[int]:
    """`param`: the field the 400 names when `name` is a place inside it (prompt[2] is in prompt)."""
    param = param or name
    if not isinstance(ids, list) or (not ids and not allow_empty):
        kind = "a list" if allow_empty else "a non-empty list"
        raise bad_request(param, f"{name}: must be {kind} of token ids, got {_show(ids)}")
    for i, token in enumerate(ids):
        if not _is_int(token):
            raise bad_request(param, f"{name}[{i}]: must be an integer token id, got {_show(token)}")
    return ids


def _logit_bias(bias: dict | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` (keys are strings in JSON); the range is SamplingParams' rule."""
    entries = (bias or {}).items()
    if keys := [_show(key) for key, _ in entries if not key.lstrip("-").isdigit()]:
        raise bad_request("logit_bias", f"logit_bias: keys must be token ids, got {listed(keys)}")
    if values := [f"{key}: {_show(v)}" for key, v in entries if isinstance(v, bool) or not isinstance(v, (int, float))]:
        raise bad_request("logit_bias", f"logit_bias: biases must be numbers, got {listed(values)}")
    return tuple((int(key), float(value)) for key, value in entries)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop", f"stop: must be a non-empty string or a list of them, got {_show(stop)}")
    return tuple(stops)


class _Fields:
    """Typed getters over a JSON object; `null` means the default, a wrong type is a 400 naming the field."""

    def __init__(self, raw: Any, prefix: str = ""):
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            name = prefix.rstrip(".") or "body"
            raise bad_request(prefix.rstrip(".") or None, f"{name}: must be a JSON object, got {_show(raw)}")
        self.raw = _ReadTracking(raw)
        self.prefix = prefix

    def warn_unread(self, endpoint: str) -> None:
        """Log the fields nothing read: not part of the API, so ignored (as vLLM does), but never silently."""
        unread = sorted(set(self.raw) - self.raw.read)
        if unread:
            log.warning("%s: the request's fields %s are not part of the API and were ignored", endpoint, unread)

    def _fail(self, name: str, rule: str, value: Any):
        return bad_request(self.prefix + name, f"{self.prefix}{name}: must be {rule}, got {_show(value)}")

    @overload
    def integer(self, name: str, default: int) -> int: ...
    @overload
    def integer(self, name: str, default: None) -> int | None: ...
    def integer(self, name: str, default: int | None) -> int | None:
        value = self.raw.get(name)
        if value is None:
            return default
        if not _is_int(value):
            raise self._fail(name, "an integer", value)
        return value

    def number(self, name: str) -> float | None:
        value = self.raw.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._fail(name, "a number", value)
        return float(value)

    @overload
    def boolean(self, name: str, default: bool) -> bool: ...
    @overload
    def boolean(self, name: str, default: None) -> bool | None: ...
    def boolean(self, name: str, default: bool | None) -> bool | None:
        value = self.raw.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._fail(name, "true or false", value)
        return value

    def string(self, name: str) -> str | None:
        value = self.raw.get(name)
        if value is not None and not isinstance(value, str):
            raise self._fail(name, "a string", value)
        return value

    def object(self, name: str) -> dict | None:
        value = self.raw.get(name)
        if value is not None and not isinstance(value, dict):
            raise self._fail(name, "a JSON object", value)
        return value


class _ReadTracking(dict):
    """A JSON object that remembers which of its keys were asked for."""

    def __init__(self, raw: dict):
        super().__init__(raw)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _same(value: Any, allowed: Any) -> bool:
    # JSON true is not 1 here (Python says it is), but 0 and 0.0 are the same number.
    if isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    return value == allowed


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
