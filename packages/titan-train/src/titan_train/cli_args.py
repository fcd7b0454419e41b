"""Typed `--section.field value` command-line arguments over the config dataclasses (parsing, type checks, help).

Sections nest to any depth (a field whose type is a dataclass is a section: `--model.moe.num_experts 4`).
Hand-written rather than tyro. Measured against tyro 1.0.17 on TrainConfig (2-core CPU, FlagConversionOff
so flags keep their underscores): tyro also takes the defaults from a recipe loaded at run time
(`tyro.cli(TrainConfig, default=recipe)`), uses the attribute docstrings as help and suggests close flags
for a typo. What it does not do that the trainer relies on: (1) time: importing tyro takes 120-230 ms
and its parse 116 ms, against 14 ms to import this module and ~1 ms to parse, paid by every rank under
torchrun and every CLI test subprocess; (2) errors as a `ConfigError` (a ValueError) naming the flag,
the close matches and every valid name, raised to a Python caller (tyro prints and exits); (3) the
documented value syntax: tuple fields as one comma-separated value with `a=b` pairs
(`--parallelism.flexshard_placements "layers.*.weight=owned,output.weight=block:128x128"`), which tyro
spells as several space-separated words. It is ~200 lines over `dataclasses.fields`.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import textwrap
import types
import typing
from functools import cache
from typing import Any, Literal


class ConfigError(ValueError):
    """A command-line or recipe value that does not fit the config (names it and the valid choices)."""


def section_types(config: Any) -> dict[str, type]:
    """Section name -> dataclass type, for a config tree like TrainConfig."""
    hints = typing.get_type_hints(type(config))
    return {f.name: hints[f.name] for f in dataclasses.fields(config)}


def field_types(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:  # tuple[X, ...] -> "X,..."; a pair tuple[A, B] -> "A=B"
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"{type_name(args[0])},..."
        return "=".join(type_name(a) for a in args)
    return getattr(tp, "__name__", str(tp))


def close_matches(name: str, choices: list[str]) -> str:
    near = difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    return f"{hint}; valid: {', '.join(choices)}"


def parse_value(text: str, tp: Any, flag: str) -> Any:
    """Convert `text` to the field type `tp`, or raise ConfigError naming `flag` and what it accepts."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        for choice in choices:
            if str(choice) == text:
                return choice
        raise ConfigError(f"{flag}: {text!r} is not a valid choice{close_matches(text, [str(c) for c in choices])}")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and text.lower() in ("none", "null"):
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return parse_value(text, arg, flag)
            except ConfigError:
                pass
        raise ConfigError(f"{flag} expects {type_name(tp)}, got {text!r}")
    if tp is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{flag} expects bool (true/false), got {text!r}")
    if tp is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            raise ConfigError(f"{flag} expects int, got {text!r}") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{flag} expects float, got {text!r}") from None
    if tp is str:
        return text
    if origin is tuple:
        return _parse_tuple(text, tp, flag)
    raise ConfigError(f"{flag} has type {type_name(tp)}, which cannot be set from the command line")


def _parse_tuple(text: str, tp: Any, flag: str) -> tuple:
    """tuple[X, ...] from comma-separated items ('' is empty); a fixed tuple[A, B] item from 'a=b'."""
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(parse_value(item.strip(), args[0], flag) for item in text.split(",") if item.strip())
    parts = text.split("=", len(args) - 1)
    if len(parts) != len(args):
        raise ConfigError(f"{flag} expects items of the form {type_name(tp)}, got {text!r}")
    return tuple(parse_value(part.strip(), arg, flag) for part, arg in zip(parts, args))


def is_section(tp: Any) -> bool:
    """A field whose type is a config dataclass is a section (its fields are flags one level deeper)."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def apply_override(config: Any, dotted: str, text: str) -> None:
    """Set the field at `dotted` (`section.field`, or deeper through nested sections: `model.moe.num_experts`)
    from the string `text`, checked against the field's type."""
    flag = f"--{dotted}"
    parts = dotted.split(".")
    owner, prefix = config, ""
    for depth, name in enumerate(parts):
        fields = field_types(type(owner))
        if name not in fields:
            if depth == 0:
                raise ConfigError(f"unknown section in {flag}{close_matches(name, sorted(fields))}")
            raise ConfigError(f"unknown field {flag}{close_matches(dotted, [prefix + f for f in fields])}")
        tp, last = fields[name], depth == len(parts) - 1
        if is_section(tp) and last:  # a section named without one of its fields
            choices = [f"{dotted}.{f}" for f in field_types(tp)]
            raise ConfigError(f"unknown field {flag}{close_matches(dotted, choices)}")
        if is_section(tp):
            owner, prefix = getattr(owner, name), f"{prefix}{name}."
        elif not last:
            raise ConfigError(f"unknown field {flag}: {prefix}{name} is a {type_name(tp)} field, not a section")
        else:
            setattr(owner, name, parse_value(text, tp, flag))


def check_types(config: Any, *, prefix: str = "") -> None:
    """Check every field of a config tree, nested sections included, against its declared type (recipes
    are plain Python)."""
    for name, tp in field_types(type(config)).items():
        value, path = getattr(config, name), prefix + name
        if is_section(tp):
            if not isinstance(value, tp):
                raise ConfigError(f"{path} must be a {tp.__name__}, got {type(value).__name__}")
            check_types(value, prefix=f"{path}.")
        elif not _fits(value, tp):
            raise ConfigError(f"{path} = {value!r} does not fit {type_name(tp)}")


def _fits(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args))
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings (a string literal right after a field) of a dataclass."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def describe_fields(config: Any, *, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(flag, type, default, doc) for every field of the config tree, nested sections included, in
    declaration order."""
    rows = []
    docs = field_docs(type(config))
    for name, tp in field_types(type(config)).items():
        value = getattr(config, name)
        if is_section(tp):
            rows += describe_fields(value, prefix=f"{prefix}{name}.")
        else:
            rows.append((f"--{prefix}{name}", type_name(tp), repr(value), docs.get(name, "")))
    return rows
