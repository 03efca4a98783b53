"""How the registry checks an entry against its contract (:mod:`loongsage.core.contracts`).

* :func:`check_class`: a class factory when the registry loads it: every method present and
  callable as the Protocol calls it, every flag the class declares of the right type, every flag
  it leaves out set on the class to the Protocol's default;
* :func:`check_object`: what any factory builds, when it is built: the same, on the object (flags
  that depend on the entry's params, attributes set by ``__init__``), flags left out set to their
  default;
* :func:`check_factory`: a factory when the registry loads it, for the flags read before anything
  is built (:data:`~loongsage.core.contracts.FACTORY_FLAGS`): a class as :func:`check_class` does,
  a factory function on its own attributes, those it leaves out set to their defaults on it.

Each returns the first problem as one line (the registry prefixes the entry and its provider), or
None. :func:`members` and :func:`flags` read a Protocol as the checks see it.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal, Protocol

from loongsage.core.contracts import CALLED_WITH, REQUIRED_WHEN, When


@dataclass(frozen=True)
class Member:
    """One member of a Protocol, as the checker sees it."""

    name: str
    role: Literal["method", "flag", "attribute"]
    type: Any = Any  # flags and attributes: the declared type (ClassVar unwrapped)
    default: Any = None  # flags: the default
    class_level: bool = False  # flags: declared ClassVar (fixed per implementation)
    signature: inspect.Signature | None = None  # methods: without self

    @property
    def optional_method(self) -> bool:
        """A flag whose value is a method or None (``excludes_from_loss``, ``returns``)."""
        return self.role == "flag" and _callable_args(self.type) is not None

    def describe(self) -> str:
        if self.role == "method":
            return f"{self.name}{_plain(self.signature)}"
        args = _callable_args(self.type)
        if args is not None:
            return f"{self.name}({'...' if args is Ellipsis else ', '.join(_type_name(a) for a in args)})"
        return f"{self.name}: {_type_name(self.type)}"


_DUNDERS = ("__call__", "__len__", "__getitem__")
_INSTANCE_DESCRIPTORS = (property, functools.cached_property, types.MemberDescriptorType)


def _protocol_classes(protocol: type) -> list[type]:
    return [k for k in protocol.__mro__ if getattr(k, "_is_protocol", False) and k not in (Protocol, typing.Generic)]


@functools.cache
def members(protocol: type) -> tuple[Member, ...]:
    """The members of ``protocol`` (its Protocol bases included), in declaration order."""
    hints = typing.get_type_hints(protocol)
    found: dict[str, Member] = {}
    for klass in reversed(_protocol_classes(protocol)):
        for name in klass.__dict__.get("__annotations__", {}):
            hint = hints[name]
            class_level = typing.get_origin(hint) is ClassVar
            tp = typing.get_args(hint)[0] if class_level else hint
            if name in klass.__dict__:
                found[name] = Member(name, "flag", tp, klass.__dict__[name], class_level)
            else:
                found[name] = Member(name, "attribute", tp)
        for name, value in klass.__dict__.items():
            if name in found or not (name in _DUNDERS or not name.startswith("_")):
                continue
            if isinstance(value, property):
                found[name] = Member(name, "attribute", typing.get_type_hints(value.fget).get("return", Any))
            elif inspect.isfunction(value):
                sig = inspect.signature(value)
                found[name] = Member(
                    name, "method", signature=sig.replace(parameters=list(sig.parameters.values())[1:])
                )
    return tuple(found.values())


def flags(protocol: type) -> dict[str, Any]:
    """``{flag: default}`` of ``protocol``."""
    return {m.name: m.default for m in members(protocol) if m.role == "flag"}


def check_class(cls: type, protocol: type) -> str | None:
    """Check a class factory against ``protocol`` before anything is built; set the flags it leaves
    out to their defaults on the class. Returns the first problem as one line, or None.

    Methods are looked up on the class; attributes, and flags that are properties (they follow the
    params), can only be judged on a built object (:func:`check_object`).
    """
    for m in members(protocol):
        if m.role != "flag":
            continue
        owner = _owner(cls, m.name, protocols=True)
        if owner is None:
            try:
                setattr(cls, m.name, m.default)
            except (AttributeError, TypeError):
                return _undeclared(m)
        elif m.class_level or not isinstance(owner.__dict__[m.name], _INSTANCE_DESCRIPTORS):
            if (problem := _flag_problem(m, getattr(cls, m.name), protocol)) is not None:
                return problem
    for m in members(protocol):
        if m.role == "attribute":
            continue
        condition = REQUIRED_WHEN.get(protocol, {}).get(m.name)
        flag_value = _class_value(cls, condition.flag) if condition else None
        if condition is not None and (isinstance(flag_value, _INSTANCE_DESCRIPTORS) or not condition.holds(flag_value)):
            continue
        if m.role == "flag":
            if condition is not None and getattr(cls, m.name) is None:
                return _missing(m, protocol, condition, flag_value)
            continue
        if _owner(cls, m.name) is None:
            return _missing(m, protocol, condition, flag_value)
        impl = inspect.getattr_static(cls, m.name)
        if not callable(impl) and not isinstance(impl, (staticmethod, classmethod)):
            return f"{m.name}={_short(impl)} is not a method; {protocol.__name__} calls {m.describe()}"
        called, why = _as_called(m, protocol, lambda flag: _class_value(cls, flag))
        if inspect.isfunction(impl) and (problem := _call_problem(called, _signature(impl, bound=False), protocol)):
            return problem + why
    return None


def check_factory(factory: Any, protocol: type, names: tuple[str, ...]) -> str | None:
    """Check the flags ``names`` of ``protocol`` on ``factory`` (the ones the registry reads before
    it builds): a class entirely, as :func:`check_class`; a factory function on its attributes,
    each of the right type, those it leaves out set on it to their defaults. Returns the first
    problem as one line, or None."""
    if inspect.isclass(factory):
        return check_class(factory, protocol)
    for m in members(protocol):
        if m.role != "flag" or m.name not in names:
            continue
        if _owner_of(factory, m.name) is None:
            if (problem := _fill(factory, m)) is not None:
                return problem
        elif (problem := _flag_problem(m, getattr(factory, m.name), protocol)) is not None:
            return problem
    return None


def check_object(obj: Any, protocol: type) -> str | None:
    """Check a built object against ``protocol``; set the flags it leaves out to their defaults
    (on its class when it has one of its own, else on the object). Returns the first problem."""
    for m in members(protocol):
        if m.role != "flag":
            continue
        if _owner_of(obj, m.name) is None:
            if (problem := _fill(obj, m)) is not None:
                return problem
        elif (problem := _flag_problem(m, getattr(obj, m.name), protocol)) is not None:
            return problem
    for m in members(protocol):
        condition = REQUIRED_WHEN.get(protocol, {}).get(m.name)
        flag_value = getattr(obj, condition.flag) if condition else None
        if condition is not None and not condition.holds(flag_value):
            continue
        if m.role == "flag":
            value = getattr(obj, m.name)
            if condition is not None and value is None:
                return _missing(m, protocol, condition, flag_value)
            if m.optional_method and value is not None and (problem := _call_problem(m, _signature(value), protocol)):
                return problem
            continue
        if _owner_of(obj, m.name, stubs=False) is None and not _dynamic(obj, m.name):
            return _missing(m, protocol, condition, flag_value)
        value = getattr(obj, m.name)
        if m.role == "attribute":
            if not _conforms(value, m.type):
                return f"{m.name}={_short(value)}: expected {_type_name(m.type)} ({protocol.__name__}.{m.name})"
        elif not callable(value):
            return f"{m.name}={_short(value)} is not a method; {protocol.__name__} calls {m.describe()}"
        else:
            called, why = _as_called(m, protocol, lambda flag: getattr(obj, flag))
            if problem := _call_problem(called, _signature(obj if m.name == "__call__" else value), protocol):
                return problem + why
    return None


def _owner(cls: type, name: str, *, protocols: bool = False) -> type | None:
    """The first class of ``cls``'s MRO that defines ``name``; None if none does or, unless
    ``protocols`` (flags: a Protocol's default counts), if that class is a Protocol (a stub)."""
    for klass in cls.__mro__:
        if klass is not object and name in klass.__dict__:
            return klass if protocols or not getattr(klass, "_is_protocol", False) else None
    return None


def _owner_of(obj: Any, name: str, *, stubs: bool = True) -> Any:
    """Where ``obj``'s ``name`` comes from: the object itself, a class, or None."""
    if name in getattr(obj, "__dict__", {}):
        return obj
    return _owner(type(obj), name, protocols=stubs)


def _dynamic(obj: Any, name: str) -> bool:
    """Whether ``name`` comes from a ``__getattr__`` of the object's class (a proxy)."""
    if _owner(type(obj), "__getattr__") is None:
        return False
    try:
        getattr(obj, name)
    except AttributeError:
        return False
    return True


def _class_value(cls: type, name: str) -> Any:
    """A flag's value on the class (the property itself when the flag follows the params)."""
    owner = _owner(cls, name, protocols=True)
    if owner is None:
        return None
    raw = owner.__dict__[name]
    return raw if isinstance(raw, _INSTANCE_DESCRIPTORS) else getattr(cls, name)


def _fill(obj: Any, m: Member) -> str | None:
    """Set a flag the object leaves out: on its class if it has one of its own, else on itself."""
    heap_type = type(obj).__flags__ & (1 << 9)  # Py_TPFLAGS_HEAPTYPE: a class defined in Python
    try:
        setattr(type(obj) if heap_type else obj, m.name, m.default)
    except (AttributeError, TypeError):
        return _undeclared(m)
    return None


def _undeclared(m: Member) -> str:
    return f"cannot hold the default of flag {m.name}; declare it ({m.name}: {_type_name(m.type)} = {m.default!r})"


def _missing(m: Member, protocol: type, condition: When | None, flag_value: Any) -> str:
    why = f" ({condition.flag}={flag_value!r})" if condition is not None else ""
    return f"missing {m.describe()} of {protocol.__name__}{why}"


def _flag_problem(m: Member, value: Any, protocol: type) -> str | None:
    if _conforms(value, m.type):
        return None
    return f"{m.name}={_short(value)}: expected {_type_name(m.type)} ({protocol.__name__}.{m.name})"


def _as_called(m: Member, protocol: type, flag_value: Callable[[str], Any]) -> tuple[Member, str]:
    """Method ``m`` as the framework calls it: with the keywords a flag adds (:data:`CALLED_WITH`),
    and why (`` (flag=value)``, for the message); unchanged while the flag does not ask, or follows
    the params (a property, judged on the built object)."""
    extra = CALLED_WITH.get(protocol, {}).get(m.name)
    if extra is None:
        return m, ""
    condition, keywords = extra
    value = flag_value(condition.flag)
    if isinstance(value, _INSTANCE_DESCRIPTORS) or not condition.holds(value):
        return m, ""
    added = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in keywords]
    return replace(
        m, signature=m.signature.replace(parameters=[*m.signature.parameters.values(), *added])
    ), f" ({condition.flag}={value!r})"


