"""The plugin manager: one registry of named factories built from the twelve hookspecs.

Load order: the core's built-ins, then every module of the entry-point group ``loongsage``, then
the modules listed under ``plugins:`` in the config. Each hook's mappings are merged into one
table per *category*; a name provided twice is refused with both providers named, and a miss
lists the names that are known.

Every entry is held to its contract (:mod:`loongsage.core.contracts`): a class factory when the
tables are built, whatever a factory builds when it is built. A missing member, a method that
cannot take the contract's call or a capability flag of the wrong type is one line naming the
entry, its provider and the member; flags an entry leaves out get their defaults, so the
framework reads every flag directly.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pluggy

from loongsage.core import contract_check, contracts, hookspecs
from loongsage.core.schema import check_params, join_error
from loongsage.core.types import ConfigError

# entries of the project's own optional packages, named when one is asked for but not installed
PROJECT_PACKAGES = {("engine", "sglang"): "loongsage-sglang", ("transport", "ipc"): "loongsage-sync",
                    ("transport", "broadcast"): "loongsage-sync"}
# category (as used in error messages and `loongsage plugins`) -> hook name
CATEGORIES: dict[str, str] = {
    "agent": "loongsage_agents",
    "reward": "loongsage_rewards",
    "data_source": "loongsage_data_sources",
    "advantage": "loongsage_advantage_estimators",
    "policy_loss": "loongsage_policy_losses",
    "kl": "loongsage_kl_estimators",
    "correction": "loongsage_corrections",
    "data_filter": "loongsage_data_filters",
    "rollout_scheduler": "loongsage_rollout_schedulers",
    "sandbox": "loongsage_sandboxes",
    "gateway_middleware": "loongsage_gateway_middlewares",
}
BACKEND_KINDS: tuple[str, ...] = tuple(contracts.BACKENDS)

BUILTIN_MODULE = "loongsage.core.builtin_plugins"


@dataclass(frozen=True)
class Entry:
    name: str
    category: str
    factory: Any
    provider: str  # "distribution version (module)" or "config plugins: module"
    contract: type  # the Protocol of its category (contracts.HOOKS / contracts.BACKENDS)
    preflight: Callable[..., None] | None = None  # a backend class's optional preflight classmethod

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
    def register_module(self, module: Any, provider: str) -> None:
        if self.pm.is_registered(module):
            return
        self.pm.register(module, name=provider)
        self._providers[id(module)] = provider
        self._tables = None

    def load(self, extra_modules: list[str] | tuple[str, ...] = ()) -> "Registry":
        self.register_module(importlib.import_module(BUILTIN_MODULE), "loongsage-core (built-in)")
        for ep in sorted(importlib.metadata.entry_points(group=hookspecs.PROJECT), key=lambda e: e.name):
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else ep.name
            try:
                module = ep.load()
            except Exception as exc:
                raise ConfigError(f"plugin {ep.name!r} from {dist} failed to load: {type(exc).__name__}: {exc}") from exc
            self.register_module(module, f"{dist} ({ep.value})")
        for path in extra_modules:
            try:
                module = importlib.import_module(path)
            except Exception as exc:
                raise ConfigError(f"plugins: module {path!r} failed to import: {type(exc).__name__}: {exc}") from exc
            self.register_module(module, f"config plugins: {path}")
        self.extra_modules += tuple(extra_modules)
        return self

    # ----------------------------------------------------------------- tables
    def _build(self) -> dict[str, dict[str, Entry]]:
        tables: dict[str, dict[str, Entry]] = {c: {} for c in (*CATEGORIES, *BACKEND_KINDS)}
        for category, hook_name in (*CATEGORIES.items(), ("backend", "loongsage_backends")):
            hook = getattr(self.pm.hook, hook_name)
            for impl in hook.get_hookimpls():
                provider = self._providers.get(id(impl.plugin), impl.plugin_name)
                mapping = impl.function() or {}
                for name, factory in mapping.items():
                    cat = category
                    if category == "backend":  # the declared kind routes the entry to its table and contract
                        cat = getattr(factory, "kind", None)
                        if cat not in BACKEND_KINDS:
                            raise ConfigError(
                                f"backend {name!r} from {provider}: kind {cat!r} is not one of {', '.join(BACKEND_KINDS)}"
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
        factory function is checked on what it builds (:meth:`create`)."""
        if not inspect.isclass(entry.factory):
            return entry
        problem = contract_check.check_class(entry.factory, entry.contract)
        if problem is not None:
            raise entry.refuse(problem)
        if "preflight" in contract_check.flags(entry.contract):
            entry = replace(entry, preflight=entry.factory.preflight)
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

    def check(self, category: str, spec: dict[str, Any] | None, path: str, *, skip: tuple[str, ...] = (),
              contract: type | None = None) -> dict:
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

    def create(self, category: str, spec: dict[str, Any], path: str = "", *, contract: type | None = None,
               **supplied: Any) -> Any:
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


def load_registry(extra_modules: list[str] | tuple[str, ...] = ()) -> Registry:
    return Registry().load(extra_modules)
