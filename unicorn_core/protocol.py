"""The wire protocol between node agents, the coordinator (unicornd) and the CLI.

Every message is defined here and nowhere else. On the wire a message is one msgpack
map: the envelope fields (``type``, ``v``, ``job_id``, ``node``, ``wall_time_s``) plus
the fields of its type, keyed by name. ``type`` is a short tag that never changes once
released (``hb``, ``exit``, ``exc``, ``iter``, ``slow``, ``gpu``, ``fault``, ``cmd``,
``result``).

Versioning (``v``, currently :data:`SCHEMA_VERSION`):

- Additive changes keep ``v``: a new field *with a default*, or a new message type.
  Readers ignore fields they do not know, fill defaults for fields a sender left out,
  and count a type they do not know as ``unknown_type``.
- Breaking changes bump ``v``: removing, renaming or retyping a field, a new required
  field, a new enum member, a changed meaning or unit, tighter validation. Readers
  reject every other version as ``unknown_version`` (checked before any field is
  validated), so writers and readers of one release are deployed together.

``wall_time_s`` is ``time.time()`` at the sender, for display and persistence only;
nothing computes deadlines or intervals from it.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from typing import Final, TypeAlias

import msgspec

from unicorn_core.errors import ProtocolError

SCHEMA_VERSION: Final = 1
MAX_MESSAGE_BYTES: Final = 1024 * 1024
"""Largest encoded message accepted by :func:`encode` and :func:`decode`, in bytes."""

_DETAIL_CHARS = 200


class GpuFaultKind(enum.StrEnum):
    """What a :class:`GpuHealthEvent` reports."""

    ECC_UNCORRECTABLE = "ecc_uncorrectable"
    XID = "xid"
    NVLINK_ERROR = "nvlink_error"
    RETIRED_PAGES = "retired_pages"
    REMAPPED_ROWS = "remapped_rows"
    TEMPERATURE = "temperature"
    DRIVER_ERROR = "driver_error"


class IterationPhase(enum.StrEnum):
    """What kind of step an :class:`IterationTiming` timed.

    Only ``train`` steps feed the hang and slowdown statistics; checkpoint and
    evaluation steps are legitimately slower and are excluded.
    """

    TRAIN = "train"
    CHECKPOINT = "checkpoint"
    EVAL = "eval"


class AgentAction(enum.StrEnum):
    """What an :class:`AgentCommand` asks a node agent to do."""

    STOP = "stop"
    RESTART_RANKS = "restart_ranks"
    RELAUNCH = "relaunch"
    CHECKPOINT_NOW = "checkpoint_now"


def _check(ok: bool, problem: str) -> None:
    if not ok:
        raise ValueError(problem)


def _check_optional_index(value: int | None, name: str) -> None:
    _check(value is None or value >= 0, f"{name} must be >= 0 or None, got {value}")


def _check_finite(value: float, name: str, *, minimum: float | None = None) -> None:
    _check(math.isfinite(value), f"{name} must be finite, got {value}")
    if minimum is not None:
        _check(value >= minimum, f"{name} must be >= {minimum:g}, got {value}")


class Envelope(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Fields every message carries. Constructing an invalid message raises ValueError."""

    v: int = SCHEMA_VERSION
    job_id: int
    node: str
    wall_time_s: float

    def __post_init__(self) -> None:
        if self.v != SCHEMA_VERSION:
            raise ValueError(f"unknown schema version {self.v}, expected {SCHEMA_VERSION}")
        _check(self.job_id >= 0, f"job_id must be >= 0, got {self.job_id}")
        _check(self.node != "", "node must be non-empty")
        _check_finite(self.wall_time_s, "wall_time_s", minimum=0.0)


class Heartbeat(Envelope, frozen=True, kw_only=True, tag="hb"):
    """Agent -> coordinator, periodically: the agent and its training processes are alive.

    ``iteration`` is the last completed training iteration (None before the first);
    ``seq`` increases by one per heartbeat of one agent process. ``cpu_wait_s`` is how
    long, in all, the agent's most-starved rank has waited runnable for a CPU (summed
    over the agent's samples; it only grows within one agent process; None: not
    measured), so hang detection tells CPU starvation from a hang (:mod:`detect.stats`).
    """

    agent_pid: int
    pids: list[int]
    iteration: int | None
    seq: int
    cpu_wait_s: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.agent_pid > 0, f"agent_pid must be > 0, got {self.agent_pid}")
        _check(all(pid > 0 for pid in self.pids), f"pids must all be > 0, got {self.pids}")
        _check_optional_index(self.iteration, "iteration")
        _check(self.seq >= 0, f"seq must be >= 0, got {self.seq}")
        if self.cpu_wait_s is not None:
            _check_finite(self.cpu_wait_s, "cpu_wait_s", minimum=0.0)


