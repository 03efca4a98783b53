"""The config reference: every key of the run config and every registered entry, as markdown.

What ``loongsage reference`` prints and ``docs/reference/config.md`` holds. All of it is read off the
code, so the page cannot say something the code does not: the keys, their types and defaults from
the config dataclasses (:mod:`loongsage.core.config`), their bounds from ``ranged``, an entry's
params the way the registry validates them (:mod:`loongsage.core.schema`), and every meaning from
the source: the comment on a field's line (or the comment lines right above it, or a string right
below it), and an entry's or an extension point's docstring. Comments rather than field metadata,
so a field's meaning stays where a reader of the code already looks for it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal, Union

from loongsage.core import config, contracts, hookspecs

# a factory's params read as the registry's validation reads them, so the page lists what a recipe may set
from loongsage.core.schema import MISSING, RANGE, Range, fields_of

COMMAND = "uv run loongsage reference --out docs/reference/config.md"
REQUIRED, SEE_BELOW = "required", "see below"  # the defaults that are words, not values
LISTS = (list, tuple, Sequence, Iterable)
YAML_WORDS = ("null", "true", "false", "yes", "no", "on", "off", "y", "n")  # plain strings YAML reads as others


class _Spec:
    """Stands for ``config.Spec`` when the annotations are resolved: a ``{name, params}`` mapping
    reads as ``spec``, not as the ``dict[str, Any]`` it is to Python."""


@dataclasses.dataclass(frozen=True)
class Key:
    """One key of the run config, as the reference lists it."""

    path: str  # as a recipe or an override writes it; a list's items as ``data_sources[].name``
    type: str
    default: str  # as YAML writes it; REQUIRED where there is none, SEE_BELOW for a section
    bounds: str
    meaning: str
    holds: str = ""  # a key holding a section of keys: the section's path (``trainer.critic``, ``data_sources[]``)


# ----------------------------------------------------------------------------- the run config
def config_keys(root: type = config.Config) -> list[Key]:
    """Every key under ``root``, depth first: a section's own keys, then the sections they hold."""
    return list(_walk(root, "", None))


def _walk(cls: type, prefix: str, defaults: dict[str, Any] | None) -> Iterator[Key]:
    hints = typing.get_type_hints(cls, localns={"Spec": _Spec})
    meanings = field_meanings(cls)
    nested: list[tuple[type, str, dict[str, Any] | None]] = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        value = defaults[f.name] if defaults is not None else _field_default(f)
        section = _section_of(hints[f.name])
        holds = "" if section is None else f"{path}[]" if typing.get_origin(hints[f.name]) is list else path
        rng = f.metadata.get(RANGE)
        yield Key(
            path=path,
            type=_type_text(hints[f.name]),
            default=SEE_BELOW if _is_dataclass_instance(value) else _default_text(value),
            bounds=_bounds_text(rng, hints[f.name]) if rng else "",
            meaning=meanings.get(f.name, ""),
            holds=holds,
        )
        if section is not None:
            # a section's defaults are its holder's (the critic's optimizer has its own lr), else its class's
            inner = (
                {g.name: getattr(value, g.name) for g in dataclasses.fields(value)}
                if _is_dataclass_instance(value)
                else None
            )
            nested.append((section, f"{holds}.", inner))
    for section, inner_prefix, inner in nested:
        yield from _walk(section, inner_prefix, inner)


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return MISSING


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _section_of(tp: Any) -> type | None:
    """The config dataclass a key holds (``trainer.critic``), or one per item (``data_sources``)."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (list, Union, types.UnionType):
        inner = [_section_of(a) for a in typing.get_args(tp) if a is not type(None)]
        return inner[0] if len(inner) == 1 else None
    return None


# ----------------------------------------------------------------------------- meanings from the source
def field_meanings(cls: type) -> dict[str, str]:
    """A dataclass's field -> its meaning, from the source of each class of its MRO (a subclass's
    comment wins); empty for a class whose source is not there (a compiled module)."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        body = _class_body(base)
        if body is None:
            continue
        source, nodes = body
        comments = _Comments(source)
        for i, node in enumerate(nodes):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                after = nodes[i + 1] if i + 1 < len(nodes) else None
                meaning = comments.of(node.lineno, node.end_lineno or node.lineno) or _docstring_of(after)
                if meaning:
                    out[node.target.id] = meaning
    return out


