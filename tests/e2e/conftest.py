"""Launcher runs that several end-to-end tests assert on, each made once per pytest run.

A run through the launcher costs its actors' start (processes importing torch, the model loaded),
tens of seconds on two cores, against a fraction of a second per step of the tiny model; so tests
that need the same run share it instead of making it again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def launched(ray_session, tmp_path_factory):
    """``launched(argv, ...)``: the folder (it sees the repository's recipes) where ``loongsage
    <argv>`` ran for each argument list in turn (a run, then its resume), in this process, on the
    session's Ray. The same lists, word for word, run there once, whichever test asks first: a test
    shares only a run it would have made itself."""
    from loongsage.core.cli import main

    done: dict[tuple[tuple[str, ...], ...], Path] = {}

    def launch(*commands: list[str]) -> Path:
        key = tuple(tuple(argv) for argv in commands)
        if key not in done:
            where = tmp_path_factory.mktemp("launched")
            (where / "recipes").symlink_to(REPO / "recipes")
            with pytest.MonkeyPatch.context() as patch:
                patch.chdir(where)
                for argv in key:
                    assert main(list(argv)) == 0, argv
            done[key] = where
        return done[key]

    return launch
