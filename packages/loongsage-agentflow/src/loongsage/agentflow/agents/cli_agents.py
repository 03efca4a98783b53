"""What the agents running an unmodified third-party CLI share (``mini_swe_agent``, ``opencode``).

Each episode's working directory (the ``command`` agent's, removed afterwards) is laid out as::

    {workdir}/prompt.txt     the task (written by the command agent)
    {workdir}/home/          HOME, the XDG folders and TMPDIR: the program's configuration, caches,
                             state and temporary files
    {workdir}/project/       the program's own working directory (``project_dir``), where its tools run

so nothing of the driver's home (credentials, the user's own agent configuration, earlier
sessions) reaches the program, and concurrent episodes share no state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# environment variables of the program that name folders: all in the episode's home (the jail
# isolates the network only, so without these the programs would write into the driver's)
_FOLDERS = {
    "XDG_CONFIG_HOME": ".config",
    "XDG_DATA_HOME": ".local/share",
    "XDG_STATE_HOME": ".local/state",
    "XDG_CACHE_HOME": ".cache",
    "TMPDIR": "tmp",
}


def episode_home(workdir: Path, env: dict[str, str]) -> Path:
    """Create ``{workdir}/home`` with its XDG and temporary folders and point ``env`` at them."""
    home = workdir / "home"
    env["HOME"] = str(home)
    for name, sub in _FOLDERS.items():
        (home / sub).mkdir(parents=True, exist_ok=True)
        env[name] = str(home / sub)
    return home


def project_dir(template: str, workdir: Path) -> Path:
    """The program's working directory: ``template`` with ``{workdir}`` filled in, created."""
    path = Path(template.replace("{workdir}", str(workdir)))
    path.mkdir(parents=True, exist_ok=True)
    return path


def prompt_text(prompt: Any) -> str:
    """The task as one text: a plain prompt as it is; chat messages by their text, one after the other."""
    if isinstance(prompt, str):
        return prompt
    parts = []
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else message
        if isinstance(content, list):  # content parts
            content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(content if isinstance(content, str) else json.dumps(content, ensure_ascii=False))
    return "\n\n".join(p for p in parts if p)


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base`` recursively (mappings merged, anything else replaced)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
