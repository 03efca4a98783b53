"""Fixtures shared by the plugin-manager and contract tests."""

from __future__ import annotations

import itertools
import sys
import textwrap

import pytest

from loongsage.core.plugins import load_registry

_counter = itertools.count()


@pytest.fixture(scope="module")
def registry():
    return load_registry()


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """Write a module of hookimpls under a fresh name and make it importable; returns its name."""

    def write(body: str) -> str:
        name = f"loongsage_test_plugin_{next(_counter)}"
        header = (
            "from dataclasses import dataclass\nfrom typing import ClassVar\n"
            "from loongsage.core.hookspecs import hookimpl\n"
        )
        (tmp_path / f"{name}.py").write_text(header + textwrap.dedent(body))
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, name, raising=False)
        return name

    return write
