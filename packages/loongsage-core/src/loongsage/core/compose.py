"""Composing a recipe with command-line overrides (Hydra), and one line naming the cause when it fails.

Entries that name a plugin are ``{name, params}`` specs. Hydra merges a later layer into an earlier
one key by key: an override into the recipe, a recipe into the recipe its ``defaults`` list. Done to
a spec, that would carry one plugin's ``params`` over to another, which rarely takes them; so a
layer that gives a spec another ``name`` replaces the entry here (the earlier params dropped):
``rollout.scheduler={name: sync}`` over ``{name: no_window, params: {max_staleness: 1}}`` is
``{name: sync}``. The same name keeps merging: ``rollout.scheduler={params: {max_staleness: 2}}``
changes that one param.

A recipe's ``defaults`` may name any recipe the launcher finds (``tiny/grpo_arith_cpu``), from any
folder: the recipe search path (``--config-dir``, ``./recipes``, the shipped recipes) is Hydra's
search path after the recipe's own folder, and a recipe named with its folder is merged at the root
(Hydra would put it under a key named after the folder, as a config group).

``model.path`` and ``model.builder`` are two sources of one model: the later layer that sets one
of them drops the other (``model.path=/my/model`` on the command line over a recipe's builder runs
the user's model), and one layer (a recipe file, or the command line) that sets both is refused.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from loongsage.core.types import ConfigError

# Short forms accepted on the command line: `colocate=false`, `resume=true`.
OVERRIDE_ALIASES = {"colocate": "placement.colocate", "resume": "checkpoint.resume"}
SPEC_KEYS = {"name", "params"}


def _expand_aliases(overrides: list[str]) -> list[str]:
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        bare = key.lstrip("+~")
        prefix = key[: len(key) - len(bare)]
        if not sep and not prefix.startswith("~"):
            raise ConfigError(
                f"override {item!r}: no '='; write key=value (e.g. run.total_steps=5), or ~key to delete a key"
            )
        if sep and bare in OVERRIDE_ALIASES:
            item = f"{prefix}{OVERRIDE_ALIASES[bare]}={value}"
        out.append(f"++{item}" if sep and not prefix else item)  # set or add; validate() names unknown keys
    return out


def _compose(recipe: Path, overrides: list[str], search_dirs: list[Path]) -> dict[str, Any]:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    searchpath = _searchpath_override(recipe, search_dirs)
    with initialize_config_dir(config_dir=str(recipe.parent), version_base=None):
        config_name = _layered(recipe, _primary(recipe), search_dirs, searchpath)

        def run(items: list[str]) -> Any:
            return hydra_compose(config_name=config_name, overrides=[*searchpath, *items])

        cfg = run(_replacing_overrides(overrides, run))
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


# ----------------------------------------------------------------------------- recipes from other folders
def _searchpath_override(recipe: Path, search_dirs: list[Path]) -> list[str]:
    """``hydra.searchpath=[...]`` with the recipe folders besides the recipe's own (searched first by Hydra)."""
    dirs = [d for d in dict.fromkeys(Path(d).resolve() for d in search_dirs) if d.is_dir() and d != recipe.parent]
    if not dirs:
        return []

    def quoted(text: str) -> str:
        return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"

    return [f"hydra.searchpath=[{','.join(quoted(f'file://{d}') for d in dirs)}]"]


def _primary(recipe: Path) -> str:
    """The config Hydra composes for ``recipe``: its own name, or, where its ``defaults`` name a recipe
    with its folder (``tiny/grpo_arith_cpu``), a copy kept in Hydra's ConfigStore in which those
    entries are merged at the root (``tiny/grpo_arith_cpu@_here_``): a recipe is a whole config,
    never the config group Hydra would make of its folder."""
    import yaml
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    try:
        own = yaml.safe_load(recipe.read_text())
    except (OSError, yaml.YAMLError):  # Hydra reports it, with the position
        return recipe.stem
    defaults = own.get("defaults") if isinstance(own, dict) else None
    if not isinstance(defaults, list):
        return recipe.stem

    def grouped(entry: Any) -> bool:
        return isinstance(entry, str) and "/" in entry.strip("/") and "@" not in entry and " " not in entry

    if not any(grouped(entry) for entry in defaults):
        return recipe.stem
    node = OmegaConf.to_container(OmegaConf.load(recipe), resolve=False)
    node["defaults"] = [f"{entry}@_here_" if grouped(entry) else entry for entry in defaults]
    name = f"_loongsage_recipe_{recipe.stem}"  # a name recipe files do not take
    ConfigStore.instance().store(name=name, node=node)
    return name


# ----------------------------------------------------------------------------- specs: a new name replaces
def _is_spec(node: Any) -> bool:
    """A ``{name, params}`` entry: a mapping with a ``name`` and no key besides ``name`` and ``params``."""
    return isinstance(node, dict) and "name" in node and set(node) <= SPEC_KEYS


