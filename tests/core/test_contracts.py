"""The contracts (core/contracts/) as the registry enforces them (core/contract_check.py): every entry
against its Protocol.

A plugin that misses a member, whose method cannot take the contract's call or whose capability
flag has the wrong type is refused in one line naming the entry, its provider and the member;
flags an entry leaves out get their defaults, so the framework reads them directly.
"""

from __future__ import annotations

import inspect

import pytest

from loongsage.core import contract_check, contracts
from loongsage.core.contracts import BACKENDS, HOOKS, Critic, LossFunction
from loongsage.core.hookspecs import CATEGORIES
from loongsage.core.loss import LossPlan, ValueLoss
from loongsage.core.plugins import BACKEND_KINDS, load_registry
from loongsage.core.types import ConfigError

BUILTIN = "loongsage-core (built-in)"


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, f"error spans several lines: {text!r}"
    return text


def load_error(module: str, category: str = "advantage") -> str:
    with pytest.raises(ConfigError) as exc:
        load_registry([module]).names(category)  # the tables are built (and checked) on first use
    return one_line(exc)


# ----------------------------------------------------------------------------- refused at load
def test_missing_member_is_refused_at_load_naming_entry_provider_and_member(plugin_module) -> None:
    mod = plugin_module(
        """
        @dataclass(frozen=True)
        class NoCall:
            scale: float = 1.0

            def estimate(self, inp):  # not what the framework calls
                return inp.rewards

        @hookimpl
        def loongsage_advantage_estimators():
            return {"my_adv": NoCall}
        """
    )
    assert load_error(mod) == (
        f"advantage 'my_adv' (from config plugins: {mod}): missing __call__(inp) of AdvantageEstimator"
    )


def test_a_protocol_subclass_does_not_satisfy_it_with_the_protocols_stub(plugin_module) -> None:
    mod = plugin_module(
        """
        from loongsage.core.contracts import Tracker

        class HalfTracker(Tracker):  # inherits the flags' defaults, but close() is only the stub
            def log(self, step, metrics):
                pass

        @hookimpl
        def loongsage_backends():
            return {"half": HalfTracker}
        """
    )
    assert load_error(mod, "tracker") == f"tracker 'half' (from config plugins: {mod}): missing close() of Tracker"


@pytest.mark.parametrize(
    ("declaration", "expected"),
    [
        ('needs_values: ClassVar[bool] = "yes"', "needs_values='yes': expected bool (AdvantageEstimator.needs_values)"),
        ("needs_values = 1", "needs_values=1: expected bool (AdvantageEstimator.needs_values)"),
        ("uses_token_rewards = None", "uses_token_rewards=None: expected bool (AdvantageEstimator.uses_token_rewards)"),
    ],
)
def test_capability_flag_of_wrong_type_is_refused_at_load(plugin_module, declaration, expected) -> None:
    mod = plugin_module(
        f"""
        @dataclass(frozen=True)
        class Flagged:
            {declaration}

            def __call__(self, inp):
                return inp.response_mask

        @hookimpl
        def loongsage_advantage_estimators():
            return {{"flagged": Flagged}}
        """
    )
    assert load_error(mod) == f"advantage 'flagged' (from config plugins: {mod}): {expected}"


def test_flag_values_outside_a_literal_and_tuples_of_the_wrong_shape(plugin_module) -> None:
    mod = plugin_module(
        """
        class FullKL:
            consumes = "full"

            def __call__(self, logprobs, ref_logprobs):
                return logprobs - ref_logprobs

        @hookimpl
        def loongsage_kl_estimators():
            return {"full_kl": FullKL}
        """
    )
    assert load_error(mod, "kl") == (
        f"kl 'full_kl' (from config plugins: {mod}): consumes='full': expected one of "
        "'logprobs', 'topk', 'full_vocab' (KLEstimator.consumes)"
    )
    mod = plugin_module(
        """
        class SeqOnly:
            supported_aggregations = "seq-mean-token-mean"  # a string, not a tuple of them

            def __call__(self, inp):
                return None

        @hookimpl
        def loongsage_policy_losses():
            return {"seq_only": SeqOnly}
        """
    )
    msg = load_error(mod, "policy_loss")
    assert msg.startswith(f"policy_loss 'seq_only' (from config plugins: {mod}): supported_aggregations=")
    assert msg.endswith("expected tuple[str, ...] | None (PolicyLoss.supported_aggregations)")


