"""Every ``loongsage ...`` command line in README.md and docs/*.md is one the launcher takes.

A command in a code block or an inline code span is parsed by the launcher's own argument parser,
and a recipe it names must exist (a ``train`` command's overrides must also validate), so a
renamed command, recipe or key fails here instead of in a reader's terminal.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from loongsage.core import cli
from loongsage.core.compose import compose
from loongsage.core.config import find_recipe, load_config

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PROGRAM = re.compile(r"^(?:uv run )?loongsage(?= )")
# a usage line, not a command: <placeholder>, [optional ...], [--option]
PLACEHOLDER = re.compile(r"<[^>]+>|\[[^\]]*\.\.\.\]|\[--")


def _segments(text: str) -> list[str]:
    """The shell commands of one line: split at ``&&``, a ``#`` comment and a description column
    (two or more spaces, as in a usage listing) cut off."""
    out = []
    for part in text.split("&&"):
        part = re.split(r"\s{2,}|\s#", part.strip())[0].strip()
        if part:
            out.append(part)
    return out


def commands() -> list[tuple[str, str]]:
    """``(where, command)`` for every ``loongsage`` command line of the docs."""
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        fenced, held = False, ""
        for number, line in enumerate(lines, 1):
            if line.lstrip().startswith("```"):
                fenced, held = not fenced, ""
                continue
            where = f"{doc.relative_to(REPO)}:{number}"
            if fenced:
                line = held + line.lstrip() if held else line
                if line.rstrip().endswith("\\"):  # a command continued on the next line
                    held = line.rstrip()[:-1].rstrip() + " "
                    continue
                held = ""
                texts = [line]
            else:
                texts = re.findall(r"`([^`]+)`", line)
            for text in texts:
                for segment in _segments(text):
                    if PROGRAM.match(segment):
                        found.append((where, segment))
    return found


COMMANDS = commands()


def test_the_docs_hold_commands() -> None:
    assert len(COMMANDS) >= 10 and any("train tiny/grpo_arith_cpu" in c for _, c in COMMANDS)


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[f"{w} {c}" for w, c in COMMANDS])
def test_a_documented_command_is_one_the_launcher_takes(where, command, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    argv = shlex.split(PROGRAM.sub("", command).strip())
    if PLACEHOLDER.search(command):  # a usage line: its command must exist
        assert argv[0] in cli.COMMANDS, f"{where}: {command!r}: no command {argv[0]!r}"
        return
    if argv[0].endswith(":"):  # the launcher's output quoted in prose (`loongsage serve: stopped ...`)
        return
    if len(argv) == 1 and argv[0] in cli.COMMANDS:  # the command named in prose (`loongsage report` reads ...)
        return
    try:
        args = cli.parse(argv)
    except cli.UsageError as exc:
        pytest.fail(f"{where}: {command!r} is refused by the launcher: {exc}")
    if args.command == "train":
        assert args.recipe is not None, f"{where}: {command!r} names no recipe"
        if args.recipe.endswith(".yaml") and not Path(args.recipe).is_file():
            return  # a reader's own recipe file (my_project/my_recipe.yaml), not one of the repository's
        load_config(args.recipe, args.overrides, config_dir=args.config_dir)  # the recipe exists and validates
    elif args.command == "serve" and not args.target.startswith("runs/"):  # runs/...: a run's output folder
        compose(find_recipe(args.target, args.config_dir), args.overrides)


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_checkpoint_folders_are_named_as_written(doc) -> None:
    """Checkpoints are ``checkpoints/step_000050/``: the step, six digits."""
    for name in re.findall(r"checkpoints/(step_[^/\s`]*)", doc.read_text()):
        assert re.fullmatch(r"step_\d{6}", name), f"{doc.name}: checkpoints/{name}: a checkpoint is step_<6 digits>"
