"""The conversation in canonical form, whatever protocol it came in: what the token side, the
gateway's front ends and the tasks all speak.

``errors``     the one API error every layer raises (HTTP status, type, one-line message)
``fields``     a request body read as JSON (lone surrogates as U+FFFD) and typed reads of its fields
``messages``   messages and tools in one canonical form, and how two conversations compare
``templates``  a Qwen3-style ChatML template with tools and reasoning (append-only)
``parsers``    the ``qwen3`` chat parser: a completion split into content, reasoning and tool calls
"""