def test_a_method_that_cannot_take_the_contracts_call(plugin_module) -> None:
    mod = plugin_module(
        """
        class Scorer:
            def __call__(self, trajectory):  # the framework passes (trajectory, record)
                return 1.0

        @hookimpl
        def loongsage_rewards():
            return {"scorer": Scorer}
        """
    )
    assert load_error(mod, "reward") == (
        f"reward 'scorer' (from config plugins: {mod}): __call__(trajectory) "
        "does not take __call__(trajectory, record) of Reward"
    )


def test_a_member_a_flag_asks_for(plugin_module) -> None:
    """needs_values: the estimator also gives the critic its targets (``returns``)."""
    mod = plugin_module(
        """
        class Valued:
            needs_values = True

            def __call__(self, inp):
                return inp.values

        @hookimpl
        def loongsage_advantage_estimators():
            return {"valued": Valued}
        """
    )
    assert load_error(mod) == (
        f"advantage 'valued' (from config plugins: {mod}): missing returns(AdvantageInput) "
        "of AdvantageEstimator (needs_values=True)"
    )


def test_a_wrong_member_fails_the_whole_table_like_a_duplicate(plugin_module) -> None:
    """Refused at load, whatever the recipe selects: ``loongsage plugins`` names it too."""
    from loongsage.core import cli

    mod = plugin_module(
        """
        class Quiet:
            kind = "tracker"

            def log(self, step, metrics):
                pass

        @hookimpl
        def loongsage_backends():
            return {"quiet": Quiet}
        """
    )
    assert load_error(mod, "advantage").endswith("missing close() of Tracker")
    assert cli.main(["plugins", "--plugin", mod]) == 2


# ----------------------------------------------------------------------------- defaults and creation
def test_flags_left_out_get_their_defaults_and_are_read_directly(plugin_module) -> None:
    mod = plugin_module(
        """
        @dataclass(frozen=True)
        class Plain:
            scale: float = 1.0

            def __call__(self, inp):
                return inp.response_mask * self.scale

        class Keep:
            def __call__(self, group):
                return True

        @hookimpl
        def loongsage_advantage_estimators():
            return {"plain": Plain}

        @hookimpl
        def loongsage_data_filters():
            return {"keep": Keep}
        """
    )
    reg = load_registry([mod])
    plain = reg.create("advantage", {"name": "plain", "params": {"scale": 2.0}}, "algorithm.advantage")
    assert plain.needs_values is False and plain.uses_token_rewards is False and plain.returns is None
    assert reg.entry("advantage", "plain").factory.needs_values is False  # set on the class at load
    keep = reg.create("data_filter", {"name": "keep"}, "algorithm.filters[0]")
    assert keep.excludes_from_loss is None and keep([]) is True


def test_a_factory_function_is_checked_on_what_it_builds(plugin_module) -> None:
    mod = plugin_module(
        """
        class _Printer:
            def log(self, step, metrics):
                pass

        def printer(run_dir: str):  # a function factory: nothing to check until it builds
            return _Printer()

        def rloo_like(scale: float = 1.0):
            def estimate(inp):
                return inp.response_mask * scale
            return estimate

        printer.kind = "tracker"

        @hookimpl
        def loongsage_backends():
            return {"printer": printer}

        @hookimpl
        def loongsage_advantage_estimators():
            return {"fn_adv": rloo_like}
        """
    )
    reg = load_registry([mod])
    assert reg.names("tracker")  # loads: a function's product is unknown until it is built
    with pytest.raises(ConfigError) as exc:
        reg.create("tracker", {"name": "printer"}, "tracking.backends[0]", run_dir="/nowhere")
    assert one_line(exc) == (
        f"tracking.backends[0]: tracker 'printer' (from config plugins: {mod}): missing close() of Tracker"
    )
    estimate = reg.create("advantage", {"name": "fn_adv", "params": {"scale": 3.0}}, "algorithm.advantage")
    assert estimate.needs_values is False and estimate.uses_token_rewards is False  # set on the function
    assert reg.entry("advantage", "fn_adv").preflight is None