class ProcessExit(Envelope, frozen=True, kw_only=True, tag="exit"):
    """Agent -> coordinator: a supervised training process ended.

    ``exit_code`` (0-255) is set when it exited on its own, ``signal`` when a signal
    killed it (never both; both None when the status is unknown). ``error_file_text`` is
    the rank's torchelastic error file, and ``stderr_tail`` the end of its stderr, both
    truncated by the sender to keep the message under :data:`MAX_MESSAGE_BYTES`.
    ``launch_id``: the coordinator action that started the process (as on
    :class:`IterationTiming`; empty when unknown): the exit of ranks a later launch
    replaced is no fault of that launch.
    """

    rank: int | None
    local_rank: int | None
    pid: int
    exit_code: int | None
    signal: int | None
    error_file_text: str | None
    stderr_tail: str
    launch_id: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_optional_index(self.rank, "rank")
        _check_optional_index(self.local_rank, "local_rank")
        _check(self.pid > 0, f"pid must be > 0, got {self.pid}")
        _check(
            self.exit_code is None or self.signal is None,
            f"exit_code and signal are exclusive, got {self.exit_code} and {self.signal}",
        )
        _check(
            self.exit_code is None or 0 <= self.exit_code <= 255,
            f"exit_code must be in 0..255 (a signal goes in `signal`), got {self.exit_code}",
        )
        _check(self.signal is None or self.signal > 0, f"signal must be > 0, got {self.signal}")


class ExceptionReport(Envelope, frozen=True, kw_only=True, tag="exc"):
    """Agent -> coordinator: a training process raised (``rank`` None when unknown).
    ``launch_id``: set by the agent, as on :class:`ProcessExit`."""

    rank: int | None
    exc_type: str
    message: str
    traceback: str
    launch_id: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_optional_index(self.rank, "rank")
        _check(self.exc_type != "", "exc_type must be non-empty")


class IterationTiming(Envelope, frozen=True, kw_only=True, tag="iter"):
    """Agent -> coordinator: one rank finished ``iteration`` in ``duration_s`` seconds.

    ``phase`` says whether the time includes a checkpoint save or an evaluation;
    ``loss`` is the training loss the rank saw, when it knows it. ``launch_id`` is set by
    the agent: the id of the coordinator action that started the reporting ranks (empty
    when unknown), so an iteration of ranks about to be replaced never counts as the
    replacement's progress.

    ``span``: how many iterations, ending at ``iteration``, the report covers;
    ``duration_s`` is then their average (Megatron-LM logs one line per
    ``--log-interval`` with the interval's mean), so the silence a hang monitor allows
    between reports is ``span * duration_s``. The optional training-state fields come
    from trainers that print them (Megatron-LM's own log line): ``grad_norm``,
    ``loss_scale``, ``consumed_samples`` and the run's ``skipped_iterations`` and
    ``nan_iterations`` over the interval. ``final``: the run's last iteration (Megatron-LM's
    ``iteration N/ N``): the ranks save and end next, so silence after it is no hang.
    ``microbatches``: micro-batches per iteration over all data-parallel replicas (what a
    restart of the whole iteration computes again); ``recomputed_microbatches``: how many of
    them this iteration computed again because a replica was lost in the middle of it
    (the built-in trainer's ``--reuse-microbatches``: the lost replica's, not the whole
    iteration's).

    ``compute_s``: this rank's own compute time for the iteration (forward, backward,
    optimizer), excluding the time it waited for its peers in collectives; None: not
    measured. In lock-step training every rank's ``duration_s`` is the slowest rank's, so
    only this tells a straggler apart (:mod:`detect.stragglers`). ``stage``: the rank's
    pipeline stage (ranks of one stage do the same work; compute times are compared only
    among them; None counts as stage 0).
    """

    rank: int
    iteration: int
    duration_s: float
    samples: int | None
    phase: IterationPhase = IterationPhase.TRAIN
    loss: float | None = None
    launch_id: str = ""
    span: int = 1
    grad_norm: float | None = None
    loss_scale: float | None = None
    consumed_samples: int | None = None
    skipped_iterations: int | None = None
    nan_iterations: int | None = None
    final: bool = False
    microbatches: int | None = None
    recomputed_microbatches: int | None = None
    compute_s: float | None = None
    stage: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.rank >= 0, f"rank must be >= 0, got {self.rank}")
        _check(self.iteration >= 0, f"iteration must be >= 0, got {self.iteration}")
        _check_finite(self.duration_s, "duration_s", minimum=0.0)
        _check_optional_index(self.samples, "samples")
        _check(self.span >= 1, f"span must be >= 1, got {self.span}")
        for name in ("consumed_samples", "skipped_iterations", "nan_iterations", "microbatches"):
            _check_optional_index(getattr(self, name), name)
        _check_optional_index(self.recomputed_microbatches, "recomputed_microbatches")
        _check(
            self.recomputed_microbatches is None
            or self.microbatches is None
            or self.recomputed_microbatches <= self.microbatches,
            f"recomputed_microbatches {self.recomputed_microbatches} exceeds "
            f"microbatches {self.microbatches}",
        )
        if self.compute_s is not None:
            _check_finite(self.compute_s, "compute_s", minimum=0.0)
        _check_optional_index(self.stage, "stage")

    @property
    def interval_s(self) -> float:
        """The time the report covers: what a hang monitor learns as one step."""
        return self.duration_s * self.span


