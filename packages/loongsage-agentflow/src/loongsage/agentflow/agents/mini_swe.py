"""Agent ``mini_swe_agent``: the unmodified mini-swe-agent CLI (PyPI ``mini-swe-agent``, ``mini``).

mini is configured by its own files: its built-in ``mini.yaml`` (the prompts and the bash tool),
then an overlay written into the episode's home (``{workdir}/home/loongsage.yaml``) that sets the
non-interactive agent class, the step and cost limits, the local environment in the project
folder, the task, and the model: ``openai/<name>`` through litellm, at the session's URL
(``api_base``) with its key. The model is registered locally (``litellm_model_registry``), at a
nominal $1 per million tokens so that mini's cost accounting and ``cost_limit`` work.

What mini and litellm would fetch or ask by themselves is switched off through their environment:

- litellm's model cost map download (``LITELLM_LOCAL_MODEL_COST_MAP``) and every other catalog
  it fetches on its own (``LITELLM_OFFLINE_MODE``); Hugging Face tokenizer downloads (``HF_HUB_OFFLINE``),
- mini's first-run setup prompt (``MSWEA_CONFIGURED``) and start-up banner,
- mini's retries of a failed model call, with waits of up to a minute
  (``MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT=1``): the gateway's refusals are final.

Neither mini-swe-agent nor litellm (as a library) sends telemetry.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from loongsage.agentflow.agents.blackbox import CommandAgent
from loongsage.agentflow.agents.cli_agents import episode_home, merged, project_dir, prompt_text
from loongsage.core.schema import ranged

NOMINAL_COST_PER_TOKEN = 1e-6  # $1 per million tokens: cost_limit reads as millions of tokens
_SWITCHES = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_OFFLINE_MODE": "true",
    "HF_HUB_OFFLINE": "1",
    "MSWEA_CONFIGURED": "true",
    "MSWEA_SILENT_STARTUP": "1",
    "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
}


@dataclass
class MiniSweAgent(CommandAgent):
    """Runs ``mini`` per sample against its own gateway session, in the jail."""

    command: list[str] = field(default_factory=list, init=False)  # built from ``program``
    program: str | None = None  # the `mini` executable; null: the one beside this interpreter, else on PATH
    model_name: str = "openai/loongsage"  # litellm's name: provider openai = any OpenAI-compatible endpoint
    step_limit: int = ranged(20, ge=0, note="model calls of one episode; 0 = no limit")
    cost_limit: float = ranged(1.0, ge=0, note="dollars at a nominal $1 per million tokens; 0 = no limit")
    max_tokens: int | None = ranged(None, ge=1, note="new tokens of one model call; null: the gateway's default")
    temperature: float | None = None  # null: the gateway's default
    command_timeout_s: int = ranged(60, ge=1, note="one bash command of the agent")
    project_dir: str = "{workdir}/project"  # where the agent's commands run ({workdir} is filled in)
    base_config: str = "mini.yaml"  # the mini config the overlay goes on: a built-in name or a path
    config: dict[str, Any] = field(default_factory=dict)  # merged over the overlay (mini's keys: agent, model, ...)
    network: Literal["auto", "loopback_only", "host"] = "loopback_only"

    def __post_init__(self) -> None:
        program = self.program or _beside_interpreter("mini") or shutil.which("mini")
        if not program or not Path(program).is_file():
            raise ValueError(
                f"program={self.program!r}: mini-swe-agent's `mini` not found (pip install "
                "'loongsage-agentflow[agents]', or mini-swe-agent, in this environment)"
            )
        self.command = [str(program)]
        super().__post_init__()

    def prepare(self, workdir: Path, prompt: Any, argv: list[str], env: dict[str, str]) -> list[str]:
        home = episode_home(workdir, env)
        env["MSWEA_GLOBAL_CONFIG_DIR"] = str(home / ".config" / "mini-swe-agent")  # its .env: empty
        env.update(_SWITCHES)
        registry = home / "model_registry.json"
        registry.write_text(
            json.dumps(
                {
                    self.model_name: {
                        "litellm_provider": "openai",
                        "mode": "chat",
                        "supports_function_calling": True,
                        "input_cost_per_token": NOMINAL_COST_PER_TOKEN,
                        "output_cost_per_token": NOMINAL_COST_PER_TOKEN,
                    }
                }
            )
        )
        overlay = home / "loongsage.yaml"  # JSON is YAML
        overlay.write_text(
            json.dumps(
                self.overlay(
                    env["OPENAI_BASE_URL"],
                    env["OPENAI_API_KEY"],
                    prompt_text(prompt),
                    project_dir(self.project_dir, workdir),
                    registry,
                ),
                indent=1,
            )
        )
        return [*argv, "-c", self.base_config, "-c", str(overlay), "-o", str(home / "trajectory.json")]

    def overlay(self, base_url: str, api_key: str, task: str, project: Path, registry: Path) -> dict[str, Any]:
        """mini's configuration on top of ``base_config`` (``config`` merged over it)."""
        kwargs: dict[str, Any] = {"api_base": base_url, "api_key": api_key, "drop_params": True}
        if self.max_tokens is not None:
            kwargs["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        overlay = {
            "agent": {"agent_class": "default", "step_limit": self.step_limit, "cost_limit": self.cost_limit},
            "environment": {"environment_class": "local", "cwd": str(project), "timeout": self.command_timeout_s},
            "model": {
                "model_class": "litellm",
                "model_name": self.model_name,
                "model_kwargs": kwargs,
                "litellm_model_registry": str(registry),
            },
            "run": {"task": task},
        }
        return merged(overlay, self.config)

    def report(self, workdir: Path) -> dict[str, Any]:
        """How mini ended (``exit_status``: Submitted, LimitsExceeded, ...) and its model calls, from its trajectory."""
        try:
            info = json.loads((workdir / "home" / "trajectory.json").read_text()).get("info", {})
        except (OSError, ValueError):
            return {"mini": None}
        stats = info.get("model_stats") or {}
        return {
            "mini": {
                "exit_status": info.get("exit_status"),
                "api_calls": stats.get("api_calls"),
                "cost": stats.get("instance_cost"),
            }
        }


def _beside_interpreter(name: str) -> str | None:
    path = Path(sys.executable).parent / name
    return str(path) if path.is_file() else None
