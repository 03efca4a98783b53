"""AgentFlow: agents reach the policy through a chat endpoint; the exact token trajectories are
rebuilt behind it (token-in, token-out).

``errors``      the API error every layer raises (status, type, one-line message)
``messages``    OpenAI-shaped messages and tools in one canonical form, and how two of them compare
``templates``   a Qwen3-style ChatML template with tools and reasoning
``parsers``     the ``qwen3`` chat parser (``<think>`` and Hermes-style ``<tool_call>``)
``rendering``   the chat template rendered by the gateway: whole prompts and appended turns
``tito``        which tokens a turn appends, or why it starts a new segment (pure)
``store``       per-session token lines, segments, budgets, export as core Trajectory records
``service``     one chat turn: lock, retry dedupe, budgets, generation, parsing, commit
``engines``     what the gateway generates with (the router's interface) and an in-process adapter
``openai_api``  OpenAI chat completions: request parsing, responses and stream chunks
``anthropic_api``  Anthropic Messages: request parsing, responses and stream events
``gateway``     the HTTP server (uvicorn on loopback), session binding by URL path
``serve``       ``loongsage serve``: sessions for agents outside a run, recorded as JSON lines
``blackbox``    the ``command`` agent (any OpenAI/Anthropic program, one per sample) and ``file_reward``
``program``     one program run: its supervisor, output capture, timeout backstops
``supervise``   the supervisor script: deadline, cleanup of the program's whole tree, in-jail relay
``jail``        the loopback-only network jail (bubblewrap) and the host end of the gateway relay
``plugin``      the entry point: the ``qwen3`` chat parser backend
"""
