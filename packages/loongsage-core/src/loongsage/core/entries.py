"""Registry entries made from pure functions: params, flags and the contract's call in one decorator.

An algorithm is best written as a pure function whose leading parameters are its inputs and whose
keyword parameters are its settings, with each setting's default and allowed range written once,
in the signature::

    def ppo_clip_loss(logprobs, old_logprobs, advantages, response_mask, *,
                      clip_low: Annotated[float, Range(ge=0, lt=1)] = 0.2, ...) -> LossOutput:

:func:`entry` turns such a function into what a hook registers: the class it decorates (named,
documented, subclassing its contract's Protocol) becomes a frozen dataclass whose fields are the
function's settings, so the registry validates a recipe's ``params`` against them like any
dataclass (:func:`loongsage.core.schema.check_params`: ``...params.clip_low=1.0: must be in [0,
1)``), and whose ``__call__`` is the contract's call feeding the function::

    @entry("ppo_clip", ppo_clip_loss, needs_old_logprobs=True)
    class PPOClip(PolicyLoss):
        '''``ppo_clip``: PPO clip with asymmetric bounds (DAPO: 0.2 / 0.28) and optional dual clip.'''

How the call reaches the function's inputs:

* a contract called with one record (``AdvantageInput``, ``PolicyLossInput``, ``CorrectionInput``)
  when the function's inputs are named after the record's fields: each input gets its field
  (``inputs={"proximal_logprobs": "old_logprobs"}`` renames); a keyword parameter named after a
  field is an input too (``token_rewards``). A field that may be None but that the function
  requires is refused in one line when it is None;
* any other call: its arguments are passed as they are to the function's leading parameters
  without defaults (a KL estimator's ``(logprobs, ref_logprobs)``).

Every other parameter of the function is a param of the entry, except those ``fixed`` names
(always passed with the given value). Annotated attributes of the decorated class are params the
function does not take (a divergence's ``k``, what the framework fetches for it); a ``Range`` in
``Annotated`` bounds them as it bounds the function's (so does :func:`loongsage.core.schema.ranged`).

Flags (``needs_old_logprobs``, ``consumes``, ...) are the decorator's keyword arguments, checked
against the contract's flags. An optional method of the contract (``returns``,
``excludes_from_loss``, ``partial``) may be given a pure function: it is fed like ``__call__``,
with those of the entry's params it takes.

Logic beyond binding stays in the class body, which the decorator keeps: a flag that follows the
params (a property), checks across params or of a value's content (``__post_init__``, run after
the range checks), or a ``__call__`` of its own, which then reaches the function with this
entry's params through :meth:`apply`. A class that binds no function (``entry(name)``) still gets
its attributes as validated params, its flags and its name.

Built directly (``PPOClip(clip_low=1.0)``) an entry checks ranges and ``Literal`` values too, in
the entry's own words: ``ppo_clip.clip_low=1.0: must be in [0, 1)``. The class is checked against
its contract when it is decorated (:func:`loongsage.core.contract_check.check_class`), so a
mistake fails at import, not at the run's first step.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Literal, Union

from loongsage.core import contract_check
from loongsage.core.schema import RANGE, Range, check_range

__all__ = ["Range", "entry"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@dataclasses.dataclass(frozen=True)
class _Param:
    """One param of an entry: its type (``Annotated`` removed), its default and its range."""

    name: str
    type: Any
    default: Any = dataclasses.MISSING
    range: Range | None = None


def _split(hint: Any) -> tuple[Any, Range | None]:
    """``Annotated[T, Range(...)]`` -> ``(T, Range)``; anything else -> ``(hint, None)``."""
    if typing.get_origin(hint) is Annotated:
        ranges = [m for m in hint.__metadata__ if isinstance(m, Range)]
        return hint.__origin__, ranges[0] if ranges else None
    return hint, None


def _literal(tp: Any) -> tuple[tuple[Any, ...], bool] | None:
    """The allowed values of a ``Literal`` type (or ``Literal | None``) and whether None is allowed."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp), False
    if typing.get_origin(tp) in (Union, types.UnionType):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) == 1 and typing.get_origin(arms[0]) is Literal:
            return typing.get_args(arms[0]), True
    return None


def _callable_args(tp: Any) -> tuple[Any, ...] | None:
    """The argument types of an optional method's ``Callable[[A, ...], R] | None``; None for ``...``."""
    arms = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    for arm in arms:
        if typing.get_origin(arm) is collections.abc.Callable:
            args = typing.get_args(arm)[0]
            return None if args is Ellipsis else tuple(args)
    return None


