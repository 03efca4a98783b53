"""Agent ``opencode``: the unmodified OpenCode CLI (npm ``opencode-ai``), one ``opencode run`` per episode.

OpenCode is pointed at the episode's gateway session by its own configuration, written into the
episode's home (``{workdir}/home/.config/opencode/opencode.json``): one OpenAI-compatible provider
(``@ai-sdk/openai-compatible``, bundled in the binary) whose ``baseURL`` is the session's URL,
with the model described locally (context and output limits), and nothing else enabled. Whatever
OpenCode would fetch by itself is switched off, since in the loopback-only jail it can only fail,
and some of it only after retries:

- the models.dev catalog (``OPENCODE_DISABLE_MODELS_FETCH``; the provider lists its model itself),
- auto-update and sharing (``autoupdate: false``, ``share: disabled`` and their environment switches),
- LSP server downloads, default plugins, formatters, MCP servers (``lsp: false``, ...),
- the npm install of ``@opencode-ai/plugin`` into its configuration folder: done ahead of time by
  :mod:`loongsage.agentflow.opencode_install`, linked into each episode,
- the session title, a second model call (``--title``),
- the tools that fetch from the web (``webfetch``, ``websearch``, ``codesearch``).

OpenCode keeps no telemetry of its own; OpenTelemetry export happens only when configured
(``OTEL_*`` variables, which the program does not inherit).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from loongsage.agentflow import opencode_install
from loongsage.agentflow.agents.blackbox import CommandAgent
from loongsage.agentflow.agents.cli_agents import episode_home, merged, project_dir, prompt_text
from loongsage.core.schema import ranged

PROVIDER = "loongsage"
_WEB_TOOLS = ("webfetch", "websearch", "codesearch")
_ARG_MAX = 100_000  # one argv string is limited to 128 KiB by the kernel
# the environment switches of OpenCode 1.18 for everything it would fetch or read by itself
_SWITCHES = {
    "OPENCODE_DISABLE_AUTOUPDATE": "true",
    "OPENCODE_DISABLE_MODELS_FETCH": "true",
    "OPENCODE_DISABLE_SHARE": "true",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "true",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "true",
    "OPENCODE_DISABLE_EXTERNAL_SKILLS": "true",
    "OPENCODE_DISABLE_CLAUDE_CODE": "true",  # ~/.claude prompts and skills
    "OPENCODE_DISABLE_PROJECT_CONFIG": "true",  # only the configuration written here applies
}


@dataclass
class OpenCodeAgent(CommandAgent):
    """Runs ``opencode run <task>`` per sample against its own gateway session, in the jail."""

    command: list[str] = field(default_factory=list, init=False)  # built from the install
    # npm prefix of `python -m loongsage.agentflow.opencode_install`; null: $LOONGSAGE_CACHE/agents/opencode-<version>
    install_dir: str | None = None
    version: str = opencode_install.VERSION
    model_name: str = "loongsage"  # the model id OpenCode sends
    max_tokens: int = ranged(1024, ge=1, note="new tokens of one request (the model's output limit)")
    context_tokens: int = ranged(32768, ge=1, note="the model's context as OpenCode sees it (compaction)")
    max_steps: int | None = ranged(None, ge=1, note="model calls of one run; null: OpenCode's own limit")
    temperature: float | None = None  # null: the provider's default
    tools: list[str] | None = None  # only these tools; null: OpenCode's own set (less the web tools, always off)
    system_prompt: str | None = None  # replaces OpenCode's system prompt (its environment block stays)
    project_dir: str = "{workdir}/project"  # where OpenCode works ({workdir} is filled in)
    log_level: Literal["DEBUG", "INFO", "WARN", "ERROR"] = "INFO"  # OpenCode's log, printed to stderr
    config: dict[str, Any] = field(default_factory=dict)  # merged over the generated opencode.json
    network: Literal["auto", "loopback_only", "host"] = "loopback_only"

    def __post_init__(self) -> None:
        folder = Path(self.install_dir) if self.install_dir else opencode_install.default_dir(self.version)
        problem = opencode_install.problem(folder, self.version)
        if problem:
            raise ValueError(f"install_dir={str(folder)!r}: {problem}")
        self.binary = opencode_install.binary(folder)
        self.config_deps = opencode_install.config_dependencies(folder)
        self.command = [str(self.binary), "run"]
        super().__post_init__()

    def prepare(self, workdir: Path, prompt: Any, argv: list[str], env: dict[str, str]) -> list[str]:
        home = episode_home(workdir, env)
        project = project_dir(self.project_dir, workdir)
        config_dir = home / ".config" / "opencode"
        config_dir.mkdir(parents=True, exist_ok=True)
        for name in ("package.json", "package-lock.json"):  # what OpenCode compares before installing
            shutil.copyfile(self.config_deps / name, config_dir / name)
        (config_dir / "node_modules").symlink_to(self.config_deps / "node_modules")
        config = self.opencode_config(env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"])
        (config_dir / "opencode.json").write_text(json.dumps(config, indent=1))
        env.update(_SWITCHES)
        text = prompt_text(prompt)
        if len(text.encode()) > _ARG_MAX:
            text = f"Your task is in the file {env['LOONGSAGE_PROMPT_FILE']}."
        return [
            *argv,
            "--dir",
            str(project),
            "--title",
            workdir.name,
            "--model",
            f"{PROVIDER}/{self.model_name}",
            "--print-logs",
            "--log-level",
            self.log_level,
            "--",
            text,
        ]

    def opencode_config(self, base_url: str, api_key: str) -> dict[str, Any]:
        """The whole ``opencode.json`` of an episode (``config`` merged over it)."""
        model = f"{PROVIDER}/{self.model_name}"
        build: dict[str, Any] = {}
        if self.system_prompt is not None:
            build["prompt"] = self.system_prompt
        if self.max_steps is not None:
            build["steps"] = self.max_steps
        if self.temperature is not None:
            build["temperature"] = self.temperature
        tools: dict[str, bool] = {"*": False, **{t: True for t in self.tools}} if self.tools is not None else {}
        tools.update({t: False for t in _WEB_TOOLS})
        config = {
            "autoupdate": False,
            "share": "disabled",
            "model": model,
            "small_model": model,
            "enabled_providers": [PROVIDER],
            "provider": {
                PROVIDER: {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "LoongSage gateway",
                    "options": {"baseURL": base_url, "apiKey": api_key},
                    "models": {
                        self.model_name: {
                            "name": self.model_name,
                            "tool_call": True,
                            "limit": {"context": self.context_tokens, "output": self.max_tokens},
                        }
                    },
                }
            },
            "lsp": False,
            "formatter": False,
            "mcp": {},
            "plugin": [],
            "instructions": [],
            "tools": tools,
            "agent": {"build": build} if build else {},
        }
        return merged(config, self.config)