def param_meanings(factory: Any) -> dict[str, str]:
    """A factory's param -> its meaning: a dataclass's fields, else the comment beside a parameter
    of the function (or ``__init__``) that is alone on its line."""
    if isinstance(factory, type) and dataclasses.is_dataclass(factory):
        return field_meanings(factory)
    function = factory.__init__ if inspect.isclass(factory) else factory
    parsed = _parse(function)
    if parsed is None:
        return {}
    source, tree = parsed
    definition = tree.body[0]
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {}
    a = definition.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    rows = [p.lineno for p in params]
    comments = _Comments(source)
    out: dict[str, str] = {}
    for p in params:
        # a parameter on the def line or sharing its line with another cannot own the comment there
        if p.lineno > definition.lineno and rows.count(p.lineno) == 1:
            meaning = comments.of(p.lineno, p.end_lineno or p.lineno)
            if meaning:
                out[p.arg] = meaning
    return out


def _parse(obj: Any) -> tuple[str, ast.Module] | None:
    try:
        source = textwrap.dedent(inspect.getsource(obj))
        return source, ast.parse(source)
    except (OSError, TypeError, SyntaxError):  # no source (a builtin, a compiled or generated object)
        return None


def _class_body(cls: type) -> tuple[str, list[ast.stmt]] | None:
    if "__annotations__" not in vars(cls):  # declares no field of its own
        return None
    parsed = _parse(cls)
    if parsed is None or not parsed[1].body or not isinstance(parsed[1].body[0], ast.ClassDef):
        return None
    return parsed[0], parsed[1].body[0].body


class _Comments:
    """The comments of a piece of source, by line (1-based)."""

    def __init__(self, source: str):
        lines = source.splitlines()
        self.text: dict[int, str] = {}
        self.alone: set[int] = set()  # lines holding nothing but their comment
        try:
            for tok in tokenize.generate_tokens(io.StringIO(source).readline):
                if tok.type == tokenize.COMMENT:
                    row = tok.start[0]
                    self.text[row] = tok.string.lstrip("#").strip()
                    if lines[row - 1].lstrip().startswith("#"):
                        self.alone.add(row)
        except (tokenize.TokenError, IndentationError):  # not whole source: no comments rather than wrong ones
            self.text, self.alone = {}, set()

    def of(self, first: int, last: int) -> str:
        """The block of comment lines right above line ``first``, then the comments on ``first..last``."""
        above: list[str] = []
        row = first - 1
        while row in self.alone:
            above.insert(0, self.text[row])
            row -= 1
        beside = [self.text[r] for r in range(first, last + 1) if r in self.text]
        return " ".join(part for part in [*above, *beside] if part)


