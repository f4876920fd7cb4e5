"""Tool (function) calling for the chat route: the tools go to the chat template, and the
model's reply is parsed for calls in the Hermes format that Qwen2.5/Qwen3 (and Hermes) chat
templates teach:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text before the first call is the message's content; each complete, well-formed call becomes
an OpenAI ``tool_calls`` entry (arguments as a JSON string) and the finish reason becomes
"tool_calls". A reply whose calls do not parse is returned as plain content.

``tool_choice="required"`` or a named function constrains the reply with a grammar (one call
of a listed function whose arguments match its JSON schema), through structured output.
"""

from __future__ import annotations

import json
import re
import uuid

from minisgl.extensions.structured_output.reasoning import partial_suffix
from minisgl.ipc.messages import JSONDict

START, END = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _function(tool: object) -> JSONDict:
    """A tool's ``function`` object (ValueError naming tools if it has none)."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        fn = None
    if not isinstance(fn, dict):
        raise ValueError("tools must be objects of type 'function' with a 'function' object")
    return fn


def _name(tool: object) -> str:
    name = _function(tool).get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("tools must each name their function (function.name)")
    return name


def check_tools(tools: list[JSONDict], tool_choice: object) -> None:
    """ValueError naming the field unless ``tools`` are OpenAI function tools and
    ``tool_choice`` is none / auto / required / one of them by name."""
    names = []
    for tool in tools:
        names.append(_name(tool))
        if not isinstance(_function(tool).get("parameters", {}), dict):
            raise ValueError("tools must give function.parameters as a JSON Schema object")
    if tool_choice in (None, "none", "auto"):
        return
    if tool_choice == "required":
        if not tools:
            raise ValueError("tool_choice must not be 'required' without tools")
        return
    name = forced_name(tool_choice)
    if name is None:
        raise ValueError(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}'
        )
    if name not in names:
        raise ValueError(f"tool_choice must name one of the tools, got {name!r}")


def forced_name(tool_choice: object) -> str | None:
    """The function a named tool_choice forces, else None."""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return str(fn["name"])
    return None


def call_grammar(tools: list[JSONDict], tool_choice: object) -> str | None:
    """EBNF for a reply that is exactly one call (``required``: of any listed function; a
    named choice: of that one), or None when the reply is free. Needs xgrammar."""
    if tool_choice != "required" and forced_name(tool_choice) is None:
        return None
    try:
        import xgrammar as xgr
    except ImportError:
        raise ValueError(
            "tool_choice 'required' or a named function needs the optional package xgrammar: "
            "pip install 'minisgl[grammar]'"
        ) from None
    name = forced_name(tool_choice)
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": _name(t)},
                "arguments": _function(t).get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
        if name is None or _name(t) == name
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    try:
        body = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except Exception as e:  # noqa: BLE001 - xgrammar raises several types for bad input
        raise ValueError(f"tools must have valid JSON Schema parameters: {e}") from None
    grammar = xgr.Grammar.concat(
        xgr.Grammar.from_ebnf(f"root ::= {json.dumps(START + chr(10))}"),
        body,
        xgr.Grammar.from_ebnf(f"root ::= {json.dumps(chr(10) + END)}"),
    )
    return str(grammar)


def parse_tool_calls(text: str) -> tuple[str | None, list[JSONDict]]:
    """(content, calls) of a complete reply; no calls if any call block fails to parse."""
    calls: list[JSONDict] = []
    for m in _CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
    if not calls:
        return text, []
    content = text[: text.index(START)].strip()
    return content or None, calls


class StreamingToolParser:
    """Per streamed choice: passes content through until a call may begin, then holds the
    rest back; ``finish`` parses it (content still owed, calls)."""

    def __init__(self) -> None:
        self.held = ""
        self.in_calls = False
        self.text = ""  # the whole reply, for the final parse

    def feed(self, delta: str) -> str:
        """The part of ``delta`` that is content for sure (may be empty)."""
        self.text += delta
        if self.in_calls:
            return ""
        buf = self.held + delta
        at = buf.find(START)
        if at >= 0:
            self.in_calls, self.held = True, ""
            return buf[:at]
        # Hold back a tail that could be the start of "<tool_call>".
        keep = partial_suffix(buf, START)
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def finish(self) -> tuple[str, list[JSONDict]]:
        """(content not yet sent, calls) once the reply is complete."""
        if not self.in_calls:
            rest, self.held = self.held, ""
            return rest, []
        content, calls = parse_tool_calls(self.text)
        if not calls:  # not calls after all: everything from the tag on is content
            return self.text[self.text.index(START) :], []
        return "", calls
