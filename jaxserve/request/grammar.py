"""Structured outputs: what a request's text must match (a JSON schema, any JSON object, a regex, one of some
choices, a grammar), compiled by llguidance against the model's tokenizer, and each request's matcher, which says
which tokens may come next (docs/architecture.md, "Structured outputs").

llguidance, not xgrammar or outlines-core: xgrammar imports torch and transformers (never a run-time dependency
here), and outlines-core compiles regular languages only (no `grammar`, no recursive schemas); llguidance takes JSON
schemas, regexes and Lark grammars, has no dependencies, and computes a mask in tens of microseconds.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from jaxserve.request.params import InvalidRequest

# JSON is written compactly: flexible whitespace lets a model pad an object with newlines until max_tokens runs out.
JSON_OPTIONS: Any = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
COMPILED_GRAMMARS_KEPT = 256  # distinct constraints whose compiled grammar is cached (n choices share one)


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # spec: the schema as JSON text
    JSON_OBJECT = "json_object"  # any JSON object (spec unused)
    REGEX = "regex"
    CHOICE = "choice"  # spec: a JSON list of the strings
    GRAMMAR = "grammar"  # spec: a Lark grammar (llguidance's dialect) or GBNF


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match; `field` is the client's name for it, which errors name."""

    kind: ConstraintKind
    spec: str
    field: str

    @staticmethod
    def json_schema(schema: object, field: str, closed_objects: bool = False) -> Constraint:
        """`closed_objects`: an object schema that does not say otherwise takes no properties beyond its own (OpenAI's
        strict mode, which requires `additionalProperties: false` everywhere; vLLM's disable_additional_properties)."""
        if closed_objects:
            schema = _closed(schema)
        return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema, sort_keys=True), field)

    @staticmethod
    def choice(choices: Iterable[str], field: str) -> Constraint:
        return Constraint(ConstraintKind.CHOICE, json.dumps(list(choices)), field)

    def grammar_text(self) -> str:
        """The llguidance grammar for this constraint (not yet checked)."""
        kind = self.kind
        if kind is ConstraintKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind is ConstraintKind.JSON_SCHEMA:
            return llguidance.LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
        if kind is ConstraintKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        if kind is ConstraintKind.CHOICE:
            return llguidance.grammar_from("choice", self.spec)
        return llguidance.grammar_from("grammar", self.spec)


def _closed(schema: object) -> object:
    """`schema` with `additionalProperties: false` on every object schema that leaves it unsaid."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if ("properties" in closed or closed.get("type") == "object") and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


class GrammarCompiler:
    """Compiles constraints for one tokenizer (built once at start-up from its tokenizer.json); an invalid constraint
    is an InvalidRequest naming the client's field."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int]):
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
        self._compiled = functools.lru_cache(maxsize=COMPILED_GRAMMARS_KEPT)(self._compile)

    def _compile(self, constraint: Constraint) -> str:
        try:
            grammar = constraint.grammar_text()
        except ValueError as error:  # a schema that is not JSON, a grammar that does not convert
            raise InvalidRequest(constraint.field, f"{constraint.field}: {error}") from None
        problem = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if problem:
            raise InvalidRequest(
                constraint.field, f"{constraint.field}: the {constraint.kind.value} cannot be compiled: {problem}"
            )
        return grammar

    def check(self, constraint: Constraint) -> None:
        """Raise InvalidRequest (naming the field) unless `constraint` compiles."""
        self._compiled(constraint)

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher at the start of `constraint`'s text."""
        return GrammarMatcher(llguidance.LLMatcher(self._tokenizer, self._compiled(constraint), log_level=0))


def mask_words(vocab_size: int) -> int:
    """int32 words of a token bitmask (bit t % 32 of word t // 32 is token t)."""
    return -(-vocab_size // 32)


class GrammarMatcher:
    """One request's place in its constraint: the engine feeds it each delivered token (`accept`); the runner asks it
    for the tokens allowed next (`fill_mask`) just before the step that samples them."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def fill_mask(self, words: np.ndarray) -> None:
        """Write the bitmask of the tokens allowed next into `words` (int32, C-contiguous, mask_words(V) long). A
        matcher that admits nothing more (finished, or failed) allows everything: its token is never delivered."""
        if self._matcher.is_stopped() or self._matcher.is_error():
            words[:] = -1
            return
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def accept(self, token: int) -> str | None:
        """Advance past a delivered token; returns None, or why the token broke the constraint. A matcher that failed
        while computing its mask (nothing can follow, e.g. a schema no text satisfies) breaks on any token: its mask
        allowed everything."""
        if self._matcher.is_error() or not self._matcher.consume_token(token) or self._matcher.is_error():
            return self._matcher.get_error() or f"token {token} is not allowed here"
        return None

    @property
    def finished(self) -> bool:
        """The text is complete and nothing may follow: the request ends here ("stop"). A failed matcher is stopped
        too, but its text is not complete."""
        return self._matcher.is_stopped() and not self._matcher.is_error()
