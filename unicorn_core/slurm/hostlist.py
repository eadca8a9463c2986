"""Slurm hostlist expressions (``n[1-3,7],gpu-a[01-02]``): pure expand and compress."""

from __future__ import annotations

import itertools
import re

from unicorn_core.errors import InvalidArgument

_TRAILING_NUMBER = re.compile(r"^(.*?)(\d+)$")
MAX_HOSTS = 1_000_000


def _split_top_level(expr: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise InvalidArgument(f"nested brackets in hostlist {expr!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise InvalidArgument(f"unbalanced ']' in hostlist {expr!r}")
        elif ch == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    if depth != 0:
        raise InvalidArgument(f"unbalanced '[' in hostlist {expr!r}")
    parts.append(expr[start:])
    return parts


def _expand_range(body: str, expr: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise InvalidArgument(f"bad range {item!r} in hostlist {expr!r}")
        if not sep:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise InvalidArgument(f"descending range {item!r} in hostlist {expr!r}")
        if b - a + 1 > MAX_HOSTS:
            raise InvalidArgument(f"range {item!r} in hostlist {expr!r} is too large")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(a, b + 1))
    return out


def expand(expr: str) -> list[str]:
    """Expand a hostlist expression to host names, in order; ``""`` gives ``[]``.

    Several bracket groups in one name (``r[1-2]n[1-2]``) expand as a product.
    """
    expr = expr.strip()
    if not expr or expr == "(null)":
        return []
    hosts: list[str] = []
    for part in _split_top_level(expr):
        if not part:
            raise InvalidArgument(f"empty element in hostlist {expr!r}")
        pieces = re.split(r"(\[[^\]]*\])", part)
        choices: list[list[str]] = []
        for piece in pieces:
            if piece.startswith("[") and piece.endswith("]"):
                choices.append(_expand_range(piece[1:-1], expr))
            elif "[" in piece or "]" in piece:
                raise InvalidArgument(f"bad brackets in hostlist {expr!r}")
            else:
                choices.append([piece])
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
        if len(hosts) > MAX_HOSTS:
            raise InvalidArgument(f"hostlist {expr!r} expands to more than {MAX_HOSTS} hosts")
    return hosts


def compress(hosts: list[str] | tuple[str, ...]) -> str:
    """The shortest usual hostlist for ``hosts``: runs of a common prefix become ranges.

    Order of first appearance of each prefix is kept; duplicates are dropped.
    ``expand(compress(h)) == sorted-within-prefix unique h``.
    """
    groups: dict[tuple[str, int], set[int]] = {}
    plain: dict[str, None] = {}
    order: list[tuple[str, int] | str] = []
    for h in hosts:
        m = _TRAILING_NUMBER.match(h)
        if not m:
            if h not in plain:
                plain[h] = None
                order.append(h)
            continue
        key = (m.group(1), len(m.group(2)) if m.group(2).startswith("0") else 0)
        if key not in groups:
            groups[key] = set()
            order.append(key)
        groups[key].add(int(m.group(2)))
    out: list[str] = []
    for entry in order:
        if isinstance(entry, str):
            out.append(entry)
            continue
        prefix, width = entry
        nums = sorted(groups[entry])
        ranges: list[str] = []
        start = prev = nums[0]
        for n in [*nums[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            a, b = str(start).zfill(width), str(prev).zfill(width)
            ranges.append(a if start == prev else f"{a}-{b}")
            if n is not None:
                start = prev = n
        if len(nums) == 1:
            out.append(f"{prefix}{ranges[0]}")
        else:
            out.append(f"{prefix}[{','.join(ranges)}]")
    return ",".join(out)
