"""The twelve extension points: names, signatures, docstrings and how the registry covers them."""

from __future__ import annotations

import inspect
import typing

import pluggy
import pytest

from loongsage.core import hookspecs, plugins

# The hooks as the specs declare them (hookspecs.HOOKS): every name and category is read from there.
HOOK_NAMES = hookspecs.HOOK_NAMES
SPEC_ATTR = f"{hookspecs.PROJECT}_spec"


def _specs_in_module() -> dict[str, typing.Callable]:
    return {name: fn for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(fn, SPEC_ATTR)}


@pytest.fixture(scope="module")
def pm() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    return manager


def test_exactly_the_twelve_hooks() -> None:
    assert hookspecs.PROJECT == "loongsage"
    assert HOOK_NAMES == tuple(hookspecs.HOOKS)
    assert len(set(HOOK_NAMES)) == 12
    assert set(_specs_in_module()) == set(HOOK_NAMES)
    assert all(name.startswith(f"{hookspecs.PROJECT}_") for name in HOOK_NAMES)
    # nothing else in the module looks like a hook but lacks the marker
    stray = {n for n, _ in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("loongsage_")}
    assert stray == set(HOOK_NAMES)


def test_the_hook_table_is_the_specs() -> None:
    """One table, filled as the specs are declared: every marked spec is in it, under its own name."""
    assert {name: hook.name for name, hook in hookspecs.HOOKS.items()} == {n: n for n in _specs_in_module()}
    categories = [hook.category for hook in hookspecs.HOOKS.values()]
    assert len(categories) == len(set(categories)), "two hooks share a category"
    assert [h.name for h in hookspecs.HOOKS.values() if h.category == hookspecs.BACKEND] == ["loongsage_backends"]
    assert hookspecs.CATEGORIES == {
        h.category: n for n, h in hookspecs.HOOKS.items() if h.category != hookspecs.BACKEND
    }
    assert all((h.contract is None) == (h.category == hookspecs.BACKEND) for h in hookspecs.HOOKS.values())


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_hook_signature_docstring_and_options(name: str, pm: pluggy.PluginManager) -> None:
    fn = getattr(hookspecs, name)
    assert inspect.signature(fn).parameters == {}, f"{name} must take no arguments"
    assert typing.get_type_hints(fn, vars(hookspecs))["return"] == hookspecs.Factories
    doc = inspect.getdoc(fn)
    assert doc and len(doc.split()) >= 5, f"{name} needs a docstring saying what the factories implement"
    opts = getattr(fn, SPEC_ATTR)
    assert opts["firstresult"] is False, f"{name}: every plugin contributes, no firstresult"
    assert opts["historic"] is False
    caller = getattr(pm.hook, name)
    assert caller.spec is not None and caller.spec.argnames == ()
    assert caller.spec.opts["firstresult"] is False


def test_calling_a_hook_collects_every_plugins_mapping(pm: pluggy.PluginManager) -> None:
    """No firstresult: two plugins on one hook both contribute, in a list of mappings."""

    class First:
        @hookspecs.hookimpl
        def loongsage_data_filters(self):
            return {"a": object}

    class Second:
        @hookspecs.hookimpl
        def loongsage_data_filters(self):
            return {"b": object}

    local = pluggy.PluginManager(hookspecs.PROJECT)
    local.add_hookspecs(hookspecs)
    local.register(First())
    local.register(Second())
    results = local.hook.loongsage_data_filters()
    assert sorted(k for mapping in results for k in mapping) == ["a", "b"]


def test_hookimpl_with_arguments_is_rejected(pm: pluggy.PluginManager) -> None:
    """A hookimpl may not ask for parameters the spec does not offer."""

    class Bad:
        @hookspecs.hookimpl
        def loongsage_rewards(self, config):
            return {}

    local = pluggy.PluginManager(hookspecs.PROJECT)
    local.add_hookspecs(hookspecs)
    with pytest.raises(pluggy.PluginValidationError, match="config"):
        local.register(Bad())


def test_categories_and_backends_cover_every_hook() -> None:
    from loongsage.core import contracts

    hooks = list(hookspecs.CATEGORIES.values())
    assert len(hooks) == len(set(hooks)), "two categories map to one hook"
    assert "loongsage_backends" not in hooks
    assert set(hooks) | {"loongsage_backends"} == set(hookspecs.HOOK_NAMES)
    assert len(hookspecs.CATEGORIES) == 11
    assert tuple(contracts.HOOKS) == tuple(hookspecs.CATEGORIES), "the contracts' index follows the hook table"
    assert not set(hookspecs.CATEGORIES) & set(plugins.BACKEND_KINDS), "a backend kind shadows a category"
    assert hookspecs.BACKEND not in (*hookspecs.CATEGORIES, *plugins.BACKEND_KINDS)
    for kind in ("trainer", "engine", "teacher", "transport", "tracker", "chat_parser", "model_builder", "service"):
        assert kind in plugins.BACKEND_KINDS
        assert kind in inspect.getdoc(hookspecs.loongsage_backends)


def test_every_installed_hookimpl_matches_a_spec() -> None:
    """A misspelt hook in any installed plugin (built-in or entry point) would sit unverified."""
    registry = plugins.load_registry()
    registry.pm.check_pending()  # raises PluginValidationError on a hookimpl without a spec
    assert len(registry.pm.get_plugins()) >= 2  # the built-ins and loongsage-algos


