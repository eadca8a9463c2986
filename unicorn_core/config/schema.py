"""The schema machinery every settings section is built from, whoever reads it.

Field metadata (``_meta``: the documentation of a setting and its numeric bounds),
the ``Section`` base class, the type checks and conversions applied to each value
(``str``, ``int``, ``float``, ``bool``, ``Literal[...]`` of strings, ``tuple[...]`` of
those), the TOML-style spelling of values in messages (``_show``), and ``SettingInfo``
with the tree walk behind ``describe()`` (``unicornctl config --describe``, the docs).
The section modules (``site``, ``node``, ``coordinator``) and the ``loader`` import it;
nothing here knows any particular section.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin, get_type_hints

ENV_PREFIX = "UNICORN_"
ENV_SEPARATOR = "__"

_BOUNDS: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "gt": (operator.gt, ">"),
    "ge": (operator.ge, ">="),
    "lt": (operator.lt, "<"),
    "le": (operator.le, "<="),
}


def _meta(
    doc: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> dict[str, object]:
    """Field metadata: the documentation (meaning, unit, default and why) and bounds."""
    meta: dict[str, object] = {"doc": doc}
    for name, bound in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le)):
        if bound is not None:
            meta[name] = bound
    return meta


class Section:
    """Base of every settings section. Override ``problems()`` for cross-field checks."""

    def problems(self) -> list[str]:
        """Cross-field inconsistencies, as messages naming the keys; empty when fine.

        Keys are named relative to the section (the loader prefixes ``<section>: ``).
        Runs only once every field has the right type and is within its bounds.
        """
        return []


# --------------------------------------------------------------------------- describe


@dataclass(frozen=True)
class SettingInfo:
    """One leaf setting, for ``unicornctl config --describe`` and the docs."""

    key: str
    """Dotted path, e.g. ``redis.socket_timeout_s`` (section ``redis``, key ``socket_timeout_s``)."""
    env_var: str
    """Environment variable that overrides it, e.g. ``UNICORN_REDIS__SOCKET_TIMEOUT_S``."""
    expected: str
    """What values it takes, in words (``a number > 0``, ``one of "auto", "cli"``)."""
    default: object
    doc: str


def _describe(cls: type[Any], path: str) -> Iterator[SettingInfo]:
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = _join(path, f.name)
        hint = hints[f.name]
        if _is_section(hint):
            yield from _describe(hint, key)
            continue
        default = f.default_factory() if callable(f.default_factory) else f.default
        bounds = " and ".join(
            f"{symbol} {f.metadata[name]:g}" for name, (_, symbol) in _BOUNDS.items() if name in f.metadata
        )
        yield SettingInfo(
            key=key,
            env_var=ENV_PREFIX + ENV_SEPARATOR.join(key.split(".")).upper(),
            expected=_expected(hint) + (f" {bounds}" if bounds else ""),
            default=default,
            doc=str(f.metadata.get("doc", "")),
        )


# --------------------------------------------------------------------------- types and messages


class _MismatchError(Exception):
    """A value is not of the expected type; ``expected`` says what was wanted, in words."""

    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


def _is_section(hint: object) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _valid(cls: type[Any]) -> str:
    """``valid keys: a, b`` (or ``valid sections:`` when every field is a section)."""
    hints = get_type_hints(cls)
    names = sorted(f.name for f in dataclasses.fields(cls))
    noun = "sections" if all(_is_section(hints[name]) for name in names) else "keys"
    return f"valid {noun}: {', '.join(names)}"


def _noun(cls: type[Any]) -> str:
    return "section" if _valid(cls).startswith("valid sections") else "key"


_SCALARS: dict[type, Callable[[object], bool]] = {
    bool: lambda value: isinstance(value, bool),
    int: lambda value: isinstance(value, int) and not isinstance(value, bool),
    float: lambda value: isinstance(value, int | float) and not isinstance(value, bool),
    str: lambda value: isinstance(value, str),
}


def _check(value: object, hint: Any) -> object:
    """``value`` converted to ``hint``'s type (int to float, list to tuple), or ``_MismatchError``."""
    if get_origin(hint) is tuple:
        if not isinstance(value, list | tuple):
            raise _MismatchError(_expected(hint))
        try:
            return tuple(_check(item, get_args(hint)[0]) for item in value)
        except _MismatchError:
            raise _MismatchError(_expected(hint)) from None
    if get_origin(hint) is Literal:
        matches = isinstance(value, str) and value in get_args(hint)
    elif hint in _SCALARS:
        matches = _SCALARS[hint](value)
    else:
        raise TypeError(f"unsupported settings field type {hint!r}")
    if not matches:
        raise _MismatchError(_expected(hint))
    if hint is float and isinstance(value, int | float):
        if not math.isfinite(value):
            raise _MismatchError("a finite number")
        return float(value)
    return value


def _expected(hint: Any) -> str:
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(_show(choice) for choice in get_args(hint))
    if get_origin(hint) is tuple:
        return f"a list, each item {_expected(get_args(hint)[0])}"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if hint in names:
        return names[hint]
    raise TypeError(f"unsupported settings field type {hint!r}")


def _show(value: object) -> str:
    """``value`` as TOML would spell it (strings in double quotes), cut to 80 characters."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, list | tuple):
        text = "[" + ", ".join(_show(item) for item in value) + "]"
    elif isinstance(value, Mapping):
        text = "{" + ", ".join(f"{key} = {_show(item)}" for key, item in value.items()) + "}"
    else:
        text = repr(value) if isinstance(value, int | float) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."
