"""Text in and out: the tokenizer, DeepSeek-V4's chat encoding and output parsing (chat/), and one request's text as
it streams, with stop strings (generation.py)."""
