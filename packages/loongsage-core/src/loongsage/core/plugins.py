"""The plugin manager: one registry of named factories built from the twelve hookspecs.

Load order: the core's built-ins, then every module of the entry-point group ``loongsage``, then
the modules listed under ``plugins:`` in the config. Each hook's mappings are merged into one
table per *category*; a name provided twice is refused with both providers named, and a miss
lists the names that are known.

Every plugin module is checked when it registers, because pluggy itself registers a misspelt hook
or an unmarked function silently (it adds nothing): an ``@hookimpl`` whose name is no hook, a
function named after a hook without ``@hookimpl``, and a module with no hookimpl at all are
refused in one line naming the module (and the closest hook name). What a hook returns is checked
where it is called: a mapping of names to factories, or one line naming the plugin.

A ``plugins:`` module that is not importable as installed is looked for in the folders the caller
names (the recipe's folder and the working directory, for a recipe's ``plugins:``); the folder it
is found in joins ``sys.path`` and ``PYTHONPATH``, so the run's worker processes import it too.

Every entry is held to its contract (:mod:`loongsage.core.contracts`): a class factory when the
tables are built, whatever a factory builds when it is built. A missing member, a method that
cannot take the contract's call or a capability flag of the wrong type is one line naming the
entry, its provider and the member; flags an entry leaves out get their defaults, so the
framework reads every flag directly. The flags needed before anything is built are read off the
factory (:data:`~loongsage.core.contracts.FACTORY_FLAGS`): a backend's ``kind`` picks its table
and Protocol (:class:`~loongsage.core.contracts.Backend`), then its ``preflight`` and what it
``receives``.

The hooks, and the category each one's entries go to, are read from :data:`loongsage.core.hookspecs.HOOKS`.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pluggy

from loongsage.core import contract_check, contracts, hookspecs
from loongsage.core.project_packages import PROJECT_PACKAGES  # named when one is asked for but not installed
from loongsage.core.schema import check_params, join_error
from loongsage.core.types import Check, ConfigError

# the registry's tables: one per hook category (hookspecs.CATEGORIES), one per backend kind
BACKEND_KINDS: tuple[str, ...] = tuple(contracts.BACKENDS)

BUILTIN_MODULE = "loongsage.core.builtin_plugins"


@dataclass(frozen=True)
class Entry:
    name: str
    category: str
    factory: Any
    provider: str  # "distribution version (module)" or "config plugins: module"
    contract: type  # the Protocol of its category (contracts.HOOKS / contracts.BACKENDS)
    preflight: Callable[..., None] | None = None  # a backend factory's optional preflight
    doctor: Callable[[], list[Check]] | None = None  # what it needs on this machine (loongsage doctor)

    def refuse(self, problem: str, where: str = "") -> ConfigError:
        """``[where: ]<category> '<name>' (from <provider>): <problem>``, one line."""
        head = f"{where}: " if where else ""
        return ConfigError(f"{head}{self.category} {self.name!r} (from {self.provider}): {problem}")


class Registry:
    """Every registered factory, by category and name."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._providers: dict[int, str] = {}
        self._tables: dict[str, dict[str, Entry]] | None = None
        self.extra_modules: tuple[str, ...] = ()  # the config's plugins: another process loads the same

    # ----------------------------------------------------------------- loading
    def register_module(self, module: Any, provider: str, where: str | None = None) -> None:
        """Register ``module``'s hookimpls under ``provider``; ``where`` names it in errors (default:
        ``plugin <provider>``). A module whose hooks would silently add nothing is refused."""
        if self.pm.is_registered(module):
            return
        where = where or f"plugin {provider}"
        try:
            self.pm.register(module, name=provider)
        except pluggy.PluginValidationError as exc:  # e.g. a hookimpl taking arguments the hook does not pass
            why = "; LoongSage hooks take no arguments" if "Argument(s)" in str(exc) else ""
            raise ConfigError(f"{where}: {' '.join(str(exc).split())}{why}") from None
        problem = _hook_problem(self.pm, module)
        if problem is not None:
            self.pm.unregister(module)
            raise ConfigError(f"{where}: {problem}")
        self._providers[id(module)] = provider
        self._tables = None

    def load(self, extra_modules: list[str] | tuple[str, ...] = (), search_dirs: Iterable[str | Path] = ()) -> Registry:
        """Register the built-ins, the entry points, then ``extra_modules`` (``plugins:``), each of
        those imported as installed or else from the first of ``search_dirs`` and the working
        directory that holds it."""
        self.register_module(importlib.import_module(BUILTIN_MODULE), "loongsage-core (built-in)")
        for ep in sorted(importlib.metadata.entry_points(group=hookspecs.PROJECT), key=lambda e: e.name):
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else ep.name
            try:
                module = ep.load()
            except Exception as exc:
                raise ConfigError(
                    f"plugin {ep.name!r} from {dist} failed to load: {type(exc).__name__}: {exc}"
                ) from exc
            self.register_module(module, f"{dist} ({ep.value})", f"plugin {ep.name!r} from {dist} ({ep.value})")
        for path in extra_modules:
            folders = list(dict.fromkeys(Path(d).resolve() for d in (*search_dirs, Path.cwd())))
            module = _import_plugin(path, folders)
            self.register_module(module, f"config plugins: {path}", f"plugins: module {path!r}")
        self.extra_modules += tuple(extra_modules)
        return self

    # ----------------------------------------------------------------- tables
    def _build(self) -> dict[str, dict[str, Entry]]:
        tables: dict[str, dict[str, Entry]] = {c: {} for c in (*hookspecs.CATEGORIES, *BACKEND_KINDS)}
        for hook_name, spec in hookspecs.HOOKS.items():
            hook = getattr(self.pm.hook, hook_name)
            for impl in hook.get_hookimpls():
                provider = self._providers.get(id(impl.plugin), impl.plugin_name)
                for name, factory in _hook_result(impl, hook_name, provider).items():
                    cat = spec.category
                    if cat == hookspecs.BACKEND:  # the declared kind routes the entry to its table and contract
                        problem = contract_check.check_factory(factory, contracts.Backend, ("kind",))
                        if problem is not None:
                            raise ConfigError(f"backend {name!r} from {provider}: {problem}")
                        cat = factory.kind
                        if cat not in BACKEND_KINDS:
                            raise ConfigError(
                                f"backend {name!r} from {provider}: kind {cat!r} is not one of "
                                f"{', '.join(BACKEND_KINDS)}"
                            )
                    table = tables[cat]
                    if name in table:
                        raise ConfigError(
                            f"{cat} {name!r} is provided twice: by {table[name].provider} and by {provider}; "
                            "uninstall one or rename it"
                        )
                    table[name] = self._checked(Entry(name, cat, factory, provider, _contract(cat)))
        return tables

    @staticmethod
    def _checked(entry: Entry) -> Entry:
        """A class factory against its contract now (its missing flags set to their defaults); a
        factory function on the flags read before it builds (:data:`~loongsage.core.contracts.FACTORY_FLAGS`,
        its own attributes), and on what it builds (:meth:`create`)."""
        problem = contract_check.check_factory(entry.factory, entry.contract, contracts.FACTORY_FLAGS)
        if problem is not None:
            raise entry.refuse(problem)
        declared = contract_check.flags(entry.contract)
        if "preflight" in declared:
            entry = replace(entry, preflight=entry.factory.preflight)
        if "doctor" in declared:
            entry = replace(entry, doctor=entry.factory.doctor)
        return entry

    @property
    def tables(self) -> dict[str, dict[str, Entry]]:
        if self._tables is None:
            self._tables = self._build()
        return self._tables

    def names(self, category: str) -> list[str]:
        return sorted(self.tables[category])

    def entry(self, category: str, name: str, path: str | None = None) -> Entry:
        table = self.tables.get(category)
        if table is None:
            raise ConfigError(f"unknown plugin category {category!r}; known: {', '.join(self.tables)}")
        if name not in table:
            known = ", ".join(sorted(table)) or "(none installed)"
            where = f"{path}.name" if path else category
            package = PROJECT_PACKAGES.get((category, name))
            hint = f" (the {name!r} {category} is in {package}: pip install {package})" if package else ""
            raise ConfigError(f"{where}: unknown {category} {name!r}; known: {known}{hint}")
        return table[name]

    def check(
        self,
        category: str,
        spec: dict[str, Any] | None,
        path: str,
        *,
        skip: tuple[str, ...] = (),
        contract: type | None = None,
    ) -> dict:
        """Validate a ``{name, params}`` spec without building it; return the coerced params.

        ``contract``: a role that asks for more than the category (a trainer used as the critic:
        :class:`~loongsage.core.contracts.Critic`), checked on a class factory now.
        """
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ConfigError(f"{path}: expected a mapping with 'name' (and optional 'params'); got {spec!r}")
        extra = sorted(set(spec) - {"name", "params"})
        if extra:
            raise ConfigError(f"{path}.{extra[0]}: unknown key; allowed: name, params")
        entry = self.entry(category, spec["name"], path)
        if contract is not None and inspect.isclass(entry.factory):
            problem = contract_check.check_class(entry.factory, contract)
            if problem is not None:
                raise entry.refuse(problem, path)
        return check_params(entry.factory, spec.get("params") or {}, f"{path}.params", skip=skip)

    def create(
        self, category: str, spec: dict[str, Any], path: str = "", *, contract: type | None = None, **supplied: Any
    ) -> Any:
        """Build the implementation a ``{name, params}`` spec names; ``supplied`` are framework args.

        What is built is checked against the category's contract, or against ``contract`` where
        the role asks for more (a trainer used as the critic: :class:`~loongsage.core.contracts.Critic`).
        """
        path = path or category
        params = self.check(category, spec, path, skip=tuple(supplied))
        entry = self.entry(category, spec["name"], path)
        try:
            built = entry.factory(**params, **supplied)
        except (ValueError, TypeError) as exc:
            raise ConfigError(join_error(f"{path}.params", exc, params)) from None
        contract = contract or entry.contract
        problem = contract_check.check_object(built, contract)
        if problem is not None:
            raise entry.refuse(problem, path)
        # Entries that wrap other entries (a reward around a reward) name them in params as specs
        # and declare ``nested = {param: category}``; those are built here, depth first, and bound.
        if "nested" in contract_check.flags(contract):
            for name, inner_category in built.nested.items():
                inner_spec = params.get(name)
                if inner_spec is not None:
                    inner = self.create(inner_category, inner_spec, f"{path}.params.{name}")
                    built = built.bind(**{name: inner})
        return built


