"""What the project's own optional packages provide, for the miss of a name they register.

The core ships recipes (and its docs name entries) that need another package; without it the registry
knows nothing of the name and would only list what is installed. :data:`PROJECT_PACKAGES` lets the
miss name the package to install. ``tests/core/test_project_packages.py`` holds the table to what the
installed packages register, both ways, so it cannot fall behind them.
"""

from __future__ import annotations

# package -> category -> the names it registers there
_PROVIDED: dict[str, dict[str, str]] = {
    "loongsage-algos": {
        "advantage": "gae grpo reinforce_pp rloo",
        "correction": "decoupled is m2po opsm",
        "data_filter": "dynamic_sampling length overlong status",
        "kl": "full_vocab_kl jsd k1 k2 k3 low_var_kl topk_jsd topk_kl",
        "policy_loss": "cispo gspo nll ppo_clip",
        "reward": "exact_match format math overlong_shaping",
    },
    "loongsage-agentflow": {
        "agent": "chat command mini_swe_agent opencode tool_agent",
        "chat_parser": "qwen3",
        "data_source": "tool_calc",
        "gateway_middleware": "rate_limit request_log",
        "model_builder": "tiny_tool_calc",
        "reward": "file_reward tool_calc",
        "service": "gateway",
    },
    "loongsage-sandbox": {
        "data_source": "code_fn",
        "model_builder": "tiny_code_fn",
        "reward": "code_tests",
        "sandbox": "docker local",
        "service": "sandboxes",
    },
    "loongsage-megatron": {"teacher": "megatron", "trainer": "megatron"},
    "loongsage-sglang": {"engine": "sglang"},
    "loongsage-sync": {"transport": "broadcast ipc"},
}

# (category, name) -> the package that provides it
PROJECT_PACKAGES: dict[tuple[str, str], str] = {
    (category, name): package
    for package, categories in _PROVIDED.items()
    for category, names in categories.items()
    for name in names.split()
}
