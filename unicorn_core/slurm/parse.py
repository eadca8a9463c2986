"""Pure parsers for Slurm command output (no I/O; unit-tested on recorded samples).

Two formats are read: the JSON of ``sinfo --json`` / ``squeue --json`` (data_parser
v0.0.38 in Slurm 22.05, where ``state`` is a string plus ``state_flags``; 23.02+ give a
list of upper-case strings) and the one-line ``key=value`` records of
``scontrol -o show``. Anything structurally wrong raises :class:`SlurmParseError`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from unicorn_core.errors import UnicornError
from unicorn_core.slurm.hostlist import expand
from unicorn_core.slurm.types import JobInfo, JobState, NodeInfo, NodeState


class SlurmParseError(UnicornError):
    """Slurm printed something this parser does not understand."""


_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/.]*)=")
_REASON_TAIL = re.compile(r"\s*\[[^\[\]@]*@[^\[\]]*\]$")
_GPU_GRES = re.compile(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)")


def parse_scontrol_record(line: str) -> dict[str, str]:
    """``Key=value Key2=value with spaces ...`` -> dict.

    A value runs until the next `` Key=``; values may contain spaces. A node's
    ``Reason=text [user@time]`` is free text and may contain ``=``, so it is taken whole
    up to its ``[user@time]`` suffix.
    """
    out: dict[str, str] = {}
    pos = 0
    line = line.strip()
    while pos < len(line):
        m = _KEY.search(line, pos)
        if m is None:
            break
        key = m.group(1)
        vstart = m.end()
        if key == "Reason":
            close = re.search(r"\[[^\[\]@]*@[^\[\]]*\]", line[vstart:])
            if close is not None:
                vend = vstart + close.end()
                out[key] = line[vstart:vend]
                pos = vend
                continue
        nxt = _KEY.search(line, vstart)
        vend = nxt.start() if nxt else len(line)
        out[key] = line[vstart:vend].strip()
        pos = vend
    if not out:
        raise SlurmParseError(f"not a key=value record: {line[:200]!r}")
    return out


def _int(value: Any, default: int = 0) -> int:
    """Slurm ints: plain, ``{"set": b, "number": n}`` (23.02+), or strings."""
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite"):
            return default
        value = value.get("number", default)
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return default


def gpus_in_gres(gres: str) -> int:
    """Total GPUs in a GRES string such as ``gpu:4``, ``gpu:a100:8(S:0-1)``, ``gpu:0``."""
    return sum(int(n) for n in _GPU_GRES.findall(gres or ""))


_GPU_TYPED = re.compile(r"(?:^|,)gpu:([^:,(]+):(\d+)")


def gpu_type_in_gres(gres: str) -> str:
    """The GPU type a GRES string names (``gpu:h100:8(S:0-1)`` -> ``h100``); ``""`` for
    untyped GPUs (``gpu:4``). With several types, the one with most GPUs (ties: by name)."""
    counts: dict[str, int] = {}
    for kind, n in _GPU_TYPED.findall(gres or ""):
        counts[kind] = counts.get(kind, 0) + int(n)
    if not counts:
        return ""
    return min(counts, key=lambda k: (-counts[k], k))


_NODE_STATES: Final = dict(NodeState.__members__)
"""By name, built once: ``Enum.__members__`` builds a new mapping on each access (3 % of
unicornd's samples when it parsed 4,096 nodes every poll)."""


def _node_state(raw: Any, flags_raw: Any) -> tuple[NodeState, frozenset[str]]:
    words: list[str] = []
    if isinstance(raw, str):
        words = [w for w in re.split(r"[+\s]", raw.upper()) if w]
    elif isinstance(raw, list):
        words = [str(w).upper() for w in raw]
    else:
        raise SlurmParseError(f"node state of unexpected type: {raw!r}")
    if isinstance(flags_raw, list):
        words += [str(w).upper() for w in flags_raw]
    base = NodeState.UNKNOWN
    flags: set[str] = set()
    for word in words:
        w = word.rstrip("*~#!%$@^-")
        state = _NODE_STATES.get(w)
        if state is not None:
            if base is NodeState.UNKNOWN:
                base = state
        elif w:
            flags.add(w)
    # sinfo's compact names: "drained"/"draining" imply IDLE/ALLOCATED + DRAIN.
    if "DRAINED" in flags or "DRAINING" in flags:
        flags.add("DRAIN")
    return base, frozenset(flags)


def _features(raw: Any) -> tuple[str, ...]:
    """Node features: a comma-separated string (22.05, scontrol) or a list (newer JSON)."""
    if isinstance(raw, list):
        words = [str(w) for w in raw]
    elif isinstance(raw, str):
        words = raw.split(",")
    else:
        return ()
    return tuple(w.strip() for w in words if w.strip() and w.strip() != "(null)")


def parse_partitions(text: str) -> list[str]:
    """Partition names from ``scontrol -o show partition`` (one record a line)."""
    names = []
    for line in text.splitlines():
        if line.strip().startswith("PartitionName="):
            names.append(parse_scontrol_record(line)["PartitionName"])
    return names


def parse_reservation_nodes(text: str, name: str) -> tuple[str, ...] | None:
    """The nodes of reservation ``name`` in ``scontrol -o show reservation`` output; None
    when no record of that name is there."""
    for line in text.splitlines():
        if not line.strip().startswith("ReservationName="):
            continue
        rec = parse_scontrol_record(line)
        if rec.get("ReservationName") == name:
            nodes = rec.get("Nodes", "")
            return tuple(expand(nodes if nodes != "(null)" else ""))
    return None


def _strip_reason_suffix(reason: str) -> str:
    return _REASON_TAIL.sub("", reason).strip()


def node_from_sinfo_json(d: Mapping[str, Any]) -> NodeInfo:
    try:
        name = d["name"]
        state, flags = _node_state(d["state"], d.get("state_flags"))
    except KeyError as e:
        raise SlurmParseError(f"sinfo node record lacks {e}") from None
    if not isinstance(name, str) or not name:
        raise SlurmParseError(f"sinfo node record with bad name {name!r}")
    partitions = d.get("partitions") or []
    return NodeInfo(
        name=name,
        state=state,
        flags=flags,
        reason=_strip_reason_suffix(str(d.get("reason") or "")),
        cpus=_int(d.get("cpus")),
        gpus=gpus_in_gres(str(d.get("gres") or "")),
        gpus_used=gpus_in_gres(str(d.get("gres_used") or "")),
        gpu_type=gpu_type_in_gres(str(d.get("gres") or "")),
        real_memory_mib=_int(d.get("real_memory")),
        partitions=tuple(str(p) for p in partitions),
        features=_features(d.get("active_features", d.get("features"))),
    )


class _SinfoNode(msgspec.Struct, gc=False):
    """The fields of an ``sinfo --json`` node record that :func:`node_from_sinfo_json` reads;
    decoding skips the others (Slurm prints ~60 per node: at 4,096 nodes the 4 MB decode in
    6 ms instead of 35, in one call that holds the GIL).

    ``gc=False`` (decoded data holds no cycles): a poll's records are not tracked by
    Python's collector. Tracked, a poll's thousands of objects were still alive when the
    young collections ran, were promoted, and brought on full collections of unicornd's
    whole heap every few seconds (``scripts/bench/scale.py``: 17 % of its samples were in
    the collector at 4,096 nodes, most started while parsing a poll)."""

    name: Any = None
    state: Any = None
    state_flags: Any = None
    reason: Any = None
    cpus: Any = None
    gres: Any = None
    gres_used: Any = None
    real_memory: Any = None
    partitions: Any = None
    active_features: Any = None
    features: Any = None


class _SinfoDoc(msgspec.Struct, gc=False):
    """``sinfo --json`` up to Slurm 23.02 and ``scontrol show node --json`` (23.02+): a
    ``nodes`` list of node records. Newer ``sinfo --json`` (seen on 24.11) prints a
    ``sinfo`` list of *grouped* records instead (nodes sharing state, GRES, reason and
    partition in one record, their counters summed), which cannot be read per node."""

    nodes: list[_SinfoNode] | None = None
    sinfo: Any = None
    errors: Any = None


_SINFO: Final = msgspec.json.Decoder(_SinfoDoc)


class GroupedSinfo(SlurmParseError):
    """``sinfo --json`` printed grouped records (the ``{"sinfo": [...]}`` shape): read the
    nodes with ``scontrol show node --json`` (:func:`nodes_from_scontrol_json`) instead."""


def _decode(decoder: msgspec.json.Decoder[Any], text: str, what: str, key: str) -> Any:
    try:
        doc = decoder.decode(text)
    except msgspec.ValidationError:
        raise SlurmParseError(f"{what} --json output has no '{key}' list of objects") from None
    except msgspec.DecodeError as e:
        raise SlurmParseError(f"{what} printed invalid JSON: {e}") from None
    if doc.errors:
        raise SlurmParseError(f"{what} reported errors: {doc.errors!r}")
    return doc


def _records(doc: Any, what: str, key: str) -> list[dict[str, Any]]:
    """The records under ``key`` of a decoded document, each as a dict of the fields it has."""
    records = getattr(doc, key)
    if records is None:
        raise SlurmParseError(f"{what} --json output has no '{key}' list of objects")
    return [{k: v for k, v in msgspec.structs.asdict(r).items() if v is not None} for r in records]


def _typed_records(
    decoder: msgspec.json.Decoder[Any], text: str, what: str, key: str
) -> list[dict[str, Any]]:
    """The records under ``key`` of ``<what> --json`` output, decoded by ``decoder`` (a
    typed schema of the fields read), each as a dict of the fields it has."""
    return _records(_decode(decoder, text, what, key), what, key)


def nodes_from_sinfo_json(text: str) -> list[NodeInfo]:
    """Nodes from ``sinfo --json``; :class:`GroupedSinfo` for the grouped shape."""
    doc = _decode(_SINFO, text, "sinfo", "nodes")
    if doc.nodes is None and isinstance(doc.sinfo, list):
        raise GroupedSinfo(
            "sinfo --json printed grouped records ('sinfo' list), not one per node; "
            "read nodes with scontrol show node --json"
        )
    return [node_from_sinfo_json(n) for n in _records(doc, "sinfo", "nodes")]


def nodes_from_scontrol_json(text: str) -> list[NodeInfo]:
    """Nodes from ``scontrol show node --json`` (Slurm 23.02+): the per-node records of
    older ``sinfo --json``, read by the same parser."""
    return [node_from_sinfo_json(n) for n in _typed_records(_SINFO, text, "scontrol show node", "nodes")]


def node_from_scontrol(rec: Mapping[str, str]) -> NodeInfo:
    try:
        name = rec["NodeName"]
        state, flags = _node_state(rec["State"], None)
    except KeyError as e:
        raise SlurmParseError(f"scontrol node record lacks {e}") from None
    parts = rec.get("Partitions", "")
    return NodeInfo(
        name=name,
        state=state,
        flags=flags,
        reason=_strip_reason_suffix(rec.get("Reason", "")),
        cpus=_int(rec.get("CPUTot")),
        gpus=gpus_in_gres(rec.get("Gres", "")),
        gpus_used=gpus_in_gres(rec.get("GresUsed", "")),
        gpu_type=gpu_type_in_gres(rec.get("Gres", "")),
        real_memory_mib=_int(rec.get("RealMemory")),
        partitions=tuple(p for p in parts.split(",") if p and p != "(null)"),
        features=_features(rec.get("ActiveFeatures", rec.get("AvailableFeatures"))),
    )


def _job_state(raw: Any) -> tuple[JobState, str]:
    if isinstance(raw, list):
        raw = raw[0] if raw else ""
    if not isinstance(raw, str):
        raise SlurmParseError(f"job state of unexpected type: {raw!r}")
    word = raw.upper().split("+")[0].strip()
    try:
        return JobState(word), raw
    except ValueError:
        return JobState.OTHER, raw


def job_from_squeue_json(d: Mapping[str, Any]) -> JobInfo:
    try:
        job_id = _int(d["job_id"], -1)
        state, raw = _job_state(d["job_state"])
    except KeyError as e:
        raise SlurmParseError(f"squeue job record lacks {e}") from None
    if job_id <= 0:
        raise SlurmParseError(f"squeue job record with bad job_id {d.get('job_id')!r}")
    return JobInfo(
        job_id=job_id,
        name=str(d.get("name") or ""),
        state=state,
        state_raw=raw,
        reason=str(d.get("state_reason") or ""),
        nodes=tuple(expand(str(d.get("nodes") or ""))),
        num_nodes=_int(d.get("node_count")),
        batch=bool(d.get("batch_flag")),
        restarts=_int(d.get("restart_cnt")),
        user=str(d.get("user_name") or ""),
        gres=_gres_request(*(d.get(f"tres_per_{per}") for per in _TRES_PER)),
        batch_host=str(d.get("batch_host") or ""),
    )


_TRES_PER: Final = ("node", "job", "task", "socket")
"""The ways a job asks for GRES (``--gres``/``--gpus-per-node``, ``--gpus``,
``--gpus-per-task``, ``--gpus-per-socket``): squeue's ``tres_per_<x>``, scontrol's ``TresPer<X>``."""


def _gres_request(*values: Any) -> str:
    """A job's GRES request: the TRES-per strings that name a ``gres`` (``gres/gpu:2``,
    22.05's ``gres:gpu:2``), comma-joined; ``""`` for none."""
    found = [str(v) for v in values if isinstance(v, str) and v.strip() and "gres" in v]
    return ",".join(found)


class _SqueueJob(msgspec.Struct, gc=False):
    """The fields of an ``squeue --json`` job record that :func:`job_from_squeue_json`
    reads; decoding skips the ~100 others, nested objects included (as :class:`_SinfoNode`)."""

    job_id: Any = None
    job_state: Any = None
    name: Any = None
    state_reason: Any = None
    nodes: Any = None
    node_count: Any = None
    batch_flag: Any = None
    restart_cnt: Any = None
    user_name: Any = None
    tres_per_node: Any = None
    tres_per_job: Any = None
    tres_per_task: Any = None
    tres_per_socket: Any = None
    batch_host: Any = None


class _SqueueDoc(msgspec.Struct, gc=False):
    jobs: list[_SqueueJob] | None = None
    errors: Any = None


_SQUEUE: Final = msgspec.json.Decoder(_SqueueDoc)


def jobs_from_squeue_json(text: str) -> list[JobInfo]:
    return [job_from_squeue_json(j) for j in _typed_records(_SQUEUE, text, "squeue", "jobs")]


def job_from_scontrol(rec: Mapping[str, str]) -> JobInfo:
    try:
        job_id = _int(rec["JobId"], -1)
        state, raw = _job_state(rec["JobState"])
    except KeyError as e:
        raise SlurmParseError(f"scontrol job record lacks {e}") from None
    if job_id <= 0:
        raise SlurmParseError(f"scontrol job record with bad JobId {rec.get('JobId')!r}")
    nodelist = rec.get("NodeList", "")
    num_nodes = rec.get("NumNodes", "0").split("-")[0]
    return JobInfo(
        job_id=job_id,
        name=rec.get("JobName", ""),
        state=state,
        state_raw=raw,
        reason=rec.get("Reason", ""),
        nodes=tuple(expand(nodelist if nodelist != "(null)" else "")),
        num_nodes=_int(num_nodes),
        batch=rec.get("BatchFlag", "0") == "1",
        restarts=_int(rec.get("Restarts")),
        user=rec.get("UserId", "").split("(")[0],
        gres=_gres_request(*(rec.get(f"TresPer{per.capitalize()}") for per in _TRES_PER)),
        batch_host=_batch_host(rec.get("BatchHost", "")),
    )


def _batch_host(value: str) -> str:
    """scontrol's ``BatchHost``: ``(null)`` (none yet) as empty."""
    return "" if value in ("", "(null)") else value


def tres_limits(text: str) -> tuple[int | None, int | None]:
    """(nodes, GPUs) of a TRES limit string such as ``node=2,gres/gpu=16`` (sacctmgr's
    MaxTRES / MaxTRESPerJob); None where it sets none."""
    nodes = gpus = None
    for item in text.split(","):
        key, _, value = item.strip().partition("=")
        if not value.isdigit():
            continue
        if key == "node":
            nodes = int(value)
        elif key == "gres/gpu" or key.startswith("gres/gpu:"):
            gpus = int(value) if gpus is None else min(gpus, int(value))
    return nodes, gpus
