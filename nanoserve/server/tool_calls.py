"""Tool calls in the Hermes format, as Qwen2.5, Qwen3 and the Hermes models write them.

OpenAI's API returns a tool call as structured data; a model can only write text. Models tuned on
the Hermes format announce a call by writing one block per call, possibly several in a row,
possibly after some ordinary text::

    I'll look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The chat template taught the model this shape (it lists the tools' JSON schemas in the system
prompt and renders past calls the same way), so the server's part is to find the blocks, turn each
into an OpenAI tool call and return the rest of the text as the message's content:

* `parse_tool_calls` does that for a whole output; `tool_call_stream.ToolCallStream` does it for a
  stream of text deltas, giving the same result.
* A block that does not hold a JSON object naming one of the request's tools (with `arguments` an
  object, or a string of a JSON object) is not a call: the model failed to make one, and its text is
  kept in the content, as vLLM's `hermes` parser does. So is a block the output ends inside.
* `tool_choice_grammar` writes the llguidance grammar that *forces* a call, for `tool_choice`
  "required" or a named function: the Hermes text above, with the arguments constrained by the
  function's JSON schema (`parameters`).
* `validate_tools` checks a request's `tools`, `tool_choice` and `parallel_tool_calls`, with
  messages that name the offending field.

Only this module and `tool_call_stream` know the format, so another model family's (Llama's
`<|python_tag|>`, Mistral's `[TOOL_CALLS]`) would be a sibling module with the same functions.
"""
from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema  # no stubs; jsonschema.validators comes with it

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# OpenAI's rule for function names. Besides matching what clients expect, it keeps a name free of
# quotes and backslashes, so it can be written into a grammar's string literal as it is.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The first `</tool_call>` closes a block, as in vLLM's non-greedy regex.
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + "(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)

