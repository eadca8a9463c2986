"""Hostlist expressions: examples from Slurm's docs, properties, and bad input."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unicorn_core.errors import InvalidArgument
from unicorn_core.slurm.hostlist import compress, expand


@pytest.mark.parametrize(
    ("expr", "hosts"),
    [
        ("", []),
        ("(null)", []),
        ("n1", ["n1"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("n[1-3,7]", ["n1", "n2", "n3", "n7"]),
        ("gpu-a[01-03],cpu1", ["gpu-a01", "gpu-a02", "gpu-a03", "cpu1"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("node[8-10]", ["node8", "node9", "node10"]),
        ("login,n[1-2]", ["login", "n1", "n2"]),
    ],
)
def test_expand(expr: str, hosts: list[str]) -> None:
    assert expand(expr) == hosts


@pytest.mark.parametrize(
    ("hosts", "expr"),
    [
        (["n1", "n2", "n3", "n7"], "n[1-3,7]"),
        (["n3"], "n3"),
        (["gpu-a01", "gpu-a02", "login"], "gpu-a[01-02],login"),
        (["n2", "n1", "n1"], "n[1-2]"),
        (["node9", "node10"], "node[9-10]"),
    ],
)
def test_compress(hosts: list[str], expr: str) -> None:
    assert compress(hosts) == expr


@pytest.mark.parametrize("bad", ["n[1-", "n]1[", "n[a-b]", "n[3-1]", "n[[1]]", "n1,,n2", "n[1-2000000]"])
def test_expand_rejects_bad_input(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        expand(bad)


names = st.builds(
    lambda p, n, w: f"{p}{str(n).zfill(w)}",
    st.sampled_from(["n", "gpu-a", "rack1-node", "x"]),
    st.integers(0, 300),
    st.sampled_from([0, 2, 3]),
)


@given(st.lists(names | st.sampled_from(["login", "head"]), max_size=40))
def test_compress_expand_round_trip(hosts: list[str]) -> None:
    assert set(expand(compress(hosts))) == set(hosts)
    assert len(expand(compress(hosts))) == len(set(hosts))