class SlowStep(Envelope, frozen=True, kw_only=True, tag="slow"):
    """Agent -> coordinator: ``rank`` announces that iteration ``iteration`` is a slow step.

    Sent before a checkpoint save or an evaluation starts, so hang detection allows that
    phase's learned time instead of the training deadline (a save is not a hang).
    """

    rank: int
    iteration: int
    phase: IterationPhase

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.rank >= 0, f"rank must be >= 0, got {self.rank}")
        _check(self.iteration >= 0, f"iteration must be >= 0, got {self.iteration}")
        _check(self.phase != IterationPhase.TRAIN, "a slow step is a checkpoint or eval step")


class GpuHealthEvent(Envelope, frozen=True, kw_only=True, tag="gpu"):
    """Agent -> coordinator: a GPU fault or threshold crossing.

    ``value`` is the kind's reading (XID code, error count, degrees C); ``injected`` is
    True only when the test fault-injection path raised the event.
    """

    gpu_index: int
    kind: GpuFaultKind
    value: float
    detail: str
    injected: bool

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.gpu_index >= 0, f"gpu_index must be >= 0, got {self.gpu_index}")
        _check_finite(self.value, "value")


class FaultReport(Envelope, frozen=True, kw_only=True, tag="fault"):
    """Agent -> coordinator: evidence the agent classified itself.

    Sent for what only the node sees: an error signature in a rank's stderr, or a local
    hang (no iteration for longer than the learned threshold). ``status`` and
    ``severity`` are the agent's classification (``detect`` status names, ``SEV1``..
    ``SEV3``); the coordinator may re-classify from ``evidence``. ``rule`` names the
    matching rule; ``rank`` is the rank the evidence points at (None when unknown).
    ``launch_id``: the launch whose ranks the evidence is about, as on :class:`ProcessExit`.
    """

    status: str
    severity: str
    rule: str
    rank: int | None
    evidence: str
    launch_id: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.status != "", "status must be non-empty")
        _check(self.severity in ("SEV1", "SEV2", "SEV3"), f"bad severity {self.severity!r}")
        _check_optional_index(self.rank, "rank")


class AgentCommand(Envelope, frozen=True, kw_only=True, tag="cmd"):
    """Coordinator -> one agent: do ``action`` within ``deadline_s`` seconds of receipt.

    ``argv`` and ``env`` are the new training command for ``relaunch`` (``argv`` is empty
    for every other action). ``command_id`` is echoed in the :class:`CommandResult`.
    ``fence``: the fencing token of the unicornd that sent it (0: unknown); an agent that
    has seen a newer one refuses it, so a deposed leader cannot command agents.
    """

    command_id: str
    action: AgentAction
    argv: list[str] = msgspec.field(default_factory=list)
    env: dict[str, str] = msgspec.field(default_factory=dict)
    deadline_s: float
    fence: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.command_id != "", "command_id must be non-empty")
        _check(
            self.action == AgentAction.RELAUNCH or not self.argv,
            f"argv must be empty for action {self.action}",
        )
        _check_finite(self.deadline_s, "deadline_s")
        _check(self.deadline_s > 0, f"deadline_s must be > 0, got {self.deadline_s}")
        _check(self.fence >= 0, f"fence must be >= 0, got {self.fence}")


class CommandResult(Envelope, frozen=True, kw_only=True, tag="result"):
    """Agent -> coordinator: outcome of the :class:`AgentCommand` with ``command_id``."""

    command_id: str
    ok: bool
    detail: str

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.command_id != "", "command_id must be non-empty")


Message: TypeAlias = (
    Heartbeat
    | ProcessExit
    | ExceptionReport
    | IterationTiming
    | SlowStep
    | GpuHealthEvent
    | FaultReport
    | AgentCommand
    | CommandResult
)
"""Any message of the current schema version."""

