"""Plugins import from the core only what :data:`loongsage.core.public.PLUGIN_SURFACE` publishes.

Every module of every package beside the core is read (not imported); each import of a core module
outside the surface, and each import of an underscore-prefixed name from the core, is named by
file, line and module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from loongsage.core.public import PLUGIN_SURFACE, allowed

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "packages" / "loongsage-core" / "src"
PLUGIN_MODULES = sorted(
    p
    for package in (REPO / "packages").iterdir()
    if package.is_dir() and package.name != "loongsage-core"
    for p in package.rglob("*.py")
    if "__pycache__" not in p.parts
)


def core_imports(tree: ast.AST) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` of every import of the core in ``tree`` (``name`` None: the whole module)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.startswith("loongsage.core")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "loongsage":
                found += [(node.lineno, "loongsage.core", None) for a in node.names if a.name == "core"]
            elif node.module.startswith("loongsage.core"):
                found += [(node.lineno, node.module, None if a.name == "*" else a.name) for a in node.names]
    return found


def violations(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for each import of ``source`` that reaches past the surface."""
    out = []
    for line, module, name in core_imports(ast.parse(source)):
        if name is None:
            if not allowed(module):
                out.append((line, module))
        elif name.startswith("_"):
            out.append((line, f"{module}.{name} (a private name)"))
        elif not (allowed(f"{module}.{name}") or allowed(module, name)):  # a submodule, or a name of the module
            out.append((line, f"{module}.{name}"))
    return out


def test_plugins_import_only_the_published_core():
    assert PLUGIN_MODULES, "no plugin package found under packages/"
    problems = [
        f"{path.relative_to(REPO)}:{line}: {what} is not in loongsage.core.public.PLUGIN_SURFACE"
        for path in PLUGIN_MODULES
        for line, what in violations(path.read_text())
    ]
    assert not problems, "plugins import core modules outside the plugin surface:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("from loongsage.core.types import Trajectory", False),
        ("from loongsage.core.model_math.dtypes import DTYPES", False),
        ("from loongsage.core.tinytask import warmstart", False),
        ("from loongsage.core.schema import ranged", False),
        ("def f():\n    from loongsage.core.rollout.seeds import request_seed", False),
        ("import loongsage.core.contracts", False),
        ("from loongsage.core.schema import Schema", True),
        ("import loongsage.core.schema", True),
        ("from loongsage.core.controller import Controller", True),
        ("from loongsage.core import workers", True),
        ("from loongsage.core.trainer.torch_trainer import _private", True),
        ("from loongsage.core.model_math import _private", True),
        ("from loongsage.core.model_math._private import name", True),
        ("def f():\n    import loongsage.core.loss", True),
    ],
)
def test_the_check_tells_public_from_private(source, flagged):
    assert bool(violations(source)) == flagged


@pytest.mark.parametrize("module", sorted(m for m, names in PLUGIN_SURFACE.items() if names))
def test_each_published_name_is_in_its_module(module):
    path = CORE / Path(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    tree = ast.parse(path.read_text())
    bound = {
        t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)
    }
    bound |= {
        node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    bound |= {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names}
    assert PLUGIN_SURFACE[module] <= bound, f"{module} has no {sorted(PLUGIN_SURFACE[module] - bound)}"
