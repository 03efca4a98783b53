"""The chat gateway: OpenAI- and Anthropic-compatible endpoints on loopback, one URL prefix per
session, in front of the policy's engines.

``service``        one chat turn, protocol-independent: session lock, retry answers, budgets, engine
                   call, parsing, commit
``engines``        what the gateway generates with: the engine router's interface, and
                   ``DirectEngine`` for one engine of this process
``openai_api``     OpenAI chat completions: request -> ``ChatRequest``, answers and stream chunks
``anthropic_api``  Anthropic Messages: request -> ``ChatRequest``, answers and stream events
``responses_api``  OpenAI Responses: input items -> ``ChatRequest``, the response object and its events
``server``         the HTTP server (uvicorn on loopback): routes, sessions bound by URL path and key
``middlewares``    ``request_log`` and ``rate_limit`` (hook ``loongsage_gateway_middlewares``)
``run_service``    the ``gateway`` run service: the gateway on the run's engine router
``serve``          ``loongsage serve``: sessions for agents outside a run, each recorded as JSON lines
``local``          a gateway over an engine of this process, and held-out evaluation through it (no Ray)
"""
