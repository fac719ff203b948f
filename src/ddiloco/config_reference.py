"""Every config key with its type, default and docstring, read from the config dataclasses
themselves (``ddiloco config --list``).

A field's documentation is the string literal right under it in the class body (an attribute
docstring); ``missing_docs`` lists the fields without one, and a test keeps that list empty.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal


@dataclass(frozen=True)
class Entry:
    """One config key: ``section.key``, its annotated type, its value in the resolved config
    (the defaults, or a method preset's) and its docstring."""

    key: str
    type: str
    """The field's type as text; a ``Literal`` lists its choices (``"rda" | "mean"``)."""
    default: Any
    doc: str
    preset: bool = False
    """Whether the method preset sets this value (it differs from the dataclass default)."""


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a class: ``{field: text}`` for every annotated field that is
    followed directly by a string literal in the class body (dedented, stripped)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
    docs: dict[str, str] = {}
    for stmt, after in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def missing_docs(cls: type) -> list[str]:
    """The dataclass fields of ``cls`` without a (non-empty) attribute docstring."""
    docs = field_docs(cls)
    return [f.name for f in dataclasses.fields(cls) if not docs.get(f.name, "").strip()]


def reference(method: str | None = None) -> list[Entry]:
    """Every key of every config section, in file order, with the defaults of ``method``'s
    preset (the plain dataclass defaults when None)."""
    from ddiloco.config import SECTIONS, Config, load_config
    from ddiloco.methods import PRESETS

    cfg = load_config(None, base=PRESETS[method]) if method else Config()
    plain = Config()
    out = []
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            value = getattr(getattr(cfg, section), f.name)
            default = getattr(getattr(plain, section), f.name)
            kind = type_text(hints[f.name])
            out.append(Entry(f"{section}.{f.name}", kind, value, docs.get(f.name, ""), value != default))
    return out


def type_text(tp: Any) -> str:
    """A resolved annotation as a reader writes it: ``int``, ``tuple[str, ...]``, and a
    ``Literal`` as its choices in TOML spelling (``int | "all"``, ``"rda" | "mean"``)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(toml_value(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join('...' if a is Ellipsis else type_text(a) for a in args)}]"
    if tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    return getattr(tp, "__name__", str(tp))


def toml_value(value: Any) -> str:
    """``value`` written as a TOML value (inline tables for dicts)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def format_reference(entries: list[Entry], width: int = 100) -> str:
    """The reference as text: one ``section.key (type) = default`` line per key, its docstring
    indented under it, and a ``[section]`` heading before each section."""
    lines: list[str] = []
    section = None
    for e in entries:
        sec = e.key.split(".", 1)[0]
        if sec != section:
            lines += ["", f"[{sec}]"] if lines else [f"[{sec}]"]
            section = sec
        mark = "   (method preset)" if e.preset else ""
        lines.append(f"{e.key} ({e.type}) = {toml_value(e.default)}{mark}")
        for para in e.doc.split("\n\n"):
            lines += textwrap.wrap(" ".join(para.split()), width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines) + "\n"