@dataclasses.dataclass(frozen=True)
class _Feed:
    """How one of an entry's calls reaches its pure function (see the module docstring)."""

    fn: Callable[..., Any]
    record: type | None  # the record unpacked into the inputs; None: the call's arguments as they are
    call_names: tuple[str, ...]  # the call's parameters (its signature)
    positional: tuple[str, ...] = ()  # record fields, passed positionally
    keyword: tuple[tuple[str, str], ...] = ()  # (function parameter, record field), passed by keyword
    required: tuple[str, ...] = ()  # record fields that may be None but that the function needs
    params: tuple[str, ...] = ()  # the entry's params the function takes
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def method(self, entry_name: str, cls: type, attr: str) -> Callable[..., Any]:
        """The method ``cls.<attr>`` that calls the function: ``(self, *call) -> fn(inputs..., **params)``."""
        feed = self

        def call(entry: Any, *args: Any) -> Any:
            kwargs = {p: getattr(entry, p) for p in feed.params}
            kwargs.update(feed.fixed)
            if feed.record is None:
                return feed.fn(*args, **kwargs)
            (record,) = args
            for field in feed.required:
                if getattr(record, field) is None:
                    raise ValueError(f"{entry_name}: {type(record).__name__}.{field} is None; {entry_name} needs it")
            inputs = [getattr(record, f) for f in feed.positional]
            kwargs.update({arg: getattr(record, f) for arg, f in feed.keyword})
            return feed.fn(*inputs, **kwargs)

        names = ("self", *self.call_names)
        call.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in names]
        )
        call.__doc__ = self.fn.__doc__
        call.__name__, call.__qualname__ = attr, f"{cls.__qualname__}.{attr}"
        return call


def _feed(
    fn: Callable[..., Any],
    arg_types: tuple[Any, ...] | None,
    arg_names: tuple[str, ...] | None,
    inputs: Mapping[str, str],
    *,
    where: str,
) -> tuple[_Feed, list[inspect.Parameter]]:
    """How a call with arguments of ``arg_types`` (None: unknown) feeds ``fn``, and ``fn``'s other
    parameters (the candidates for params)."""
    sig = inspect.signature(fn)
    parameters = list(sig.parameters.values())
    record = arg_types[0] if arg_types is not None and len(arg_types) == 1 else None
    fields: dict[str, dataclasses.Field] = (
        {f.name: f for f in dataclasses.fields(record)} if dataclasses.is_dataclass(record) else {}
    )
    first = parameters[0].name if parameters else None
    if fields and first is not None and inputs.get(first, first) in fields:
        positional: list[str] = []
        keyword: list[tuple[str, str]] = []
        required: list[str] = []
        rest = []
        for p in parameters:
            field = inputs.get(p.name, p.name)
            if field not in fields:
                if p.kind in _POSITIONAL and p.default is p.empty:
                    raise TypeError(
                        f"{where}: input {p.name!r} of {fn.__name__} is no field of "
                        f"{record.__name__}; rename it with inputs={{{p.name!r}: '<field>'}}"
                    )
                rest.append(p)
                continue
            if p.kind in _POSITIONAL and not keyword and not rest:  # after a param, by name only
                positional.append(field)
            else:
                keyword.append((p.name, field))
            if p.default is p.empty and fields[field].default is None:
                required.append(field)
        names = arg_names or ("inp",)
        return _Feed(fn, record, names, tuple(positional), tuple(keyword), tuple(required)), rest
    leading = []
    for p in parameters:
        if p.kind not in _POSITIONAL or p.default is not p.empty:
            break
        leading.append(p)
    if arg_types is not None and len(leading) != len(arg_types):
        raise TypeError(
            f"{where}: {fn.__name__} takes {len(leading)} input(s) "
            f"({', '.join(p.name for p in leading)}); the call passes {len(arg_types)}"
        )
    return _Feed(fn, None, tuple(p.name for p in leading)), parameters[len(leading) :]


def _contract_of(cls: type) -> type:
    for klass in cls.__mro__[1:]:
        if getattr(klass, "_is_protocol", False) and klass is not typing.Protocol and klass is not typing.Generic:
            return klass
    raise TypeError(
        f"{cls.__qualname__}: an entry subclasses the Protocol of its contract "
        "(loongsage.core.contracts), e.g. class PPOClip(PolicyLoss)"
    )


def _defines(cls: type, name: str) -> bool:
    """Whether ``cls`` or a base other than a Protocol (a stub) or ``object`` defines ``name``."""
    return any(name in k.__dict__ for k in cls.__mro__ if k is not object and not getattr(k, "_is_protocol", False))


def _check_values(entry: Any, name: str, checks: list[tuple[str, Range | None, Any]]) -> None:
    """Ranges and ``Literal`` values of a directly built entry, as ``<name>.<param>=<value>: ...``."""
    for param, rng, literal in checks:
        value = getattr(entry, param)
        if rng is not None:
            check_range(value, rng, f"{name}.{param}")
        if literal is not None:
            allowed, optional = literal
            if not (value is None and optional) and value not in allowed:
                raise ValueError(f"{name}.{param}={value!r}: allowed: {', '.join(repr(a) for a in allowed)}")


