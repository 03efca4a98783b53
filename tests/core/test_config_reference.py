"""The config reference (``loongsage reference``, docs/reference/config.md) matches the code.

The committed page is what the generator writes now, so a config field or a plugin param changed
without regenerating it fails here, naming the command that brings it up to date; and every key of
the run config has a type, a default and a meaning, so a new field without a comment fails too.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from loongsage.core import cli, reference

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "reference" / "config.md"


@pytest.fixture(scope="module")
def page(registry) -> str:
    return reference.config_reference(registry)


def test_the_committed_reference_is_what_the_generator_writes_now(page) -> None:
    where = PAGE.relative_to(REPO)
    assert PAGE.is_file(), f"{where} is missing: run `{reference.COMMAND}`"
    committed = PAGE.read_text()
    if committed != page:
        pairs = itertools.zip_longest(committed.splitlines(), page.splitlines())
        line = next(number for number, (old, new) in enumerate(pairs, 1) if old != new)
        pytest.fail(f"{where} is out of date with the code (from line {line}): run `{reference.COMMAND}`")


def test_every_config_key_has_a_type_a_default_and_a_meaning() -> None:
    keys = reference.config_keys()
    lacking = [
        f"{key.path} (no {what})" for key in keys for what in ("type", "default", "meaning") if not getattr(key, what)
    ]
    assert not lacking, (
        "config keys the reference cannot describe: "
        + ", ".join(lacking)
        + "; give each field a comment on its line (or the line above) in loongsage/core/config.py"
    )


def test_the_keys_are_those_a_recipe_writes() -> None:
    keys = {key.path: key for key in reference.config_keys()}
    assert keys["data_sources[].on_bad_row"].type == "'skip' | 'error'"
    assert keys["data_sources[].reader"].default == "required"
    assert keys["rollout.engine"].default == "{name: native}"
    assert keys["tracking.backends"].type == "list[str | spec]"
    assert keys["checkpoint.keep_last"].bounds == ">= 0 (0 = keep all)"
    assert keys["trainer.optimizer.betas"].bounds == "each in [0, 1)"
    # a section's defaults are its holder's: the critic's optimizer has its own learning rate
    assert keys["trainer.optimizer.lr"].default == "0.0001"
    assert keys["trainer.critic.optimizer.lr"].default == "0.001"
    assert keys["trainer.critic"].default == "null"


def test_the_file_reader_and_its_params_are_on_the_page(page) -> None:
    section = page.split("#### `file`", 1)[1].split("####", 1)[0]
    for row in ("| `path` | `str` | required |", "| `prompt_key` | `str` | `prompt` |", "| `label_key` |"):
        assert row in section


def test_a_meaning_is_read_from_the_comment_beside_above_or_the_string_below() -> None:
    @dataclasses.dataclass
    class Example:
        beside: int = 1  # the comment on its line
        # the comment lines
        # right above it
        above: int = 2
        below: int = 3
        """A string below it.

        Only its first paragraph."""
        bare: int = 4

    assert reference.field_meanings(Example) == {
        "beside": "the comment on its line",
        "above": "the comment lines right above it",
        "below": "A string below it.",
    }


def test_a_factory_functions_param_owns_the_comment_beside_it_when_alone_on_its_line() -> None:
    # fmt: off
    def factory(
        alone: int = 1,  # its own comment
        first: int = 2, second: int = 3,  # shared by two: neither's
    ) -> None: ...
    # fmt: on

    assert reference.param_meanings(factory) == {"alone": "its own comment"}


def test_the_launcher_writes_the_page_or_refuses_a_missing_folder_in_one_line(tmp_path, capsys, page) -> None:
    out = tmp_path / "config.md"
    assert cli.main(["reference", "--out", str(out)]) == 0
    assert out.read_text() == page
    capsys.readouterr()
    assert cli.main(["reference", "--out", str(tmp_path / "missing" / "config.md")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reference: --out" in err and "no folder" in err
