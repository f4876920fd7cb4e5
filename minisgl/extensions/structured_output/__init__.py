"""Structured output. Server side: tool calling and reasoning parsers for the chat routes
(chat.py, through the core's chat hook), and the --reasoning-parser flag."""

from minisgl.config import OptionGroup, register_options
from minisgl.extensions.structured_output.chat import ReasoningOptions, ToolsAndReasoning
from minisgl.server.chat_hooks import register_chat_hook

register_options(OptionGroup("reasoning", ReasoningOptions, server=True))
register_chat_hook(ToolsAndReasoning.for_server)