def _docstring_of(node: ast.stmt | None) -> str:
    """An attribute docstring: a string expression right below the field."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
        return _first_paragraph(node.value.value)
    return ""


def summary(obj: Any) -> str:
    """The first paragraph of ``obj``'s own docstring, on one line; "" without one (a dataclass's
    generated ``Name(field, ...)`` and a docstring inherited from a base do not count)."""
    doc = vars(obj).get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    name = getattr(obj, "__name__", "")
    if not isinstance(doc, str) or (dataclasses.is_dataclass(obj) and doc.startswith(f"{name}(")):
        return ""
    return _first_paragraph(doc)


def _first_paragraph(doc: str) -> str:
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


# ----------------------------------------------------------------------------- values as a recipe writes them
def _type_text(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is _Spec:
        return "spec"
    if tp is Any:
        return "any"
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(dict.fromkeys(_type_text(a) for a in args))  # list[str] | tuple[str, ...]: one list
    if origin in LISTS or tp in LISTS:  # YAML has lists only
        items = [a for a in args if a is not Ellipsis]
        return f"list[{_type_text(items[0])}]" if len(items) == 1 else "list"
    if origin is dict or tp is dict or dataclasses.is_dataclass(tp):
        return "mapping"
    return str(getattr(tp, "__name__", tp))


def _default_text(value: Any) -> str:
    return REQUIRED if value is MISSING else _yaml(value)


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        # plain where YAML would read the same string back; quoted where it would read something else
        plain = re.fullmatch(r"[A-Za-z_][\w./-]*", value) and value.lower() not in YAML_WORDS
        return value if plain else "'" + value.replace("'", "''") + "'"  # single-quoted: backslashes stay as they are
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if _is_dataclass_instance(value):
        return _yaml(dataclasses.asdict(value))
    return str(value)


def _bounds_text(rng: Range, tp: Any) -> str:
    text = rng.describe().removeprefix("must be ")
    return f"each {text}" if typing.get_origin(tp) is list else text


# ----------------------------------------------------------------------------- the markdown
def _cell(text: str, code: bool = False) -> str:
    """One table cell: ``|`` escaped (it would end the cell), and ``<`` outside code spans (it would
    open an HTML tag)."""
    if not text:
        return ""
    if code:
        return f"`{text.replace('|', chr(92) + '|')}`"
    parts = re.split(r"(`+[^`]*`+)", text)
    text = "".join(p if p.startswith("`") else p.replace("<", "\\<") for p in parts)
    return text.replace("|", "\\|")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _config_section(keys: list[Key]) -> list[str]:
    by_section: dict[str, list[Key]] = {}
    for key in keys:
        by_section.setdefault(key.path.rsplit(".", 1)[0] if "." in key.path else "", []).append(key)
    holders = {key.holds: key for key in keys if key.holds}
    out = ["## The run config", ""]
    for name, rows in by_section.items():
        holder = holders.get(name)
        out += [f"### `{name}`" if name else "### Top level", ""]
        if holder is not None:
            optional = " Off (`null`) by default: these keys apply once it is set." if holder.default == "null" else ""
            each = " Each item of the list is a mapping of these keys." if name.endswith("[]") else ""
            about = _cell(holder.meaning).rstrip(".")
            out += [about[:1].upper() + about[1:] + "." + each + optional, ""]
        out += _table(
            ("key", "type", "default", "bounds", "meaning"),
            [
                (_cell(k.path, True), _cell(k.type, True), _cell(k.default, k.default not in (REQUIRED, SEE_BELOW)))
                + (_cell(k.bounds), _cell(k.meaning))
                for k in rows
            ],
        )
        out.append("")
    return out


def _extension_tables(registry: Any) -> Iterator[tuple[str, str]]:
    """(table, what it is) in the order ``loongsage plugins`` lists them: a backend's table is its kind's."""
    for hook in hookspecs.HOOKS.values():
        if hook.category == hookspecs.BACKEND:
            for kind, protocol in contracts.BACKENDS.items():
                yield kind, f"Hook `{hook.name}`, kind `{kind}`. {summary(protocol)}"
        else:
            yield hook.category, f"Hook `{hook.name}`. {summary(getattr(hookspecs, hook.name))}"


def _package(provider: str) -> str:
    """``loongsage-algos 0.1.0 (loongsage.algos.plugin)`` -> ``loongsage-algos``: no version, so the
    page does not change with a release."""
    head = provider.split(" (", 1)[0]
    name, _, version = head.rpartition(" ")
    return name if name and version[:1].isdigit() else head


def _entry_section(entry: Any, category: str) -> list[str]:
    out = [f"#### `{entry.name}`", ""]
    about = summary(entry.factory)
    out += [f"From `{_package(entry.provider)}`." + (f" {_cell(about)}" if about else ""), ""]
    fields = fields_of(entry.factory)
    if not fields:
        return out + ["No params.", ""]
    hints = {name: tp for name, (tp, _) in fields.items()}
    ranges = {f.name: f.metadata[RANGE] for f in _dataclass_fields(entry.factory) if RANGE in f.metadata}
    meanings = param_meanings(entry.factory)
    supplied = (*config.SUPPLIED.get(category, ()), *getattr(entry.factory, "receives", ()))
    rows: list[tuple[str, ...]] = []
    for name, (tp, default) in fields.items():
        meaning = "passed by the framework; not set in params" if name in supplied else meanings.get(name, "")
        bounds = _bounds_text(ranges[name], hints[name]) if name in ranges else ""
        rows.append(
            (_cell(name, True), _cell(_type_text(tp), True), _cell(_default_text(default), default is not MISSING))
            + (_cell(bounds), _cell(meaning))
        )
    return out + _table(("param", "type", "default", "bounds", "meaning"), rows) + [""]


def _dataclass_fields(factory: Any) -> tuple[dataclasses.Field[Any], ...]:
    return dataclasses.fields(factory) if dataclasses.is_dataclass(factory) else ()


def config_reference(registry: Any) -> str:
    """The whole page: the run config's keys, then every entry of ``registry`` by extension point."""
    out = [
        "# Config reference",
        "",
        f"Generated from the code by `loongsage reference`; do not edit it by hand, run `{COMMAND}` after "
        "changing a config field, a plugin's params or their comments.",
        "",
        "A recipe sets these keys in YAML; the command line overrides them as `key=value`. A **spec** is "
        "`{name: ..., params: {...}}`: an entry of an extension point, by name, and its params "
        "([the entries](#extension-points), below, as installed when the page was made). A default `required` "
        "is a key that has none.",
        "",
    ]
    out += _config_section(config_keys())
    out += ["## Extension points", ""]
    for category, about in _extension_tables(registry):
        out += [f"### {category}", "", _cell(about), ""]
        names = registry.names(category)
        if not names:
            out += ["None installed.", ""]
        for name in names:
            out += _entry_section(registry.tables[category][name], category)
    return "\n".join(out).rstrip("\n") + "\n"