def entry(
    name: str,
    fn: Callable[..., Any] | None = None,
    /,
    *,
    inputs: Mapping[str, str] | None = None,
    fixed: Mapping[str, Any] | None = None,
    **flags: Any,
) -> Callable[[type], type]:
    """Make the decorated class the registry entry ``name`` binding the pure function ``fn``.

    ``inputs``: ``{function parameter: record field}`` where the names differ; ``fixed``: arguments
    always passed to ``fn`` (not params); ``flags``: the contract's flags. See the module docstring.
    """
    inputs = dict(inputs or {})
    fixed = dict(fixed or {})

    def decorate(cls: type) -> type:
        where = f"{cls.__qualname__} ({name!r})"
        contract = _contract_of(cls)
        members = {m.name: m for m in contract_check.members(contract)}
        unknown = sorted(set(flags) - set(contract_check.flags(contract)))
        if unknown:
            known = ", ".join(contract_check.flags(contract)) or "(none)"
            raise TypeError(f"{where}: {unknown[0]!r} is no flag of {contract.__name__}; its flags: {known}")

        # The params: the function's settings first, then the class's own annotated attributes.
        params: dict[str, _Param] = {}
        call_feed = None
        if fn is not None:
            call = members["__call__"]
            try:
                hints = typing.get_type_hints(contract.__call__)
            except Exception:  # a contract's annotation that does not resolve: no record to unpack
                hints = {}
            required = [p for p in call.signature.parameters.values() if p.kind in _POSITIONAL and p.default is p.empty]
            call_feed, rest = _feed(
                fn,
                tuple(hints.get(p.name, Any) for p in required),
                tuple(p.name for p in required),
                inputs,
                where=where,
            )
            fn_hints = typing.get_type_hints(fn, include_extras=True)
            stray = sorted(set(fixed) - {p.name for p in rest})
            if stray:
                raise TypeError(f"{where}: fixed {stray[0]!r} is no parameter of {fn.__name__}")
            for p in rest:
                if p.name in fixed or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    continue
                tp, rng = _split(fn_hints.get(p.name, Any))
                default = dataclasses.MISSING if p.default is p.empty else p.default
                params[p.name] = _Param(p.name, tp, default, rng)
            call_feed = dataclasses.replace(call_feed, params=tuple(params), fixed=fixed)
        own = cls.__dict__.get("__annotations__", {})
        cls_hints = typing.get_type_hints(cls, include_extras=True) if own else {}
        annotations: dict[str, Any] = {p.name: p.type for p in params.values()}
        for attr in own:
            hint = cls_hints[attr]
            if typing.get_origin(hint) is ClassVar:
                annotations[attr] = hint
                continue
            if attr in params:
                raise TypeError(f"{where}: {attr!r} is a parameter of {fn.__name__} already")
            tp, rng = _split(hint)
            default = cls.__dict__.get(attr, dataclasses.MISSING)
            if isinstance(default, dataclasses.Field):  # e.g. schema.ranged(): its range is the param's
                if rng is not None:
                    raise TypeError(
                        f"{where}: {attr!r}: give its range once, in Annotated with a plain "
                        "default or with schema.ranged()"
                    )
                rng = default.metadata.get(RANGE)
            params[attr] = _Param(attr, tp, default, rng)
            annotations[attr] = tp
        for p in params.values():
            if isinstance(p.default, dataclasses.Field):
                continue  # a field already
            if p.range is not None:
                setattr(cls, p.name, dataclasses.field(default=p.default, metadata={RANGE: p.range}))
            elif p.default is not dataclasses.MISSING:
                setattr(cls, p.name, p.default)
        cls.__annotations__ = annotations

        checks = [
            (p.name, p.range, _literal(p.type))
            for p in params.values()
            if p.range is not None or _literal(p.type) is not None
        ]
        own_post_init = getattr(cls, "__post_init__", None)

        def __post_init__(self: Any) -> None:
            _check_values(self, name, checks)
            if own_post_init is not None:
                own_post_init(self)

        cls.__post_init__ = __post_init__
        cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
        cls.name = name

        if fn is not None:
            cls.apply = _apply(fn, call_feed)
            if not _defines(cls, "__call__"):
                cls.__call__ = call_feed.method(name, cls, "__call__")
        for flag, value in flags.items():
            member = members[flag]
            if member.optional_method and value is not None:
                feed, rest = _feed(value, _callable_args(member.type), None, inputs, where=f"{where}.{flag}")
                taken = tuple(p.name for p in rest if p.name in params)
                missing = [p.name for p in rest if p.name not in params and p.default is p.empty]
                if missing:
                    raise TypeError(f"{where}.{flag}: {missing[0]!r} is no param of the entry")
                value = dataclasses.replace(feed, params=taken).method(name, cls, flag)
            setattr(cls, flag, value)

        problem = contract_check.check_class(cls, contract)
        if problem is not None:
            raise TypeError(f"{where}: {problem}")
        return cls

    return decorate


def _apply(fn: Callable[..., Any], feed: _Feed) -> Callable[..., Any]:
    def apply(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        """The entry's function on ``inputs`` with this entry's params (for a ``__call__`` of its own)."""
        kwargs.update({p: getattr(self, p) for p in feed.params})
        kwargs.update(feed.fixed)
        return fn(*inputs, **kwargs)

    return apply