def test_a_flag_that_follows_the_params_is_judged_when_built(plugin_module) -> None:
    mod = plugin_module(
        """
        @dataclass(frozen=True)
        class Switch:
            unbiased: bool = False

            @property
            def needs_old_logprobs(self):
                return "yes" if self.unbiased else False

            def __call__(self, logprobs, ref_logprobs, *, old_logprobs=None):
                return logprobs - ref_logprobs

        @dataclass(frozen=True)
        class TopK:
            consumes: ClassVar[str] = "topk"

            def __call__(self, logprobs, ref_logprobs):
                return (logprobs - ref_logprobs).sum(-1)

        @hookimpl
        def loongsage_kl_estimators():
            return {"switch": Switch, "topk_no_k": TopK}
        """
    )
    reg = load_registry([mod])
    assert reg.create("kl", {"name": "switch"}, "algorithm.kl").needs_old_logprobs is False
    with pytest.raises(ConfigError) as exc:
        reg.create("kl", {"name": "switch", "params": {"unbiased": True}}, "algorithm.kl")
    assert one_line(exc) == (
        f"algorithm.kl: kl 'switch' (from config plugins: {mod}): needs_old_logprobs='yes': "
        "expected bool (KLEstimator.needs_old_logprobs)"
    )
    with pytest.raises(ConfigError) as exc:
        reg.create("kl", {"name": "topk_no_k"}, "algorithm.distill.divergence")
    assert one_line(exc).endswith("missing k: int of KLEstimator (consumes='topk')")


def test_a_role_may_ask_for_more_than_the_category(plugin_module) -> None:
    """A trainer used as the critic must give values (the Critic contract)."""
    mod = plugin_module(
        """
        @dataclass
        class Fake:
            kind: ClassVar[str] = "trainer"
            model_path: str
            dtype: str = "float32"
            fp32_lm_head: bool = True

            def setup_optimizer(self, lr, betas, eps, weight_decay, grad_clip, warmup_steps): ...
            def logprobs(self, batch, token_budget): ...
            def reference_logprobs(self, batch, token_budget): ...
            def train_step(self, mini_batch, loss_fn, token_budget): ...
            def export_weights(self): ...
            def save(self, path): ...
            def load(self, path): ...
            def export_hf(self, path, tokenizer): ...
            def offload(self, weights=True): ...
            def onload(self): ...
            def param_checksum(self): return 0.0

        @hookimpl
        def loongsage_backends():
            return {"fake": Fake}
        """
    )
    reg = load_registry([mod])
    supplied = {"model_path": "/m", "dtype": "float32", "fp32_lm_head": True}
    trainer = reg.create("trainer", {"name": "fake"}, "trainer.backend", **supplied)
    assert trainer.holds_reference is False and trainer.supports_lora is False and trainer.preflight is None
    expected = (
        f"trainer.critic.backend: trainer 'fake' (from config plugins: {mod}): "
        "missing values(batch, token_budget) of Critic"
    )
    with pytest.raises(ConfigError) as exc:
        reg.create("trainer", {"name": "fake"}, "trainer.critic.backend", contract=Critic, **supplied)
    assert one_line(exc) == expected
    with pytest.raises(ConfigError) as exc:  # at config validation, before anything is built
        reg.check("trainer", {"name": "fake"}, "trainer.critic.backend", skip=tuple(supplied), contract=Critic)
    assert one_line(exc) == expected
    assert (
        reg.check("trainer", {"name": "torch_critic"}, "trainer.critic.backend", skip=tuple(supplied), contract=Critic)
        == {}
    )


def test_a_factory_functions_flags_read_before_it_builds_are_its_own_attributes(plugin_module) -> None:
    """kind, preflight and receives are read off the factory: a function declares them as attributes."""
    mod = plugin_module(
        """
        class _Printer:
            def log(self, step, metrics): pass
            def close(self): pass

        def printer(run_name: str):
            return _Printer()

        printer.kind = "tracker"
        printer.receives = ("run_name",)

        def plain(run_dir: str):
            return _Printer()

        plain.kind = "tracker"

        def wrong(run_dir: str):
            return _Printer()

        wrong.kind = "tracker"
        wrong.receives = ("run_dir", "the_weather")

        @hookimpl
        def loongsage_backends():
            return {"printer": printer, "plain": plain}
        """
    )
    reg = load_registry([mod])
    printer, plain = reg.entry("tracker", "printer").factory, reg.entry("tracker", "plain").factory
    assert printer.receives == ("run_name",) and printer.preflight is None
    assert plain.receives == () and plain.preflight is None and reg.entry("tracker", "plain").preflight is None
    bad = plugin_module(
        f"""
        from {mod} import wrong

        @hookimpl
        def loongsage_backends():
            return {{"wrong": wrong}}
        """
    )
    msg = load_error(bad, "tracker")
    assert msg.startswith(
        f"tracker 'wrong' (from config plugins: {bad}): receives=('run_dir', 'the_weather'): expected "
    )
    assert msg.endswith("(Tracker.receives)")


