"""Puts the tiny CPU recipes into the core wheel, from wherever this build finds them.

The recipes live in the repository's ``recipes/tiny``, outside this package. The sdist carries a copy
inside the package (``src/loongsage/core/recipes/tiny``, see pyproject.toml), where the wheel's
``packages`` picks it up; a wheel built straight from the repository takes them from ``recipes/tiny``.
A ``force-include`` of the repository's folder in pyproject.toml would fail for a wheel built from the
sdist, which has no ``../../recipes``.
"""

from __future__ import annotations

from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PACKAGED = "loongsage/core/recipes/tiny"


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        root = Path(self.root)
        if (root / "src" / PACKAGED).is_dir():  # an unpacked sdist
            return
        repository = root.parent.parent / "recipes" / "tiny"
        if not repository.is_dir():
            raise FileNotFoundError(f"no tiny recipes: neither {root / 'src' / PACKAGED} nor {repository}")
        build_data["force_include"][str(repository)] = PACKAGED
