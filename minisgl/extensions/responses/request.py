"""The body of a Responses API request, and the chat request it amounts to."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from minisgl.ipc.messages import JSONDict
from minisgl.server.protocol import ChatCompletionRequest, Priority


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[JSONDict]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: JSONDict | None = None  # {"format": {"type": "text" | "json_object" | ...}}
    tools: list[object] | None = None
    tool_choice: object = None
    parallel_tool_calls: bool | None = None  # false: only the reply's first call is kept
    previous_response_id: str | None = None
    store: bool | None = None  # accepted; nothing is stored
    metadata: dict[str, str] | None = None
    user: str | None = None
    priority: Priority = None  # vLLM's extra field

    @property
    def format(self) -> object:
        """``text.format``: the output's format (default text)."""
        return (self.text or {}).get("format") or {"type": "text"}

    def chat_request(self) -> ChatCompletionRequest:
        """The equivalent chat completion (ValueError naming the field if there is none)."""
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id must be unset: responses are not stored")
        messages: list[JSONDict] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for item in self.input:
                _add_item(messages, item)
        fmt = self.format
        if not isinstance(fmt, dict):
            raise ValueError("text must be {'format': {'type': ...}}")
        if fmt.get("type") == "json_schema":  # the schema sits in the format itself here
            fmt = {"type": "json_schema", "json_schema": fmt}
        # Validated as a whole, like a chat request's body (errors name messages.<i>...).
        return ChatCompletionRequest.model_validate(
            {
                "messages": messages,
                "max_tokens": self.max_output_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "stream": self.stream,
                "response_format": fmt,
                "tools": [_chat_tool(t) for t in self.tools] if self.tools else None,
                "tool_choice": _chat_tool_choice(self.tool_choice),
                "parallel_tool_calls": self.parallel_tool_calls,
                "priority": self.priority,
            }
        )


def _chat_tool(tool: object) -> JSONDict:
    """A Responses function tool ({"type": "function", "name", "parameters"}) as a chat one."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ValueError("tools must be function tools: {'type': 'function', 'name': ...}")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: object) -> object:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _add_item(messages: list[JSONDict], item: JSONDict) -> None:
    """One input item onto the conversation: a message, an earlier function call (merged into
    the assistant message before it), or a call's output (a tool message)."""
    kind = item.get("type", "message")
    if kind == "function_call":
        function = {"name": item.get("name"), "arguments": item.get("arguments", "")}
        call = {"id": item.get("call_id"), "type": "function", "function": function}
        last = messages[-1] if messages else None
        calls = last.get("tool_calls") if last is not None else None
        if last is not None and last["role"] == "assistant" and isinstance(calls, list):
            calls.append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise ValueError("input function_call_output items must carry their output as text")
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
    else:
        messages.append(_message(item))


_ROLES = ("user", "system", "developer", "assistant")


def _message(item: JSONDict) -> JSONDict:
    if item.get("type", "message") != "message" or item.get("role") not in _ROLES:
        raise ValueError("input must be a string or a list of messages with a role and content")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
                raise ValueError("input must carry text parts only (input_text / output_text)")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    if not isinstance(content, str):
        raise ValueError("input messages must have text content")
    return {"role": item["role"], "content": content}