def test_a_backend_function_without_a_kind_is_refused_naming_the_kinds(plugin_module) -> None:
    mod = plugin_module(
        """
        def engine(model_path: str):
            return None

        @hookimpl
        def loongsage_backends():
            return {"kindless": engine}
        """
    )
    msg = load_error(mod, "engine")
    assert msg == f"backend 'kindless' from config plugins: {mod}: kind None is not one of {', '.join(BACKEND_KINDS)}"


def test_a_reward_takes_the_context_when_it_declares_so(plugin_module) -> None:
    import asyncio

    from loongsage.core.contracts import RewardContext
    from loongsage.core.rewarding import call_reward
    from loongsage.core.types import DataRecord, Trajectory

    mod = plugin_module(
        """
        class Plain:
            def __call__(self, trajectory, record, ctx="never passed"):
                return ctx

        class WithContext:
            takes_context = True

            async def __call__(self, trajectory, record, ctx):
                return ctx

        @hookimpl
        def loongsage_rewards():
            return {"plain": Plain, "with_context": WithContext}
        """
    )
    reg = load_registry([mod])
    plain = reg.create("reward", {"name": "plain"}, "data_sources[0].reward")
    with_context = reg.create("reward", {"name": "with_context"}, "data_sources[0].reward")
    assert plain.takes_context is False and with_context.takes_context is True
    trajectory, record = Trajectory.__new__(Trajectory), DataRecord.__new__(DataRecord)
    ctx = RewardContext(services={"sandboxes": "handle"})
    assert call_reward(plain, trajectory, record, ctx) == "never passed"  # a parameter named ctx is no declaration
    assert asyncio.run(call_reward(with_context, trajectory, record, ctx)) is ctx
    assert asyncio.run(call_reward(with_context, trajectory, record, None)) == RewardContext(services={})
    forgets = plugin_module(
        """
        class Forgets:
            takes_context = True

            def __call__(self, trajectory, record):
                return 1.0

        @hookimpl
        def loongsage_rewards():
            return {"forgets": Forgets}
        """
    )
    assert load_error(forgets, "reward") == (
        f"reward 'forgets' (from config plugins: {forgets}): __call__(trajectory, "
        "record) does not take __call__(trajectory, record, *, ctx) of Reward "
        "(takes_context=True)"
    )


def test_a_sandbox_backends_close_is_an_optional_method(registry, plugin_module) -> None:
    assert registry.entry("sandbox", "local").factory.close is not None  # loongsage-sandbox's backends offer it
    mod = plugin_module(
        """
        class Bare:
            async def create(self, owner, deadline): return "s"
            async def exec(self, sandbox_id, cmd, timeout): return None
            async def put(self, sandbox_id, path, data): pass
            async def get(self, sandbox_id, path): return b""
            async def delete(self, sandbox_id): pass

        class Closing(Bare):
            def close(self, everything):  # the pool calls close()
                pass

        @hookimpl
        def loongsage_sandboxes():
            return {"bare": Bare}
        """
    )
    reg = load_registry([mod])
    assert reg.create("sandbox", {"name": "bare"}, "services.sandboxes.params.backend").close is None
    from loongsage.core.contracts import Sandbox

    closing = __import__(mod).Closing
    assert contract_check.check_object(closing(), Sandbox) == ("close(everything) does not take close() of Sandbox")


# ----------------------------------------------------------------------------- the built-ins
def test_the_tables_cover_every_category_and_kind() -> None:
    assert set(HOOKS) == set(CATEGORIES)
    assert tuple(BACKENDS) == BACKEND_KINDS
    for kind, protocol in BACKENDS.items():
        assert contract_check.flags(protocol)["kind"] == kind


def _cheap(factory):
    """An entry built from its defaults, or None when it needs params or refuses (a renamed alias)."""
    try:
        return factory()
    except (TypeError, ValueError):
        return None