_TOOL_CHOICE_MODES = ("none", "auto", "required")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
# The JSON the grammar lets the model write is the JSON the chat template shows it: `tojson`, that
# is json.dumps's default separators, no newlines or indentation. Flexible whitespace would let a
# sampled model pad the arguments with whitespace runs for as long as it likes.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ParsedToolCalls:
    """A whole output split into its text and its tool calls (OpenAI's message shape)."""

    content: str | None  # the text outside the calls, stripped; None if nothing is left
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def new_tool_call_id() -> str:
    """An id in OpenAI's style: `call_` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def tool_names(tools: list[dict[str, Any]] | None) -> frozenset[str]:
    """The names of the functions a request offers (its tools, already validated)."""
    return frozenset(tool["function"]["name"] for tool in tools or ())


def tool_call_from_block(body: str, names: Collection[str]) -> dict[str, Any] | None:
    """The OpenAI tool call a block's body (the text between the tags) stands for, or None if it
    is not one: not a JSON object, no known function `name`, or `arguments` that are not an object.

    The arguments are returned as a JSON string, as OpenAI sends them: re-serialized with
    `ensure_ascii=False` when the model wrote an object, kept verbatim when the model wrote a string
    that already holds one. Missing arguments are an empty object (models often omit them for a
    function without parameters).
    """
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict):
        return None
    name = call.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except ValueError:
            return None
        if not isinstance(decoded, dict):
            return None
    elif isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    return {"id": new_tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None) -> ParsedToolCalls:
    """Split a finished output into content and tool calls.

    Every `<tool_call>…</tool_call>` block that holds a valid call becomes a tool call, in order;
    everything else, failed blocks and an unclosed one included, is content.
    """
    names = tool_names(tools)
    calls: list[dict[str, Any]] = []
    pieces: list[str] = []
    end = 0
    for block in _BLOCK.finditer(text):
        pieces.append(text[end:block.start()])
        call = tool_call_from_block(block.group(1), names)
        if call is None:
            pieces.append(block.group(0))
        else:
            calls.append(call)
        end = block.end()
    pieces.append(text[end:])
    content = "".join(pieces).strip()
    return ParsedToolCalls(content=content or None, tool_calls=calls)


def forced_function_names(tools: list[dict[str, Any]] | None,
                          tool_choice: str | Mapping[str, Any] | None) -> list[str] | None:
    """The functions `tool_choice` forces the model to call one of, or None if it forces none."""
    if isinstance(tool_choice, Mapping):
        return [tool_choice["function"]["name"]]
    if tool_choice == "required":
        return [tool["function"]["name"] for tool in tools or ()]
    return None


def tool_choice_grammar(tools: list[dict[str, Any]] | None, tool_choice: str | Mapping[str, Any] | None,
                        parallel_tool_calls: bool | None) -> str | None:
    """The llguidance Lark grammar that forces the model to call a tool, or None ("auto", "none").

    `tool_choice` "required" lets the model call any of the tools: one call, or one or more
    (newline-separated, as Qwen writes them) if `parallel_tool_calls` is not False. A named function
    forces exactly one call of it. The output is the Hermes text, e.g. with parallel calls::

        %llguidance {}
        start: tool_call ("\\n" tool_call)*
        tool_call: call_0 | call_1
        call_0: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " args_0 "}\\n</tool_call>"
        args_0: %json {"type": "object", ..., "x-guidance": {...}}
        call_1: ...

    The name is a literal, so the model can only name an allowed function; `%json` makes llguidance
    constrain the arguments to the function's `parameters` (an object if the schema does not say;
    strictly only for a `strict` function, see `_arguments_schema`), in the compact `json.dumps`
    style the chat template shows the model. `tools` must have passed `validate_tools`.
    """
    names = forced_function_names(tools, tool_choice)
    if names is None:
        return None
    functions = {tool["function"]["name"]: tool["function"] for tool in tools or ()}
    if isinstance(tool_choice, Mapping) or parallel_tool_calls is False:
        start = "start: tool_call"
    else:
        start = 'start: tool_call ("\\n" tool_call)*'
    lines = ["%llguidance {}", start, "tool_call: " + " | ".join(f"call_{i}" for i in range(len(names)))]
    for i, name in enumerate(names):
        opening = TOOL_CALL_START + '\n{"name": ' + json.dumps(name) + ', "arguments": '
        closing = "}\n" + TOOL_CALL_END
        lines.append(f"call_{i}: {json.dumps(opening)} args_{i} {json.dumps(closing)}")
        lines.append(f"args_{i}: %json {json.dumps(_arguments_schema(functions[name]))}")
    return "\n".join(lines) + "\n"


def _arguments_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    """The schema the grammar holds a function's arguments to: its parameters, always an object
    (OpenAI's arguments are one), written in the chat template's JSON style.

    As with OpenAI, only a `strict` function's arguments are guaranteed to match its schema: for
    the others llguidance is lenient, ignoring the keywords it does not implement (`uniqueItems`,
    `not`, ...) rather than failing the request; a strict function's schema with such a keyword
    fails to compile, and the request with it.
    """
    parameters = function.get("parameters")
    schema = dict(parameters) if parameters is not None else {}
    schema.setdefault("type", "object")
    schema["x-guidance"] = {**_JSON_STYLE, "lenient": not function.get("strict")}
    return schema


def validate_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> None:
    """Check a request's tool fields, raising ValueError with a message for the client that names
    the field at fault. Accepted shapes (OpenAI's): `tools` a list of
    `{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}` whose
    parameters are a valid JSON schema of an object; `tool_choice` "none", "auto", "required" or
    `{"type": "function", "function": {"name": ...}}` naming one of the tools."""
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise ValueError("tools must be a list")
        for i, tool in enumerate(tools):
            names.append(_validate_tool(tool, f"tools[{i}]", names))
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError("parallel_tool_calls must be a boolean")
    if tool_choice is None:
        return
    if isinstance(tool_choice, str):
        if tool_choice not in _TOOL_CHOICE_MODES:
            raise ValueError(f"tool_choice must be one of {', '.join(map(repr, _TOOL_CHOICE_MODES))} "
                             f"or a function, got {tool_choice!r}")
        if tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise ValueError("tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    function = tool_choice.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError("tool_choice.function.name is required")
    if function["name"] not in names:
        raise ValueError(f"tool_choice names function {function['name']!r}, which is not in tools")


def _validate_tool(tool: Any, where: str, earlier_names: list[str]) -> str:
    """Check one entry of `tools` (`where` is its path in the request); return its name."""
    if not isinstance(tool, dict):
        raise ValueError(f"{where} must be an object")
    if tool.get("type") != "function":
        raise ValueError(f"{where}.type must be 'function'")
    unknown = sorted(set(tool) - {"type", "function"})
    if unknown:
        raise ValueError(f"{where} has unknown field {unknown[0]!r}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function is required and must be an object")
    unknown = sorted(set(function) - set(_FUNCTION_KEYS))
    if unknown:
        raise ValueError(f"{where}.function has unknown field {unknown[0]!r}")
    name = function.get("name")
    if name is None:
        raise ValueError(f"{where}.function.name is required")
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes")
    if name in earlier_names:
        raise ValueError(f"{where}.function.name {name!r} is used by an earlier tool")
    # None stands for absent, as a client library serializing an unset field may send it.
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a string")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"{where}.function.strict must be a boolean")
    parameters = function.get("parameters")
    if parameters is not None:
        _validate_parameters(parameters, f"{where}.function.parameters")
    return name


def _validate_parameters(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object")
    if schema.get("type", "object") != "object":
        raise ValueError(f"{where} must be the schema of an object (type 'object'), "
                         f"got type {schema['type']!r}")
    # The schema's own `$schema` picks the draft to check against; 2020-12 otherwise.
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as error:
        path = "".join(f".{part}" if isinstance(part, str) else f"[{part}]" for part in error.path)
        raise ValueError(f"{where}{path} is not a valid JSON schema: {error.message}") from None
