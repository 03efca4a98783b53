"""Entries made from pure functions by ``loongsage.core.entries.entry``: params, flags, calls, errors."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import pickle
from typing import Annotated, Literal

import pluggy
import pytest
import torch
from torch import Tensor

from loongsage.core import contract_check, hookspecs
from loongsage.core.contracts import AdvantageEstimator, Correction, DataFilter, KLEstimator, PolicyLoss
from loongsage.core.entries import Range, entry
from loongsage.core.schema import check_params, describe_params, ranged
from loongsage.core.types import AdvantageInput, ConfigError, CorrectionOutput, LossOutput, PolicyLossInput


def scaled_loss(
    logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    scale: Annotated[float, Range(gt=0)] = 1.0,
    mode: Literal["plain", "negated"] = "plain",
    floor: Annotated[float | None, Range(ge=0, note="null = off")] = None,
) -> LossOutput:
    """``-scale * A * logprobs`` on the response tokens (negated: the opposite sign)."""
    loss = -scale * advantages * logprobs * response_mask
    if floor is not None:
        loss = loss.clamp(min=floor)
    return LossOutput(loss=-loss if mode == "negated" else loss)


@entry("scaled", scaled_loss, needs_old_logprobs=False)
class Scaled(PolicyLoss):
    """``scaled``: a loss of the tests."""


def _loss_input() -> PolicyLossInput:
    g = torch.Generator().manual_seed(0)
    lp, adv = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    return PolicyLossInput(lp, torch.zeros(2, 3), adv, torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


def test_the_function_keyword_parameters_are_the_params_of_a_frozen_dataclass() -> None:
    assert dataclasses.is_dataclass(Scaled) and Scaled.__dataclass_params__.frozen
    assert [f.name for f in dataclasses.fields(Scaled)] == ["scale", "mode", "floor"]
    assert list(inspect.signature(Scaled).parameters) == ["scale", "mode", "floor"]
    assert Scaled() == Scaled(scale=1.0, mode="plain", floor=None)
    assert Scaled.name == "scaled" and Scaled.needs_old_logprobs is False
    assert Scaled.__doc__ == "``scaled``: a loss of the tests."
    assert describe_params(Scaled) == (
        "scale: float = 1.0 [must be > 0], mode: 'plain' | 'negated' = 'plain', "
        "floor: float | null = None [must be >= 0 (null = off)]"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        Scaled().scale = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        Scaled(2.0)  # type: ignore[misc]  # params by name only


def test_the_call_gives_exactly_what_the_function_gives() -> None:
    inp = _loss_input()
    for params in ({}, {"scale": 0.5, "mode": "negated"}, {"floor": 0.1}):
        got = Scaled(**params)(inp)
        expected = scaled_loss(inp.logprobs, inp.advantages, inp.response_mask, **params)
        assert torch.equal(got.loss, expected.loss)
    assert (
        Scaled(scale=3.0)
        .apply(inp.logprobs, inp.advantages, inp.response_mask)
        .loss.equal(scaled_loss(inp.logprobs, inp.advantages, inp.response_mask, scale=3.0).loss)
    )
    assert scaled_loss(inp.logprobs, inp.advantages, inp.response_mask).loss.shape == (2, 3)  # still pure
    assert Scaled.__call__.__doc__ == scaled_loss.__doc__


def test_recipe_params_are_refused_in_one_line() -> None:
    assert check_params(Scaled, {"scale": 2, "floor": None}, "p") == {"scale": 2.0, "floor": None}
    for params, message in [
        ({"scale": 0}, "p.scale=0.0: must be > 0"),
        ({"floor": -1}, "p.floor=-1.0: must be >= 0 (null = off)"),
        ({"mode": "x"}, "p.mode: got 'x'; allowed: 'plain', 'negated'"),
        ({"scale": "big"}, "p.scale: got 'big'; expected a number"),
        ({"clip": 1}, "p.clip: unknown key; allowed: floor, mode, scale"),
    ]:
        with pytest.raises(ConfigError) as info:
            check_params(Scaled, params, "p")
        assert str(info.value) == message


def test_built_directly_an_entry_checks_ranges_and_literals_in_its_own_name() -> None:
    for params, message in [
        ({"scale": 0.0}, "scaled.scale=0.0: must be > 0"),
        ({"floor": -2.0}, "scaled.floor=-2.0: must be >= 0 (null = off)"),
        ({"mode": "x"}, "scaled.mode='x': allowed: 'plain', 'negated'"),
        ({"scale": float("nan")}, "scaled.scale=nan: must be > 0"),
    ]:
        with pytest.raises(ValueError) as info:
            Scaled(**params)
        assert str(info.value) == message


def test_the_entry_satisfies_its_contract_and_pickles() -> None:
    assert contract_check.check_class(Scaled, PolicyLoss) is None
    assert contract_check.check_object(Scaled(scale=2.0), PolicyLoss) is None
    assert str(inspect.signature(Scaled.__call__)) == "(self, inp, /)"
    again = pickle.loads(pickle.dumps(Scaled(scale=2.0, mode="negated")))
    assert again == Scaled(scale=2.0, mode="negated") and type(again) is Scaled


# ----------------------------------------------------------------------------- how the inputs are fed


def needs_values(
    rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    token_rewards: Tensor | None = None,
    gamma: Annotated[float, Range(ge=0, le=1)] = 1.0,
) -> Tensor:
    extra = 0.0 if token_rewards is None else token_rewards
    return (rewards[:, None] + gamma * values + extra) * response_mask


def value_targets(rewards: Tensor, values: Tensor, response_mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    return (rewards[:, None] + gamma * values) * response_mask


@entry("valued", needs_values, needs_values=True, uses_token_rewards=True, returns=value_targets)
class Valued(AdvantageEstimator):
    """``valued``: reads critic values and gives them their targets."""


def test_record_fields_feed_the_inputs_of_the_same_names_keyword_ones_included() -> None:
    inp = AdvantageInput(
        rewards=torch.tensor([1.0, 2.0]),
        group_ids=torch.zeros(2),
        response_mask=torch.ones(2, 2),
        token_rewards=torch.full((2, 2), 0.5),
        values=torch.full((2, 2), 3.0),
    )
    assert [f.name for f in dataclasses.fields(Valued)] == ["gamma"]  # token_rewards is an input, not a param
    assert torch.equal(
        Valued(gamma=0.5)(inp),
        needs_values(inp.rewards, inp.values, inp.response_mask, token_rewards=inp.token_rewards, gamma=0.5),
    )
    # an optional method given a pure function is fed the same way, with the params it takes
    assert torch.equal(
        Valued(gamma=0.5).returns(inp), value_targets(inp.rewards, inp.values, inp.response_mask, gamma=0.5)
    )
    assert contract_check.check_object(Valued(), AdvantageEstimator) is None
    # a field that may be None but that the function needs is refused in one line
    bare = AdvantageInput(rewards=torch.ones(1), group_ids=torch.zeros(1), response_mask=torch.ones(1, 2))
    for call in (Valued(), Valued().returns):
        with pytest.raises(ValueError, match=r"^valued: AdvantageInput\.values is None; valued needs it$"):
            call(bare)


def weighted(proximal: Tensor, behaviour: Tensor, response_mask: Tensor, *, cap: float = 2.0) -> CorrectionOutput:
    w = (proximal - behaviour).exp().clamp(max=cap)
    return CorrectionOutput(token_weights=w, response_mask=response_mask)


@entry("weighted", weighted, inputs={"proximal": "old_logprobs", "behaviour": "rollout_logprobs"})
class Weighted(Correction):
    """``weighted``: inputs named otherwise than the record's fields."""