def _call_problem(m: Member, sig: inspect.Signature | None, protocol: type) -> str | None:
    """Whether an implementation with ``sig`` accepts the call the Protocol describes for ``m``."""
    if sig is None:
        return None
    args: list[None] = []
    kwargs: dict[str, None] = {}
    if m.role == "method":
        for p in m.signature.parameters.values():
            if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if p.kind == p.KEYWORD_ONLY:
                kwargs[p.name] = None
            else:
                args.append(None)
    else:
        called = _callable_args(m.type)
        if called is Ellipsis:
            return None
        args = [None] * len(called)
    try:
        sig.bind(*args, **kwargs)
    except TypeError:
        return f"{m.name}{_plain(sig)} does not take {m.describe()} of {protocol.__name__}"
    return None


def _signature(fn: Any, *, bound: bool = True) -> inspect.Signature | None:
    """``fn``'s signature (without ``self`` for a function found on a class: ``bound=False``)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return sig if bound else sig.replace(parameters=list(sig.parameters.values())[1:])


def _callable_args(tp: Any) -> Any:
    """The parameter types of a ``Callable[[...], R]`` (or of ``Callable | None``); ``Ellipsis``
    for ``Callable[..., R]``; None when ``tp`` is no callable type."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            if (found := _callable_args(arm)) is not None:
                return found
        return None
    if typing.get_origin(tp) is not Callable:
        return None
    params = typing.get_args(tp)[0] if typing.get_args(tp) else Ellipsis
    return Ellipsis if params is Ellipsis else tuple(params)


def _plain(sig: inspect.Signature | None) -> str:
    """``(a, b, *, c=None)``: a signature without annotations."""
    if sig is None:
        return "(...)"
    params = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


def _conforms(value: Any, tp: Any) -> bool:
    """Whether ``value`` is of type ``tp`` (exactly: a bool is no int, an int no bool)."""
    if tp is Any:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is tuple or tp is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_conforms(v, args[0]) for v in value)
        return not args or (len(args) == len(value) and all(_conforms(v, a) for v, a in zip(value, args)))
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            return False
        key_tp, val_tp = args if len(args) == 2 else (Any, Any)
        return all(_conforms(k, key_tp) and _conforms(v, val_tp) for k, v in value.items())
    if origin is Callable or tp is Callable:
        return callable(value)
    if isinstance(origin, type):
        return isinstance(value, origin)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Callable:
        return "a callable"
    if tp is type(None):
        return "None"
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(tp, "__name__", str(tp))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["Member", "check_class", "check_factory", "check_object", "flags", "members"]
