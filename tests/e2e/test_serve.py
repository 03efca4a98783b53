"""``loongsage serve``: a recipe's policy served to agents outside a training run, end to end.

The real launcher serves ``tiny/grpo_arith_cpu`` (its engine as a Ray actor, the gateway added
since the recipe has none) in a process group of its own, as from a shell. The official ``openai``
client talks to the printed session, the official ``anthropic`` client to a second session opened
with the printed serve key; each answer is checked against the arithmetic. Ctrl-C (SIGINT to the
process group, as a terminal sends it) ends it with exit code 0 and one line, and the record holds
both sessions' turns with their tokens, loss masks and log-probs, and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest

from loongsage.core.cli import main
from tests._procs import TAG_VARIABLE, lasting

LAUNCHER = Path(sys.executable).parent / "loongsage"
pytestmark = pytest.mark.timeout(900)  # the first test to need the warm start builds it (minutes)


def _lines(proc: subprocess.Popen) -> queue.Queue:
    """The launcher's stdout, line by line, as it comes (None at its end)."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _until(lines: queue.Queue, prefix: str, log: Path, timeout: float = 600.0) -> list[str]:
    """Lines up to and including the first one starting with ``prefix``."""
    seen, deadline = [], time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(
                f"no {prefix!r} line within {timeout:g} s: {seen}\n{log.read_text()[-3000:]}"
            ) from None
        assert line is not None, f"the launcher ended before {prefix!r}: {seen}\n{log.read_text()[-3000:]}"
        seen.append(line)
        if line.startswith(prefix):
            return seen


def _exports(line: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in line.removeprefix("export ").split())


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_serve_answers_openai_and_anthropic_clients_and_records_their_sessions(model_cache, tmp_path, tag):
    record, log = tmp_path / "served", tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, as from a shell
    env[TAG_VARIABLE] = tag
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [str(LAUNCHER), "serve", "tiny/grpo_arith_cpu", "--record", str(record)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
    try:
        lines = _lines(proc)
        printed = _until(lines, "one session per agent run", log)
        first = {
            **_exports(next(line for line in printed if line.startswith("export OPENAI_"))),
            **_exports(next(line for line in printed if line.startswith("export ANTHROPIC_"))),
        }
        assert first["OPENAI_API_KEY"] == first["ANTHROPIC_API_KEY"]  # one session, one key
        assert first["OPENAI_BASE_URL"].startswith("http://127.0.0.1:")  # loopback by default

        # the printed session, through the OpenAI client: two turns of one conversation
        chat = openai.OpenAI(base_url=first["OPENAI_BASE_URL"], api_key=first["OPENAI_API_KEY"], max_retries=0)
        question = [{"role": "user", "content": "12+34="}]
        reply = chat.chat.completions.create(model="loongsage", messages=question, temperature=0, max_tokens=5)
        assert reply.choices[0].message.content == "64"  # the task answers least-significant digit first
        followup = [*question, {"role": "assistant", "content": "64"}, {"role": "user", "content": "41+23="}]
        chat.chat.completions.create(model="loongsage", messages=followup, temperature=0, max_tokens=5)

        # a second session (its own key) from the serve key, through the Anthropic client
        opener = printed[-1].split("curl -s -X POST ", 1)[1]
        url, serve_key = opener.split(" -H 'Authorization: Bearer ")
        request = urllib.request.Request(url, method="POST", headers={"Authorization": f"Bearer {serve_key[:-1]}"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            second = json.loads(answer.read())
        assert second["api_key"] != first["OPENAI_API_KEY"]
        messages = anthropic.Anthropic(base_url=second["anthropic_base_url"], api_key=second["api_key"], max_retries=0)
        # this client's Messages.create takes no temperature argument; the API's field still works
        message = messages.messages.create(
            model="loongsage",
            max_tokens=5,
            extra_body={"temperature": 0.0},
            messages=[{"role": "user", "content": "21+43="}],
        )
        assert [block.text for block in message.content] == ["46"]
        # a session's key opens that session only
        intruder = openai.OpenAI(base_url=first["OPENAI_BASE_URL"], api_key=second["api_key"], max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            intruder.chat.completions.create(model="loongsage", messages=question, max_tokens=1)

        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        rest = []
        while (line := lines.get(timeout=10)) is not None:
            rest.append(line)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert len(rest) == 1 and rest[0].startswith("loongsage serve: stopped by SIGINT; recorded 2 sessions"), rest

    files = sorted(record.glob("*.jsonl"))
    assert [f.stem for f in files] == [first["OPENAI_BASE_URL"].split("/")[-3], second["session"]]
    (by_openai,), (by_anthropic,) = _rows(files[0]), _rows(files[1])
    for row, turns in ((by_openai, 2), (by_anthropic, 1)):
        assert row["finished"] and row["status"] == "ok"
        assert len(row["turns"]) == turns
        assert row["prompt_ids"] and row["response_ids"]
        n = len(row["response_ids"])
        assert len(row["loss_mask"]) == len(row["rollout_logprobs"]) == len(row["versions"]) == n
        # sampled tokens are the masked-in ones, with their log-probs; the second turn's prompt is not
        sampled = [i for i, m in enumerate(row["loss_mask"]) if m]
        assert sampled and all(row["rollout_logprobs"][i] <= 0 for i in sampled)
        assert sum(row["loss_mask"]) < n if turns > 1 else sum(row["loss_mask"]) == n
    assert [m["content"] for m in by_openai["messages"]][:4] == ["12+34=", "64", "41+23=", by_openai["response_text"]]
    assert [m["content"] for m in by_anthropic["messages"]] == ["21+43=", "46"]

    assert not lasting(tag)  # Ray's processes go with the launcher


def test_serve_refuses_what_it_cannot_serve_in_one_line(tmp_path, capsys):
    assert main(["serve", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"loongsage: error: serve: {str(tmp_path)!r} is a folder without config.json; pass a recipe (e.g. "
        "tiny/grpo_arith_cpu) or an HF model folder"
    )
    assert main(["serve", "tiny/grpo_arith_cpu", "--port", "70000"]) == 2
    assert capsys.readouterr().err.strip() == "loongsage: error: --port 70000: must be in 0..65535 (0: a free port)"
