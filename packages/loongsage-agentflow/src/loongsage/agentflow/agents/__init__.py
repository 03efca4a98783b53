"""The agents AgentFlow ships: each reaches the policy only through a session of the run's gateway
service and trains on that session's token trajectories.

``chat_agent``  ``chat``: one chat completion per group; how an agent finds the gateway service
``tool_agent``  ``tool_agent``: multi-turn tool calling with the official ``openai`` client
``tools``       the tools ``tool_agent`` runs for the model (calculator, read_file), their schemas
``blackbox``    ``command``: any OpenAI/Anthropic program, one per sample, run as a black box;
                reward ``file_reward``
``cli_agents``  what the agents running a third-party CLI share: the episode's home and project folders
``mini_swe``    ``mini_swe_agent``: the unmodified mini-swe-agent CLI
``opencode``    ``opencode``: the unmodified OpenCode CLI (set up by ``opencode_install``)
"""
