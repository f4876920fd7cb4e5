"""OpenAI's Responses API, POST /v1/responses: text in; an assistant message and function
calls out.

The request becomes a chat conversation (``instructions`` as the system message, then the
``input`` items: messages, earlier ``function_call`` items as the assistant's tool calls,
``function_call_output`` items as tool messages) and runs like a chat completion: the same
sampling checks, structured output (``text.format``) and tool calling (function tools,
``tool_choice``; through the server's chat hook). What it does not implement is refused with
a 400 naming the field: other tool types, ``previous_response_id`` (nothing is stored),
non-text input parts. Streaming sends the API's typed events, from ``response.created`` to
``response.completed`` (events.py); function calls come whole after the message.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from minisgl.extensions.responses.events import ResponseReply
from minisgl.extensions.responses.request import ResponsesRequest
from minisgl.server.chat_hooks import chat_hook
from minisgl.server.errors import bad_request
from minisgl.server.state import server_state
from minisgl.server.streaming import respond

router = APIRouter()


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    state = server_state(request)
    # The chat hook of default settings: tools, but no reasoning parser (the Responses API
    # has no field for the reasoning text).
    hook = chat_hook()
    try:
        chat = body.chat_request()
        params = chat.to_sampling_params(hook)
        messages = chat.message_dicts()  # earlier calls' arguments must be JSON: a 400 if not
    except ValueError as exc:
        raise bad_request(exc) from None
    tools = chat.chat_tools()
    reply = ResponseReply(body, state.served_model_name, lambda: hook.reply_parser(tools))
    group = state.submit([messages], params, chat.submit_base(), reply.id)
    return await respond(request, group, body.stream, reply.stream, reply.full)