# ----------------------------------------------------------------------------- the contracts behind the hooks
# What the framework calls on each hook's product and each backend, pinned: the parameters of every
# method of every Protocol in core/contracts/ (slime pins its hooks' call signatures the same way).
# A contract changes deliberately: this table, the Protocol and every implementation in one commit.
CONTRACT_CALLS = {
    "Agent": {"run": ("record", "ctx")},
    "Reward": {"__call__": ("trajectory", "record")},
    "DataSource": {"__len__": (), "__getitem__": ("index",)},
    "AdvantageEstimator": {"__call__": ("inp",)},
    "PolicyLoss": {"__call__": ("inp",)},
    "KLEstimator": {"__call__": ("logprobs", "ref_logprobs", "old_logprobs")},
    "Correction": {"__call__": ("inp",)},
    "DataFilter": {"__call__": ("group",)},
    "RolloutScheduler": {"groups_to_dispatch": ("state",)},
    "Sandbox": {
        "create": ("owner", "deadline"),
        "exec": ("sandbox_id", "cmd", "timeout"),
        "put": ("sandbox_id", "path", "data"),
        "get": ("sandbox_id", "path"),
        "delete": ("sandbox_id",),
    },
    "GatewayMiddleware": {"__call__": ("request", "call_next")},
    "Trainer": {
        "setup_optimizer": ("lr", "betas", "eps", "weight_decay", "grad_clip", "warmup_steps"),
        "logprobs": ("batch", "token_budget"),
        "reference_logprobs": ("batch", "token_budget"),
        "train_step": ("mini_batch", "loss_fn", "token_budget"),
        "export_weights": (),
        "save": ("path",),
        "load": ("path",),
        "export_hf": ("path", "tokenizer"),
        "offload": ("weights",),
        "onload": (),
        "param_checksum": (),
    },
    "Engine": {
        "generate": ("request",),
        "abort": ("request_ids",),
        "pause": (),
        "resume": (),
        "flush_cache": (),
        "update_weights": ("named_tensors",),
        "release_memory": (),
        "resume_memory": (),
        "set_version": ("version",),
        "health": (),
    },
    "Teacher": {"score": ("batch", "topk", "full_vocab")},
    "Transport": {"push": ("named_tensors", "receivers"), "receiver": ()},
    "Tracker": {"log": ("step", "metrics"), "close": ()},
    "ChatParser": {"parse": ("text",)},
    "ModelBuilder": {"build": ()},
    "RunService": {"start": ("ctx",), "stop": ()},
}
CONTRACT_FLAGS = {
    "Agent": {"required_services": ()},
    "Reward": {"takes_context": False, "nested": {}, "bind": None},
    "GatewayMiddleware": {"receives": ()},
    "AdvantageEstimator": {"needs_values": False, "uses_token_rewards": False, "returns": None, "min_group_size": 1},
    "PolicyLoss": {"needs_old_logprobs": True, "supported_aggregations": None, "uses_advantages": True},
    "KLEstimator": {"consumes": "logprobs", "needs_old_logprobs": False, "partial": None},
    "Correction": {"needs_logprobs": False},
    "DataFilter": {"excludes_from_loss": None},
    "RolloutScheduler": {"asynchronous": False, "max_staleness": 0, "collectable": None},
    "Sandbox": {
        "doctor": None,
        "reusable": False,
        "reset": None,
        "reap_orphans": None,
        "put_archive": None,
        "host_path": None,
        "adopt": None,
        "close": None,
    },
    "Trainer": {
        "kind": "trainer",
        "supports_lora": False,
        "holds_reference": False,
        "preflight": None,
        "doctor": None,
        "add_teacher": None,
        "data_parallel": None,
    },
    "Engine": {"kind": "engine", "doctor": None, "named_weights": None, "weight_receiver": None},
    "Teacher": {"kind": "teacher"},
    "Transport": {"kind": "transport"},
    "Tracker": {"kind": "tracker", "receives": (), "preflight": None},
    "ChatParser": {"kind": "chat_parser"},
    "ModelBuilder": {"kind": "model_builder"},
    "RunService": {"kind": "service", "metrics": None, "share": None, "finish": None},
}


def _hook_contract(name: str):
    from loongsage.core import contracts

    hook = hookspecs.HOOKS[name]
    return None if hook.category == hookspecs.BACKEND else contracts.HOOKS[hook.category]


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_each_hook_names_its_contract(name: str) -> None:
    """The spec is the contract: every hookspec points at the Protocol its entries implement."""
    from loongsage.core import contracts

    doc = inspect.getdoc(getattr(hookspecs, name))
    if name == "loongsage_backends":
        for protocol in (*contracts.BACKENDS.values(), contracts.Critic):
            assert f"contracts.{protocol.__name__}`" in doc, protocol.__name__
        return
    assert _hook_contract(name).__name__ == hookspecs.HOOKS[name].contract
    assert f":class:`loongsage.core.contracts.{_hook_contract(name).__name__}`" in doc


def test_contract_signatures_are_pinned() -> None:
    from loongsage.core import contract_check, contracts

    protocols = {p.__name__: p for p in (*contracts.HOOKS.values(), *contracts.BACKENDS.values())}
    assert set(protocols) == set(CONTRACT_CALLS)
    for name, calls in CONTRACT_CALLS.items():
        methods = {
            m.name: tuple(m.signature.parameters) for m in contract_check.members(protocols[name]) if m.role == "method"
        }
        assert methods == calls, name
        assert contract_check.flags(protocols[name]) == CONTRACT_FLAGS.get(name, {}), name