def _contract(category: str) -> type:
    return contracts.HOOKS[category] if category in contracts.HOOKS else contracts.BACKENDS[category]


def load_registry(extra_modules: list[str] | tuple[str, ...] = (), search_dirs: Iterable[str | Path] = ()) -> Registry:
    return Registry().load(extra_modules, search_dirs)


# ----------------------------------------------------------------------------- checks on plugin modules
def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, hookspecs.HOOK_NAMES, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _hook_problem(pm: pluggy.PluginManager, module: Any) -> str | None:
    """What makes ``module`` (registered in ``pm``) add less than its author meant, or None.

    pluggy takes an ``@hookimpl`` of any name (it waits for a spec that never comes) and skips a
    function without the marker, so both mistakes would otherwise register nothing, silently.
    """
    for name, value in sorted(vars(module).items()):
        if not (inspect.isfunction(value) and value.__module__ == getattr(module, "__name__", None)):
            continue  # only the module's own functions: an imported helper is not the author's hook
        # a hook's name, or one close to it under the project's prefix (a helper may be named anything else)
        hooklike = name in hookspecs.HOOK_NAMES or (name.startswith(f"{hookspecs.PROJECT}_") and _suggest(name))
        if hooklike and pm.parse_hookimpl_opts(module, name) is None:
            hint = "" if name in hookspecs.HOOK_NAMES else _suggest(name)
            return (
                f"function {name}(){hint} is not marked @hookimpl, so it registers nothing; decorate it with "
                "@hookimpl (from loongsage.core.hookspecs import hookimpl)"
            )
    callers = pm.get_hookcallers(module) or []
    for caller in sorted(callers, key=lambda c: c.name):
        optional = all(impl.optionalhook for impl in caller.get_hookimpls() if impl.plugin is module)
        if not caller.has_spec() and not optional:
            hint = _suggest(caller.name) or f" (the hooks: {', '.join(hookspecs.HOOK_NAMES)})"
            impl = next(impl for impl in caller.get_hookimpls() if impl.plugin is module)
            source = getattr(impl.function, "__module__", None)
            # pluggy registers a hookimpl imported into the module again, under the name it is imported as
            origin = f" (imported from {source})" if source not in (None, getattr(module, "__name__", None)) else ""
            return f"@hookimpl {caller.name}(){origin} is not a LoongSage hook{hint}, so it would never be called"
    if not callers:
        return (
            f"provides no @hookimpl function, so it adds nothing; a plugin module defines functions named after "
            f"the hooks ({', '.join(hookspecs.HOOK_NAMES)}) marked @hookimpl (from loongsage.core.hookspecs)"
        )
    return None


