"""DeepSeek-V4's chat format: rendering requests into prompts (encoding.py) and reading outputs back (output.py)."""

from jaxserve.text.chat.encoding import ChatOptions, ChatTemplateError, chat_options, render_prompt
from jaxserve.text.chat.output import ChatOutputParser, ParsedDelta, ToolCall, ToolCallDelta, parse_output

__all__ = [
    "ChatOptions",
    "ChatTemplateError",
    "chat_options",
    "render_prompt",
    "ChatOutputParser",
    "ParsedDelta",
    "ToolCall",
    "ToolCallDelta",
    "parse_output",
]
