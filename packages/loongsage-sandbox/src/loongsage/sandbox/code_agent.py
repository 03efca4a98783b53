"""A minimal coding agent, run by the ``command`` agent as a black box: ``python -m loongsage.sandbox.code_agent``.

It asks the model the task (``LOONGSAGE_PROMPT``) once through the OpenAI chat-completions endpoint
it was given (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``), with the run's sampling when the runner
tells it (``LOONGSAGE_SAMPLING``), and writes the code of the answer (its last fenced block, or all
of it) to ``solution.py`` in its working directory. With the command agent's ``sandbox: true`` that
directory is the episode's sandbox, where the ``code_tests`` reward (``solution_file: solution.py``)
then runs the task's tests. Standard library only: any program that speaks the protocol will do.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request

from loongsage.sandbox.code_text import extract_code


def messages_of(prompt: str) -> list[dict]:
    """The runner passes a chat prompt as its JSON messages, a text prompt as itself."""
    try:
        messages = json.loads(prompt)
    except ValueError:
        messages = None
    if isinstance(messages, list) and all(isinstance(m, dict) and "role" in m for m in messages):
        return messages
    return [{"role": "user", "content": prompt}]


def ask(messages: list[dict], sampling: dict) -> str:
    body = {
        "model": "policy",
        "messages": messages,
        **{k: v for k, v in sampling.items() if k in ("temperature", "top_p", "max_tokens")},
    }
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', '')}"},
    )
    # the gateway is on loopback: no proxy may carry the request
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=300) as response:
        return json.load(response)["choices"][0]["message"]["content"] or ""


def main() -> int:
    prompt = os.environ.get("LOONGSAGE_PROMPT")
    if prompt is None:
        print("code_agent: LOONGSAGE_PROMPT is not set (run me through the command agent)", file=sys.stderr)
        return 2
    sampling = json.loads(os.environ.get("LOONGSAGE_SAMPLING") or "{}")
    code = extract_code(ask(messages_of(prompt), sampling))
    with open("solution.py", "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(code if code.endswith("\n") else code + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