def _hook_result(impl: Any, hook_name: str, provider: str) -> Mapping[str, Any]:
    """``{name: factory}`` as ``impl`` returns it, or one line naming the plugin and what it returned."""
    where = f"{hook_name}() of {provider}"
    try:
        mapping = impl.function()
    except Exception as exc:
        raise ConfigError(f"{where} raised {type(exc).__name__}: {exc}") from exc
    if mapping is None:
        return {}
    if not isinstance(mapping, Mapping):
        raise ConfigError(
            f"{where} returned a {type(mapping).__name__}; a hook returns a mapping of entry names to "
            "factories, e.g. {'my_entry': MyClass}"
        )
    for name, factory in mapping.items():
        if not isinstance(name, str):
            raise ConfigError(f"{where} returned the key {name!r} ({type(name).__name__}); entry names are strings")
        if not callable(factory):
            raise ConfigError(
                f"{where} maps {name!r} to a {type(factory).__name__}, which is not callable; map it to "
                "the factory (a class or a function) that builds the entry"
            )
    return mapping


def _import_plugin(path: str, search_dirs: list[Path]) -> Any:
    """Import the ``plugins:`` module ``path``: as installed, else from the first of ``search_dirs``
    that holds its top-level package, which then joins ``sys.path`` and ``PYTHONPATH`` (the run's
    worker processes import the same module by name, so they must find it too)."""
    top = path.split(".")[0]
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (path == exc.name or path.startswith(f"{exc.name}.")):
            raise ConfigError(f"plugins: module {path!r} failed to import: {type(exc).__name__}: {exc}") from exc
        missing = exc
    except Exception as exc:
        raise ConfigError(f"plugins: module {path!r} failed to import: {type(exc).__name__}: {exc}") from exc
    for folder in search_dirs:
        if (folder / f"{top}.py").is_file() or (folder / top).is_dir():
            _add_to_path(folder)
            try:
                return importlib.import_module(path)
            except Exception as exc:
                raise ConfigError(
                    f"plugins: module {path!r} (in {folder}) failed to import: {type(exc).__name__}: {exc}"
                ) from exc
    looked = f" and in {', '.join(str(folder) for folder in search_dirs)}" if search_dirs else ""
    raise ConfigError(
        f"plugins: module {path!r} failed to import: {type(missing).__name__}: {missing}; looked in "
        f"the installed packages (sys.path){looked}; a plugins: module must be importable: put "
        f"{top}.py beside the recipe or in the working directory, pip install its package, or add its "
        "folder to PYTHONPATH"
    )


def _add_to_path(folder: Path) -> None:
    # appended, not prepended: the recipe's folder must not shadow an installed module of the same name
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
        importlib.invalidate_caches()
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(folder) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([*parts, str(folder)])