def test_inputs_renames_a_function_parameter_to_a_record_field() -> None:
    from loongsage.core.types import CorrectionInput

    inp = CorrectionInput(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.0]]), torch.zeros(1, 2), torch.ones(1, 2))
    assert torch.equal(
        Weighted(cap=1.5)(inp).token_weights,
        weighted(inp.old_logprobs, inp.rollout_logprobs, inp.response_mask, cap=1.5).token_weights,
    )


def gap(student: Tensor, teacher: Tensor, *, power: Annotated[int, Range(ge=1)] = 1, part: bool = False) -> Tensor:
    out = (student - teacher).pow(power)
    return out if part else out.abs()


@entry("gap", gap, fixed={"part": False}, consumes="topk", partial=functools.partial(gap, part=True))
class Gap(KLEstimator):
    """``gap``: a divergence of the tests; ``k`` is a param the function does not take."""

    k: Annotated[int, Range(ge=1, note="teacher tokens")] = 4


def test_other_calls_pass_their_arguments_and_class_attributes_are_params_too() -> None:
    a, b = torch.tensor([1.0, -2.0]), torch.tensor([0.0, 1.0])
    assert [f.name for f in dataclasses.fields(Gap)] == ["power", "k"]  # fixed "part" is no param
    assert torch.equal(Gap(power=3)(a, b), gap(a, b, power=3))
    assert torch.equal(Gap(power=3).partial(a, b), gap(a, b, power=3, part=True))
    assert Gap().consumes == "topk" and Gap(k=8).k == 8
    assert contract_check.check_object(Gap(), KLEstimator) is None
    with pytest.raises(ValueError, match=r"^gap\.k=0: must be >= 1 \(teacher tokens\)$"):
        Gap(k=0)
    with pytest.raises(ConfigError, match=r"^p\.k=0: must be >= 1 \(teacher tokens\)$"):
        check_params(Gap, {"k": 0}, "p")