def _specs(node: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """``(path, spec)`` for every spec in ``node``, reached through mappings only (a list is replaced
    wholesale by a later layer, never merged into), nested specs (in ``params``) included."""
    if not isinstance(node, dict):
        return []
    found = [(path, node)] if _is_spec(node) else []
    for key, value in node.items():
        found += _specs(value, (*path, str(key)))
    return found


def _at(node: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _layers(
    recipe: Path, config_name: str, search_dirs: list[Path], searchpath: list[str]
) -> list[tuple[Path, dict[str, Any]]] | None:
    """The recipe files Hydra merges for ``recipe`` (composed as ``config_name``), in merge order:
    each file and its content as written (no ``defaults``), placed at its package; None where one
    is not a recipe file."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    loader = GlobalHydra.instance().config_loader()
    defaults = loader.compute_defaults_list(config_name, list(searchpath), RunMode.RUN).defaults
    layers = []
    for default in defaults:
        package = default.package or ""
        if package == "hydra" or package.startswith("hydra."):  # Hydra's own settings
            continue
        if default.primary:
            path = recipe
        else:  # the first folder of Hydra's search order that holds it
            found = [base / f"{default.config_path}.yaml" for base in (recipe.parent, *search_dirs)]
            path = next((f for f in found if f.is_file()), None)
        if path is None:
            return None
        layer = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        if not isinstance(layer, dict):
            return None
        layer.pop("defaults", None)
        for key in reversed(package.split(".") if package else []):
            layer = {key: layer}
        layers.append((path, layer))
    return layers


def _layered(recipe: Path, config_name: str, search_dirs: list[Path], searchpath: list[str]) -> str:
    """The config to compose for ``recipe`` (``config_name``): that one, or, where a layer names
    another plugin for a spec an earlier layer set (a recipe over the recipe its ``defaults`` list),
    the recipe composed with those specs' params taken from that layer on only, kept in Hydra's
    ConfigStore."""
    import yaml
    from hydra import compose as hydra_compose
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    try:
        own = yaml.safe_load(recipe.read_text())
    except (OSError, yaml.YAMLError):  # Hydra reports it, with the position
        return config_name
    if not isinstance(own, dict) or "defaults" not in own:  # one layer: nothing merges
        return config_name
    found = _layers(recipe, config_name, search_dirs, searchpath)
    if found is None:
        return config_name
    layers = [layer for _, layer in found]
    renamed_at: dict[tuple[str, ...], int] = {}  # spec path -> the last layer that renamed it
    names: dict[tuple[str, ...], Any] = {}
    for i, layer in enumerate(layers):
        for path, spec in _specs(layer):
            if path in names and names[path] != spec["name"]:
                renamed_at[path] = i
            names[path] = spec["name"]
    if not renamed_at:
        return config_name
    base = OmegaConf.to_container(hydra_compose(config_name=config_name, overrides=list(searchpath)), resolve=False)
    for path in sorted(renamed_at, key=len):  # an outer spec's params before the specs nested in them
        spec = _at(base, path)
        if not _is_spec(spec):
            continue
        # the layers from the last rename of this spec or of one it is nested in
        start = max(i for outer, i in renamed_at.items() if path[: len(outer)] == outer)
        given = [
            _at(layer, path)["params"]
            for layer in layers[start:]
            if isinstance(_at(layer, path), dict) and "params" in _at(layer, path)
        ]
        spec.pop("params", None)
        for params in given:  # merged as Hydra merges layers
            merged = OmegaConf.merge({"params": spec.get("params")}, {"params": params})
            spec["params"] = OmegaConf.to_container(merged, resolve=False)["params"]
    name = f"_loongsage_layered_{recipe.stem}"  # a name recipe files do not take
    ConfigStore.instance().store(name=name, node=base)
    return name


# ----------------------------------------------------------------------------- one model source
MODEL_SOURCES = ("path", "builder")


def _model_sources_set(item: str) -> set[str]:
    """Which of ``model.path`` / ``model.builder`` the override ``item`` sets to something (not null)."""
    override = _parse(item)
    if override is None or override.is_delete() or override.is_sweep_override():
        return set()
    try:
        key, value = override.key_or_group, override.value()
    except Exception:  # noqa: BLE001 - reported by the compose itself
        return set()
    if key == "model" and isinstance(value, dict):
        return {k for k in MODEL_SOURCES if value.get(k) is not None}
    if key in ("model.path", "model.builder"):
        return {key[len("model.") :]} if value is not None else set()
    return {"builder"} if key.startswith("model.builder.") else set()


def _one_model_source(
    raw: dict[str, Any], recipe: Path, expanded: list[str], search_dirs: list[Path]
) -> dict[str, Any]:
    """``raw`` with one of ``model.path`` and ``model.builder``: the one set last (recipe files in merge
    order, then the command line) wins and the other is dropped; one layer that sets both is refused."""
    from hydra import initialize_config_dir

    model = raw.get("model")
    if not isinstance(model, dict) or any(model.get(k) is None for k in MODEL_SOURCES):
        return raw
    both = (
        "model.path and model.builder are both set, and a run starts from one model: keep model.path (an HF "
        "folder) or model.builder (a model_builder that makes one)"
    )
    last = None
    searchpath = _searchpath_override(recipe, search_dirs)
    with initialize_config_dir(config_dir=str(recipe.parent), version_base=None):
        layers = _layers(recipe, _primary(recipe), search_dirs, searchpath) or []
    for path, layer in layers:
        node = layer.get("model")
        given = {k for k in MODEL_SOURCES if isinstance(node, dict) and node.get(k) is not None}
        if len(given) == 2:
            raise ConfigError(f"{path}: {both}")
        last = given.pop() if given else last
    on_command_line: set[str] = set()
    for item in expanded:
        given = _model_sources_set(item)
        on_command_line |= given
        last = given.pop() if len(given) == 1 else last
    if len(on_command_line) == 2:
        raise ConfigError(f"the command line: {both}")
    if last is None:  # set in a way no layer shows (an interpolation): nothing says which one is meant
        raise ConfigError(f"{recipe.name}: {both}")
    dropped = "builder" if last == "path" else "path"
    return {**raw, "model": {**model, dropped: None}}


def _parse(item: str) -> Any:
    """The override Hydra reads in ``item``; None where it cannot (it says why when composing)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(item)
    except Exception:  # noqa: BLE001 - reported by the compose itself
        return None


def _renamed_by(override: Any) -> dict[str, Any]:
    """The specs an override gives a name: ``{dotted path: name}`` (``key={name: x, ...}``, the specs
    nested in a mapping value, or ``key.name=x``); empty for anything else."""
    if override is None or override.is_delete() or override.is_sweep_override():
        return {}
    try:
        key, value = override.key_or_group, override.value()
    except Exception:  # noqa: BLE001 - reported by the compose itself
        return {}
    if isinstance(value, dict):
        return {
            ".".join((key, *path)): spec["name"]
            for path, spec in _specs(value)
            if not isinstance(spec["name"], (dict, list))
        }
    if key.endswith(".name") and not isinstance(value, list):
        return {key[: -len(".name")]: value}
    return {}


def _replacing_overrides(overrides: list[str], run: Any) -> list[str]:
    """``overrides`` with ``~<spec>.params`` before each one that renames a spec holding params, so
    that the new entry replaces the old one instead of merging into it (Hydra merges a mapping value
    key by key). ``run(items)`` composes the recipe with ``items``: what the spec is before it.

    A later ``~<spec>.params`` (or a key under it) that the rename removed already is left out: it
    was how an override dropped the old params before a new name did (``x.name=y ~x.params``)."""
    from omegaconf import DictConfig, OmegaConf

    out: list[str] = []
    emptied: list[str] = []  # params a rename removed
    for item in overrides:
        override = _parse(item)
        if (
            override is not None
            and override.is_delete()
            and any(override.key_or_group == p or override.key_or_group.startswith(f"{p}.") for p in emptied)
        ):
            try:
                gone = OmegaConf.select(run(out), override.key_or_group, throw_on_missing=False) is None
            except Exception:  # noqa: BLE001 - kept: Hydra says what is wrong with it
                gone = False
            if gone:
                continue
        renamed = _renamed_by(override)
        if renamed:
            before = run(out)
            for path, name in renamed.items():
                try:
                    spec = OmegaConf.select(before, path, throw_on_missing=False)
                    stale = (
                        isinstance(spec, DictConfig)
                        and "name" in spec
                        and spec.get("params") is not None
                        and spec.name != name
                    )
                except Exception:  # noqa: BLE001 - a path Hydra refuses: it says so when composing
                    stale = False
                if stale:
                    out.append(f"~{path}.params")
                    emptied.append(f"{path}.params")
        out.append(item)
    return out


def default_search_dirs() -> list[Path]:
    """The recipe folders other than ``--config-dir``: ``./recipes`` and the shipped recipes."""
    from loongsage.core.config import recipe_search_path  # imported here: config imports this module

    return recipe_search_path(None)


def compose(recipe: Path, overrides: list[str], search_dirs: list[Path] | None = None) -> dict[str, Any]:
    """Compose ``recipe`` with Hydra overrides into a plain dict (no validation yet).

    ``search_dirs``: where recipes that its ``defaults`` name are found after its own folder
    (default :func:`default_search_dirs`). Anything that goes wrong (a YAML syntax error in the
    recipe, an override Hydra cannot parse or apply) becomes one ConfigError line naming the file
    and position, or the override at fault.
    """
    recipe = Path(recipe).resolve()
    dirs = [Path(d) for d in (default_search_dirs() if search_dirs is None else search_dirs)]
    expanded = _expand_aliases(overrides)
    try:
        raw = _compose(recipe, expanded, dirs)
    except Exception as exc:  # Hydra, OmegaConf and YAML raise many types; each is explained below
        raise ConfigError(_explain_compose_error(recipe, overrides, expanded, exc, dirs)) from None
    return _one_model_source(raw, recipe, expanded, dirs)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _first_line(exc: BaseException) -> str:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    lines = str(exc).strip().splitlines()
    first = lines[0].strip() if lines else type(exc).__name__
    if first.startswith(("Error merging override", "Error parsing override")) and exc.__cause__ is not None:
        return _first_line(exc.__cause__)
    if not isinstance(exc, (HydraException, OmegaConfBaseException)):
        first = f"{type(exc).__name__}: {first}"
    return first


def _yaml_error(recipe: Path, exc: Any) -> str:
    """``file: invalid YAML at line L, column C: problem (context at line l, column c)``."""
    mark, context, context_mark = (getattr(exc, a, None) for a in ("problem_mark", "context", "context_mark"))
    problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
    name = mark.name if mark is not None and mark.name and not str(mark.name).startswith("<") else str(recipe)
    text = f"{name}: invalid YAML"
    if mark is not None:
        text += f" at line {mark.line + 1}, column {mark.column + 1}"
    text += f": {_one_line(problem)}"
    if context:
        where = (
            f" at line {context_mark.line + 1}, column {context_mark.column + 1}" if context_mark is not None else ""
        )
        text += f" ({_one_line(context)}{where})"
    return text


def _list_index_error(base: Any, key: str) -> str | None:
    """If ``key`` (dotted) indexes past the end of a list of ``base`` (or by a non-number), say so."""
    node, walked = base, []
    for part in key.split("."):
        if isinstance(node, list):
            where, n = ".".join(walked), len(node)
            if where == "data_sources":
                has = f"the recipe has {n} data source{'' if n == 1 else 's'}"
            else:
                has = f"{where} has {n} item{'' if n == 1 else 's'}"
            valid = (
                "it is empty; set the whole list instead"
                if n == 0
                else "only index 0 exists"
                if n == 1
                else f"indices 0 to {n - 1} exist"
            )
            if not part.isdigit():
                return f"{where}.{part}: {where} is a list, indexed by number; {has}; {valid}"
            if int(part) >= n:
                return f"{where}.{part}: {has}; {valid}"
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
        walked.append(part)
    return None


def _explain_compose_error(
    recipe: Path, overrides: list[str], expanded: list[str], exc: Exception, search_dirs: list[Path]
) -> str:
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if isinstance(exc, yaml.YAMLError):
        return _yaml_error(recipe, exc)
    parser = OverridesParser.create()
    for given, item in zip(overrides, expanded):
        try:
            parser.parse_override(item)
        except Exception:
            return (
                f"override {given!r}: not valid override syntax; write key=value (quote a value with spaces "
                "or brackets), +key=value to add a key, or ~key to delete one"
            )
    # the recipe composes alone? then find the first override that breaks it, on what came before it
    base: Any = None
    for k in range(len(expanded) + 1):
        try:
            composed = _compose(recipe, expanded[:k], search_dirs)
        except Exception as inner:
            if k == 0:
                if isinstance(inner, yaml.YAMLError):
                    return _yaml_error(recipe, inner)
                missing = re.search(r"Could not load '([^']+?)(@_here_)?'", str(inner))
                if missing:
                    looked = ", ".join(str(d) for d in dict.fromkeys([recipe.parent, *search_dirs]) if d.is_dir())
                    return (
                        f"{recipe}: defaults: recipe {missing.group(1)!r} not found; looked in {looked} "
                        "(`loongsage recipes` lists the recipes; name one by its path there, e.g. "
                        "tiny/grpo_arith_cpu)"
                    )
                if "must be a DictConfig" in str(inner):
                    kind = "list" if "ListConfig" in str(inner) else "single value"
                    return (
                        f"{recipe}: a recipe is a mapping of config sections (run, model, data_sources, ...); "
                        f"this file holds a {kind}"
                    )
                return f"{recipe.name}: {_first_line(inner)}"
            key = expanded[k - 1].partition("=")[0].lstrip("+~")
            return _list_index_error(base, key) or f"override {overrides[k - 1]!r}: {_first_line(inner)}"
        base = composed
    return f"{recipe.name}: {_first_line(exc)}"