def test_every_builtin_entry_satisfies_its_protocol(registry) -> None:
    built = 0
    for category, table in registry.tables.items():
        protocol = HOOKS[category] if category in HOOKS else BACKENDS[category]
        for name, entry in table.items():
            assert entry.contract is protocol, (category, name)
            if not entry.provider.startswith(("loongsage-core", "loongsage-algos")):
                continue  # only what this workspace ships
            assert inspect.isclass(entry.factory), f"{category} {name!r}: built-ins are classes"
            assert contract_check.check_class(entry.factory, protocol) is None, (category, name)
            if category in BACKENDS:
                continue  # backends load models or open files: their classes are checked above
            obj = _cheap(entry.factory)
            if obj is not None:
                assert contract_check.check_object(obj, protocol) is None, (category, name)
                built += 1
    assert built >= 25  # every algorithm, agent, scheduler and most rewards were built and checked
    assert contract_check.check_class(registry.entry("trainer", "torch_critic").factory, Critic) is None
    assert contract_check.check_class(registry.entry("trainer", "torch").factory, Critic) is not None  # no values


def test_builtin_flags_as_the_framework_reads_them(registry) -> None:
    advantage = {n: registry.entry("advantage", n).factory for n in registry.names("advantage")}
    assert advantage["gae"].needs_values and advantage["gae"].returns is not None
    assert not advantage["grpo"].needs_values and advantage["grpo"].returns is None
    kl = {n: registry.entry("kl", n).factory for n in registry.names("kl")}
    assert {n: f.consumes for n, f in kl.items() if f.consumes != "logprobs"} == {
        "topk_kl": "topk",
        "topk_jsd": "topk",
        "full_vocab_kl": "full_vocab",
        "jsd": "full_vocab",
    }
    assert registry.create("kl", {"name": "k3", "params": {"unbiased": True}}, "k").needs_old_logprobs is True
    filters = {n: registry.entry("data_filter", n).factory for n in registry.names("data_filter")}
    assert [n for n, f in filters.items() if f.excludes_from_loss is not None] == ["overlong"]
    assert registry.entry("trainer", "torch").preflight is not None
    assert (
        registry.entry("tracker", "wandb").preflight is not None
        and registry.entry("tracker", "jsonl").preflight is None
    )
    assert registry.entry("trainer", "torch").factory.supports_lora is True
    assert registry.entry("trainer", "torch_critic").factory.supports_lora is False


def test_loss_functions() -> None:
    """What a trainer's train_step is handed: the framework's losses declare what they read."""
    from loongsage.algos.divergences import TopKKL
    from loongsage.algos.policy_losses import PPOClip

    assert isinstance(LossPlan(policy_loss=PPOClip()).closure(), LossFunction)
    assert LossPlan(policy_loss=PPOClip()).closure().needs_student_distribution is False
    assert LossPlan(policy_loss=PPOClip(), gkd_coef=1.0, divergence=TopKKL(k=2)).closure().needs_student_distribution
    assert isinstance(ValueLoss(), LossFunction) and ValueLoss().needs_student_distribution is False
    assert not isinstance(lambda lp, mb: (lp.sum(), {}), LossFunction)  # a bare callable: no student_dist
    assert contract_check.check_object(ValueLoss(), LossFunction) is None


def test_members_are_read_from_the_protocols() -> None:
    roles = {m.name: m.role for m in contract_check.members(contracts.KLEstimator)}
    assert roles == {
        "consumes": "flag",
        "needs_old_logprobs": "flag",
        "k": "attribute",
        "partial": "flag",
        "__call__": "method",
    }
    flags = contract_check.flags(contracts.Trainer)
    assert flags == {
        "kind": "trainer",
        "supports_lora": False,
        "holds_reference": False,
        "preflight": None,
        "doctor": None,
        "add_teacher": None,
        "data_parallel": None,
    }
    critic = {m.name for m in contract_check.members(Critic)}
    assert critic == {m.name for m in contract_check.members(contracts.Trainer)} | {"values"}
    for protocol in (*HOOKS.values(), *BACKENDS.values(), Critic, LossFunction):
        doc = inspect.getdoc(protocol) or ""
        where = ("driver", "actor", "trainer rank", "gateway", "worker")
        assert any(w in doc for w in where), f"{protocol.__name__}: say in which process it runs"
        assert "once" in doc or "per " in doc, f"{protocol.__name__}: say how often it is called"