@entry("keep_some")
class KeepSome(DataFilter):
    """``keep_some``: no function bound; its logic stays in the class, its attributes are params."""

    at_least: Annotated[int, Range(ge=0)] = 1
    at_most: int | None = ranged(None, ge=1)  # the config dataclasses' way: the same checks

    def __post_init__(self) -> None:
        if self.at_least > 100:
            raise ValueError(f"keep_some.at_least={self.at_least}: too many")

    def __call__(self, group: list) -> bool:
        return len(group) >= self.at_least


def test_a_class_of_its_own_keeps_its_logic_and_runs_its_checks_after_the_ranges() -> None:
    assert KeepSome(at_least=2)([1, 2]) and not KeepSome(at_least=3)([1, 2])
    with pytest.raises(ValueError, match=r"^keep_some\.at_least=-1: must be >= 0$"):
        KeepSome(at_least=-1)
    with pytest.raises(ValueError, match=r"^keep_some\.at_least=101: too many$"):
        KeepSome(at_least=101)
    with pytest.raises(ValueError, match=r"^keep_some\.at_most=0: must be >= 1$"):
        KeepSome(at_most=0)
    with pytest.raises(ConfigError, match=r"^p\.at_most=0: must be >= 1$"):
        check_params(KeepSome, {"at_most": 0}, "p")
    assert KeepSome.excludes_from_loss is None and contract_check.check_object(KeepSome(), DataFilter) is None


# ----------------------------------------------------------------------------- mistakes, at decoration


def _decorate(*args, base: type = PolicyLoss, body: dict | None = None, **kwargs) -> type:
    return entry(*args, **kwargs)(type("Bad", (base,), {"__module__": __name__, **(body or {})}))


def test_mistakes_fail_when_the_class_is_decorated() -> None:
    with pytest.raises(TypeError, match=r"'needs_old_logprob' is no flag of PolicyLoss; its flags: needs_old_logprobs"):
        _decorate("bad", scaled_loss, needs_old_logprob=False)
    with pytest.raises(TypeError, match=r"^Bad \('bad'\): needs_old_logprobs='no': expected bool \(PolicyLoss"):
        _decorate("bad", scaled_loss, needs_old_logprobs="no")
    with pytest.raises(TypeError, match=r"subclasses the Protocol of its contract"):
        _decorate("bad", scaled_loss, base=object)
    with pytest.raises(TypeError, match=r"fixed 'part' is no parameter of scaled_loss"):
        _decorate("bad", scaled_loss, fixed={"part": True})

    def odd(logprobs: Tensor, weights: Tensor) -> LossOutput:
        return LossOutput(loss=logprobs * weights)

    with pytest.raises(TypeError, match=r"input 'weights' of odd is no field of PolicyLossInput; rename it"):
        _decorate("bad", odd)
    with pytest.raises(TypeError, match=r"gap takes 2 input\(s\) \(student, teacher\); the call passes 1"):
        _decorate("bad", gap, base=DataFilter)
    with pytest.raises(TypeError, match=r"missing __call__\(group\) of DataFilter"):
        _decorate("bad", base=DataFilter)
    with pytest.raises(TypeError, match=r"'scale' is a parameter of scaled_loss already"):
        _decorate("bad", scaled_loss, body={"__annotations__": {"scale": float}, "scale": 2.0})


# ----------------------------------------------------------------------------- the shipped entries


def test_every_shipped_algorithm_is_named_as_it_is_registered() -> None:
    from loongsage.algos import plugin

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(plugin)
    seen = 0
    for hook in hookspecs.HOOK_NAMES:
        for mapping in getattr(pm.hook, hook)():
            for name, factory in mapping.items():
                assert factory.name == name, (hook, name)
                seen += 1
    assert seen == 28


def test_a_shipped_entry_through_the_registry(registry) -> None:
    with pytest.raises(ConfigError) as info:
        registry.create("policy_loss", {"name": "ppo_clip", "params": {"clip_low": 1.0}}, "algorithm.policy_loss")
    assert str(info.value) == "algorithm.policy_loss.params.clip_low=1.0: must be in [0, 1)"
    with pytest.raises(ConfigError) as info:
        registry.create("policy_loss", {"name": "ppo_clip", "params": {"clip": -1}}, "algorithm.policy_loss")
    assert str(info.value) == "algorithm.policy_loss.params.clip: unknown key; allowed: clip_c, clip_high, clip_low"
    built = registry.create("correction", {"name": "is", "params": {"low": 0, "level": "sequence"}}, "c")
    assert built.low == 0.0 and type(built.low) is float and built.level == "sequence"
    assert registry.create("kl", {"name": "low_var_kl", "params": {"unbiased": True}}, "k").needs_old_logprobs
