"""The gateway at scale over simulated engines: the real HTTP gateway and engine router in front of
:class:`~loongsage.core.sim.text.TextSimEngine` engines in real time, driven by scripted agents
in a process of their own through the official ``openai`` client.

``fleet``  the scripted agents: many sessions at once, several turns each, a tool's pause between
           turns (``python -m loongsage.agentflow.sim.fleet``: one JSON job a line in, one JSON
           result a line out)
``scale``  one measured run: the gateway over simulated engines, the fleet against it, and what
           it cost (latency the gateway adds per turn, memory per session, CPU per turn, the
           gateway's tables after the sessions closed); the same turns sent straight to the router
           as the peer
"""
