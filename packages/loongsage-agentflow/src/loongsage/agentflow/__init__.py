"""AgentFlow: agents reach the policy through a chat endpoint; the exact token trajectories are
rebuilt behind it (token-in, token-out).

One subpackage per subsystem; each imports only subpackages listed before it:

``chat``          the conversation in canonical form: messages and tools, the one API error, typed
                  reads of a request's fields, the Qwen3-style chat template and the ``qwen3`` parser
``trajectories``  token-in, token-out: the template rendered to tokens, which tokens a turn appends
                  (or why it starts a new segment), each session's token lines and their export
``gateway``       the chat endpoint: one turn (``service``), the OpenAI, Anthropic and Responses
                  front ends, the HTTP server, middlewares, the ``gateway`` run service,
                  ``loongsage serve``, a gateway over an engine of this process
``programs``      one agent program run: its supervisor, the loopback-only network jail, the audit
                  of the connections it tried
``agents``        the agents that reach the policy through the gateway: ``chat``, ``tool_agent``
                  (and its tools), ``command``, ``mini_swe_agent``, ``opencode``
``tasks``         the calculator task: data source and reward ``tool_calc``, its warm start
``sim``           the gateway at scale: scripted agents in thousands against the real gateway over
                  simulated engines, and what a run of them cost

``plugin``            the entry point (group ``loongsage``): registers what the subpackages provide
``opencode_install``  the set-up step ``python -m loongsage.agentflow.opencode_install``: the pinned
                      OpenCode CLI that the ``opencode`` agent runs
"""
