"""A request's structured-output constraint (vLLM's `StructuredOutputsParams`), checked when made.

A request may ask that its output follow one constraint, and the engine then only lets the model
draw tokens that keep the output on it (constrained decoding, `nanoserve/grammar/`):

    json         a JSON schema, as a dict or its JSON text: the output is a JSON value it accepts
    regex        the output matches the regular expression in full
    choice       the output is exactly one of these strings
    grammar      the output is a sentence of this context-free grammar: llguidance's Lark dialect,
                 or llama.cpp's GBNF (told apart by its `::=`; converted to Lark by the backend)
    json_object  the output is some JSON object (OpenAI's `response_format={"type": "json_object"}`)

Exactly one of them is set. This module checks what needs no tokenizer and no grammar library:
the shape of each field, and that a JSON schema's text is JSON. Whether the schema, regex or
grammar itself is valid is the backend's `check` (`nanoserve/grammar/backend.py`), which the
server calls before a request reaches the engine.

Hashing. A frozen dataclass with a dict field cannot hash by its fields, and compiled grammars
are cached by constraint anyway, so equality and the hash go through `key`: the kind and a
canonical text of the constraint. A schema's canonical text is its compact JSON with the keys in
the order given, *not* sorted: llguidance generates an object's properties in the order of the
schema's `properties` (its docs, "Property order"), so two schemas that differ only in that order
compile to different grammars and must not share a cache entry. A dict schema is deep-copied
when the parameters are made, so a caller who later changes their dict changes neither the
constraint nor its key; do not change `params.json` in place either.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Literal

StructuredOutputsKind = Literal["json", "regex", "choice", "grammar", "json_object"]
_FIELDS: tuple[StructuredOutputsKind, ...] = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, eq=False)
class StructuredOutputsParams:
    """One structured-output constraint; set exactly one field (vLLM's names and meanings)."""

    json: str | dict[str, Any] | None = None  # a JSON schema, as a dict or its JSON text
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None  # stored as a tuple
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    json_object: bool = False  # any JSON object
    # The schema as a dict (the `json` field parsed, or a copy of the dict given); {} otherwise.
    _schema: dict[str, Any] = field(init=False, repr=False, default_factory=dict)
    _key: tuple[StructuredOutputsKind, str] = field(init=False, repr=False, default=("json_object", ""))

    def __post_init__(self) -> None:
        given = [name for name in _FIELDS if self._is_set(name)]
        if len(given) != 1:
            what = "none is" if not given else f"{', '.join(given)} are"
            raise ValueError(f"structured_outputs: set exactly one of {', '.join(_FIELDS)}; {what} set")
        kind = given[0]
        text: str
        if kind == "json":
            schema = self._parse_schema(self.json)
            object.__setattr__(self, "_schema", schema)
            if isinstance(self.json, dict):
                object.__setattr__(self, "json", schema)  # our own copy (see the module docstring)
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        elif kind == "regex":
            if not isinstance(self.regex, str):
                raise ValueError(f"structured_outputs.regex must be a string, got {type(self.regex).__name__}")
            text = self.regex
        elif kind == "choice":
            choices = self._normalise_choice(self.choice)
            object.__setattr__(self, "choice", choices)
            text = json.dumps(choices, ensure_ascii=False)  # unambiguous: the strings may hold commas
        elif kind == "grammar":
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ValueError("structured_outputs.grammar must be a non-empty string (a Lark or GBNF grammar)")
            text = self.grammar
        else:
            if self.json_object is not True:
                raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")
            text = ""
        object.__setattr__(self, "_key", (kind, text))

    def _is_set(self, name: StructuredOutputsKind) -> bool:
        value = getattr(self, name)
        # json_object's unset value is False (None too, as vLLM's default); any other value is set
        # and then checked to be True.
        return value is not None and not (name == "json_object" and value is False)

    @staticmethod
    def _parse_schema(value: object) -> dict[str, Any]:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json: the schema is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError("structured_outputs.json: a JSON schema must be a JSON object, "
                             f"got {type(value).__name__}")
        return copy.deepcopy(value)

    @staticmethod
    def _normalise_choice(value: object) -> tuple[str, ...]:
        # A bare string is iterable too, and would become a choice between its characters.
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ValueError("structured_outputs.choice must be a list of strings, "
                             f"got {type(value).__name__}")
        if not value:
            raise ValueError("structured_outputs.choice must not be empty")
        if not all(isinstance(c, str) for c in value):
            bad = next(c for c in value if not isinstance(c, str))
            raise ValueError(f"structured_outputs.choice must hold only strings, got {bad!r}")
        return tuple(value)

    @property
    def kind(self) -> StructuredOutputsKind:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return self._key[0]

    @property
    def key(self) -> tuple[StructuredOutputsKind, str]:
        """(kind, canonical text of the constraint): hashable, the compiled-grammar cache's key."""
        return self._key

    @property
    def schema(self) -> dict[str, Any]:
        """The JSON schema as a dict (for `json`; {} for the other kinds). Do not change it."""
        return self._schema

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StructuredOutputsParams):
            return NotImplemented
        return self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)
