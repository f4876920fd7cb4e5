"""The Responses API's output items (extensions/responses/events.py) follow the chat rule for
tool calls: every function call of the reply, or only the first with parallel_tool_calls
false."""

from __future__ import annotations

import pytest

from minisgl.extensions.structured_output.chat_reply import ChatReplyParser

# Text, then two Hermes tool calls (the reply of structured_output/test_tool_calls.py).
REPLY = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


@pytest.mark.parametrize("parallel", [True, False])
def test_responses_output_items_follow_parallel_tool_calls(parallel: bool) -> None:
    """/v1/responses applies the chat rule: its whole reply (and the final event of its
    stream) lists every function call, or only the first with parallel_tool_calls false."""
    from minisgl.extensions.responses.events import output_items

    items = output_items("msg_1", REPLY, ChatReplyParser(None, True, parallel))
    assert items[0]["type"] == "message"
    assert items[0]["content"][0]["text"] == "Let me check."
    names = [i["name"] for i in items if i["type"] == "function_call"]
    assert names == (["get_weather", "get_time"] if parallel else ["get_weather"])