MESSAGE_TYPES: Final[tuple[type[Message], ...]] = (
    Heartbeat,
    ProcessExit,
    ExceptionReport,
    IterationTiming,
    SlowStep,
    GpuHealthEvent,
    FaultReport,
    AgentCommand,
    CommandResult,
)

_TAGS: Final = frozenset(str(cls.__struct_config__.tag) for cls in MESSAGE_TYPES)


class _Version(msgspec.Struct):
    """Read first, so that other versions are rejected before their fields are validated."""

    v: int


# Stateless and immutable; built once because building them is the costly part.
_VERSION_DECODER: Final = msgspec.msgpack.Decoder(_Version)
_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final[msgspec.msgpack.Decoder[Message]] = msgspec.msgpack.Decoder(Message)
_ANY_DECODER: Final = msgspec.msgpack.Decoder()


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _DETAIL_CHARS else text[:_DETAIL_CHARS] + "..."


def encode(msg: Message) -> bytes:
    """Encode ``msg`` as msgpack.

    Raises ProtocolError ``too_large`` above :data:`MAX_MESSAGE_BYTES` (senders
    truncate free text first) and ``invalid`` for unencodable values (an int beyond
    64 bits, a str with lone surrogates).
    """
    try:
        data = _ENCODER.encode(msg)
    except (msgspec.EncodeError, OverflowError, ValueError, TypeError) as exc:
        raise ProtocolError("invalid", f"cannot encode {type(msg).__name__}: {exc}") from exc
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            "too_large", f"{type(msg).__name__} is {len(data)} bytes, limit {MAX_MESSAGE_BYTES}"
        )
    return data


def decode(data: bytes) -> Message:
    """Decode and validate one message.

    Raises ProtocolError, and nothing else for any bytes, with kind ``too_large``
    (over :data:`MAX_MESSAGE_BYTES`), ``malformed`` (not msgpack, truncated, trailing
    bytes, not a map), ``unknown_version``, ``unknown_type``, or ``invalid`` (missing or
    wrongly typed fields, bad values, a missing or non-int ``v``, a missing ``type``).
    ``v`` is required on the wire although constructors default it.
    """
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError("too_large", f"{len(data)} bytes, limit {MAX_MESSAGE_BYTES}")
    try:
        version = _VERSION_DECODER.decode(data).v
        if version == SCHEMA_VERSION:
            return _DECODER.decode(data)
    except Exception as exc:  # anything msgspec raises, e.g. RecursionError on deep nesting
        raise _classify(data, exc) from exc
    raise ProtocolError("unknown_version", f"v={version}, this reader speaks v={SCHEMA_VERSION}")


def _classify(data: bytes, exc: Exception) -> ProtocolError:
    """Explain why typed decoding of ``data`` failed with ``exc``: version first, then type."""
    try:
        raw = _ANY_DECODER.decode(data)
    except Exception as raw_exc:
        return ProtocolError("malformed", str(raw_exc) or type(raw_exc).__name__)
    if not isinstance(raw, dict):
        return ProtocolError("malformed", f"expected a map, got {type(raw).__name__}")
    envelope_error = _check_envelope(raw)
    if envelope_error is not None:
        return envelope_error
    return ProtocolError("invalid", f"{raw['type']}: {exc}" if str(exc) else type(exc).__name__)


def _check_envelope(raw: dict[object, object]) -> ProtocolError | None:
    if "v" not in raw:
        return ProtocolError("invalid", "missing envelope field `v`")
    version = raw["v"]
    if type(version) is not int:
        return ProtocolError("invalid", f"envelope field `v` must be an int, got {_short(version)}")
    if version != SCHEMA_VERSION:
        return ProtocolError("unknown_version", f"v={version}, this reader speaks v={SCHEMA_VERSION}")
    tag = raw.get("type")
    if not isinstance(tag, str):
        return ProtocolError("invalid", f"envelope field `type` must be a str, got {_short(tag)}")
    if tag not in _TAGS:
        return ProtocolError("unknown_type", f"type={_short(tag)}")
    return None


class SafeDecoder:
    """Decoder for readers: returns None instead of raising, and counts.

    ``decoded`` counts messages returned; ``failures`` counts rejected inputs by
    ProtocolError kind; ``last_error`` is the latest rejection, for the caller to log.
    Logs nothing itself. Not thread-safe (one per reader).
    """

    def __init__(self) -> None:
        self.decoded = 0
        self.failures: Counter[str] = Counter()
        self.last_error: ProtocolError | None = None

    def decode(self, data: bytes) -> Message | None:
        """The decoded message, or None (counted under its failure kind)."""
        try:
            msg = decode(data)
        except ProtocolError as exc:
            self.failures[exc.kind] += 1
            self.last_error = exc
            return None
        self.decoded += 1
        return msg
