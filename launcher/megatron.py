"""Megatron-LM adapter: run ``pretrain_gpt.py`` under unicorn without changing it.

How a user's Megatron-LM job runs under unicorn:

- **Registration.** A task registered with ``--framework megatron`` has the command
  ``SCRIPT.py ARGS...``. :func:`check_user_args` refuses, before anything is registered,
  arguments that unicorn owns (the layout changes at each recovery) or that break
  resumption, requires ``--save`` (and ``--save-interval``, Megatron's own rule), and
  checks that model shape and global batch agree with the model file the planner plans
  from. Every other argument (data, tokenizer, optimizer, logging ...) is kept as is.
- **Launch.** Per node (:func:`pretrain_command`): ``torchrun`` argv from
  :func:`launcher.render.torchrun_argv`, ``-m launcher.mcore_ckpt``, the script and the
  user's arguments unchanged, then :func:`launcher.render.megatron_args` for the current
  layout (TP, PP, VPP, micro/global batch, distributed optimizer, recompute), the model
  shape and ``--save/--load --ckpt-format torch_dist --exit-signal-handler``, less what
  the user already gave (the check made sure it agrees).
- **Iteration timings, non-intrusively.** The agent reads the last rank's output line by
  line (:func:`parse_iteration_line`, :class:`Schedule`, :func:`to_timing`; a stream
  reader of its own: :class:`LogFollower`) and turns Megatron's own ``training_log`` lines
  into :class:`~unicorn_core.protocol.IterationTiming` values. Megatron prints one line
  per ``--log-interval`` with the *average* time per iteration over that interval, so
  the timing granularity is the log interval (use ``--log-interval 1`` for fast hang
  detection).
- **Exceptions.** torchrun writes a rank's uncaught exception to its error file when
  the entry point is wrapped in ``@record`` (``--log-dir`` keeps them);
  :func:`read_error_file` turns one into an
  :class:`~unicorn_core.protocol.ExceptionReport`. A script may also call
  ``launcher.hook.get_hook().install()`` itself.
- **Just-in-time save.** With ``--exit-signal-handler``, Megatron catches SIGTERM, saves
  a checkpoint at the end of the current iteration on every rank and exits; the agent
  therefore stops ranks with SIGTERM and a grace period before SIGKILL.
- **Memory tier.** Ranks always run the script under ``python -m launcher.mcore_ckpt``
  (:mod:`launcher.mcore_ckpt`, torchrun's ``-m``). Where the node agent exports a memory
  tier, megatron-core's registry then hands Megatron-LM unicorn's torch_dist strategies,
  so its saves (the ``--exit-signal-handler`` one included) go to shared memory and the
  node agent seals, persists and replicates them; loads come back nearest first,
  resharded. Without a tier in the environment the script runs untouched.
- **Resharding.** ``--ckpt-format torch_dist`` saves a distributed checkpoint that
  Megatron reshards on load, so the relaunch at a new TP/PP/DP resumes from it (with the
  distributed optimizer, ``--dist-ckpt-optim-fully-reshardable`` too: its default form
  reshards over DP only); the global batch stays fixed and Megatron derives the number
  of micro-batches (gradient accumulation) from DP, so optimizer steps keep their meaning.

This module is pure parsing and argv assembly; it imports neither torch nor Megatron.
"""

from __future__ import annotations

import itertools
import json
import posixpath
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from launcher.render import MegatronCheckpointing, megatron_args
from launcher.trainer.config import format_ranges, parse_ranges, skipped_before
from unicorn_core.errors import InvalidArgument
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec
from unicorn_core.protocol import ExceptionReport, IterationPhase, IterationTiming

MEMORY_TIER_RUNNER: Final = "launcher.mcore_ckpt"
"""The module a rank runs the Megatron-LM script under to checkpoint into the tiers."""
_HEAD: Final = re.compile(r"^\s*(?:\[[^\]]*\]\s*)?iteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
_FIELD: Final = re.compile(r"^\s*([A-Za-z][A-Za-z0-9 ()/_-]*?)\s*:\s*(\S+)\s*$")


@dataclass(frozen=True)
class MegatronIteration:
    """One parsed ``training_log`` line.

    ``elapsed_ms`` is Megatron's average per iteration over the log interval ending at
    ``iteration``. ``lm_loss`` is None where the line has no loss (e.g. a skipped
    fp16 iteration). ``extra`` keeps every other numeric field (throughput, grad norm,
    loss scale, ...) under Megatron's own name.
    """

    iteration: int
    train_iters: int
    consumed_samples: int | None
    elapsed_ms: float
    learning_rate: float | None
    global_batch: int | None
    lm_loss: float | None
    skipped: int
    nan: int
    extra: dict[str, float]


def parse_iteration_line(line: str) -> MegatronIteration | None:
    """Parse one line of Megatron output; None when it is not a training iteration line.

    Accepts the forms with and without the ``[YYYY-MM-DD hh:mm:ss]`` prefix and any
    extra ``name: value`` fields. A line that names an iteration but lacks the elapsed
    time is not a timing and yields None.
    """
    head = _HEAD.match(line.rstrip("\n"))
    if head is None:
        return None
    fields: dict[str, float] = {}
    for part in head[3].split("|"):
        match = _FIELD.match(part)
        if match is None:
            continue
        try:
            fields[match[1].lower()] = float(match[2])
        except ValueError:
            continue
    elapsed = fields.pop("elapsed time per iteration (ms)", None)
    if elapsed is None:
        return None

    def as_int(name: str) -> int | None:
        value = fields.pop(name, None)
        return None if value is None else int(value)

    return MegatronIteration(
        iteration=int(head[1]),
        train_iters=int(head[2]),
        consumed_samples=as_int("consumed samples"),
        elapsed_ms=elapsed,
        learning_rate=fields.pop("learning rate", None),
        global_batch=as_int("global batch size"),
        lm_loss=fields.pop("lm loss", None),
        skipped=as_int("number of skipped iterations") or 0,
        nan=as_int("number of nan iterations") or 0,
        extra=fields,
    )


def _last_int(argv: Sequence[str], names: Sequence[str]) -> int | None:
    """The value of the last of ``names`` given in ``argv`` (argparse's rule: the last one
    wins), ``--flag v`` or ``--flag=v``, old names included (:data:`_ALIASES`); None when
    absent or not a number. Tolerant, unlike :func:`_options`: it reads a rendered argv in
    the agent, where nothing may raise."""
    found: str | None = None
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if _ALIASES.get(flag, flag) in names:
            found = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    try:
        return int(found) if found is not None else None
    except ValueError:
        return None


@dataclass(frozen=True)
class Schedule:
    """When Megatron-LM logs, saves and evaluates, read from its command line.

    Megatron stops its interval timer while it saves or evaluates (``training.py``:
    ``save_checkpoint_and_time``, ``evaluate_and_print_results``), so the elapsed time a
    log line prints never holds them, while the silence before the next line does. The
    agent therefore times a report by the wall clock between two lines, and announces
    the report that will hold a save or an evaluation as a slow step (Megatron says it is
    saving on rank 0 only, while its iteration lines come from the last rank, usually on
    another node). A kind of step that falls in every log interval is no slow step: it
    is in every report's time.
    """

    log_interval: int = 100
    saves: tuple[int, ...] = ()
    """``--save-interval`` (alias ``--persistent-save-interval``) and
    ``--non-persistent-save-interval``: Megatron saves after every multiple of each."""
    eval_interval: int | None = None

    @classmethod
    def of(cls, argv: Sequence[str]) -> Schedule:
        log = _last_int(argv, ("--log-interval",))
        saves = (
            _last_int(argv, ("--save-interval",)),
            _last_int(argv, ("--non-persistent-save-interval",)),
        )
        evals = _last_int(argv, ("--eval-interval",))
        eval_iters = _last_int(argv, ("--eval-iters",))
        return cls(
            log_interval=log if log is not None and log > 0 else 100,
            saves=tuple(s for s in saves if s is not None and s > 0),
            eval_interval=evals if evals and evals > 0 and eval_iters != 0 else None,
        )

    def _slow(self, first: int, end: int) -> IterationPhase | None:
        """The slow phase of a step after iterations ``first .. end - 1`` (saves first)."""
        kinds: list[tuple[int, IterationPhase]] = [(s, IterationPhase.CHECKPOINT) for s in self.saves]
        if self.eval_interval:
            kinds.append((self.eval_interval, IterationPhase.EVAL))
        for interval, phase in kinds:
            if interval > self.log_interval and (end - 1) // interval >= -(-first // interval):
                return phase
        return None

    def phase_between(self, previous: int | None, iteration: int) -> IterationPhase:
        """The phase of the report of ``iteration``: a save or evaluation ran after one of
        ``previous .. iteration - 1`` (the line before; None: the run's first line, whose
        time Megatron's own)."""
        if previous is None:
            return IterationPhase.TRAIN
        return self._slow(previous, iteration) or IterationPhase.TRAIN

    def next_slow(self, iteration: int) -> IterationPhase | None:
        """The phase to announce after the line of ``iteration``: a save or evaluation falls
        before the next line (after one of ``iteration .. iteration + log_interval - 1``)."""
        return self._slow(iteration, iteration + self.log_interval)


def runs_megatron(argv: Sequence[str]) -> bool:
    """Whether ``argv`` runs a Megatron-LM script under unicorn's runner
    (``... -m launcher.mcore_ckpt SCRIPT``, what unicornd renders for ``--framework
    megatron``): the agent then follows Megatron-LM's log for iterations. The built-in
    trainer prints the same line format but reports through the hook, so its lines are
    never counted twice."""
    return any(a in ("-m", "--module") and b == MEMORY_TIER_RUNNER for a, b in itertools.pairwise(argv))


def to_timing(
    it: MegatronIteration,
    *,
    job_id: int,
    node: str,
    rank: int,
    wall_time_s: float,
    previous: int | None = None,
    launch_id: str = "",
    phase: IterationPhase = IterationPhase.TRAIN,
    gap_s: float | None = None,
) -> IterationTiming:
    """The protocol message for one parsed line: the interval's average as the duration.

    ``previous``: the iteration of the line before (same run), so ``span`` is the log
    interval; without it (the first line of a run) the span is 1, which only a warm-up
    step ever sees (hang monitors skip the first ``warmup_iterations`` reports).
    ``gap_s``: the wall-clock time since that line, which holds any save or evaluation
    between them (Megatron's own elapsed time does not: :class:`Schedule`); the duration
    is then ``gap_s / span``. ``phase``: :meth:`Schedule.phase_between`. The line of
    iteration ``train_iters`` is ``final``.
    """
    span = it.iteration - previous if previous is not None and it.iteration > previous else 1
    duration_s = gap_s / span if gap_s is not None and previous is not None else it.elapsed_ms / 1000.0
    grad_norm = it.extra.get("grad norm")
    loss_scale = it.extra.get("loss scale")
    return IterationTiming(
        job_id=job_id,
        node=node,
        wall_time_s=wall_time_s,
        rank=rank,
        iteration=it.iteration,
        duration_s=duration_s,
        samples=it.global_batch,
        phase=phase,
        loss=it.lm_loss,
        launch_id=launch_id,
        span=span,
        grad_norm=grad_norm,
        loss_scale=loss_scale,
        consumed_samples=it.consumed_samples,
        skipped_iterations=it.skipped,
        nan_iterations=it.nan,
        final=it.iteration >= it.train_iters,
    )


class LogFollower:
    """Incremental reader of a Megatron rank's output stream.

    :meth:`feed` takes arbitrary chunks (partial lines are kept until their newline) and
    yields the iteration lines completed by that chunk; :attr:`lines` counts lines read.
    """

    def __init__(self) -> None:
        self._partial = ""
        self.lines = 0

    def feed(self, chunk: str) -> Iterator[MegatronIteration]:
        data = self._partial + chunk
        *complete, self._partial = data.split("\n")
        for line in complete:
            self.lines += 1
            parsed = parse_iteration_line(line)
            if parsed is not None:
                yield parsed


def read_error_file(path: str | Path, *, job_id: int, node: str, rank: int | None) -> ExceptionReport:
    """Turn torchrun's per-rank error file (written by ``@record``) into an exception report.

    The file is ``{"message": {"message": "<Type>: <text>", "extraInfo": {"py_callstack":
    ..., "timestamp": "<epoch s>"}}}``; an older form has a plain string ``message``.
    Raises :class:`InvalidArgument` when the file is not that JSON.
    """
    text = Path(path).read_text()
    try:
        doc = json.loads(text)
        message = doc["message"]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(f"{path} is not a torchrun error file: {exc}") from None
    if isinstance(message, str):
        summary, callstack, stamp = message, "", None
    elif isinstance(message, dict):
        summary = str(message.get("message", ""))
        extra = message.get("extraInfo") or {}
        callstack = str(extra.get("py_callstack", ""))
        stamp = extra.get("timestamp")
    else:
        raise InvalidArgument(f"{path} is not a torchrun error file: message is {type(message).__name__}")
    exc_type, _, detail = summary.partition(": ")
    try:
        wall_time_s = float(stamp) if stamp is not None else Path(path).stat().st_mtime
    except ValueError:
        wall_time_s = Path(path).stat().st_mtime
    return ExceptionReport(
        job_id=job_id,
        node=node,
        wall_time_s=wall_time_s,
        rank=rank,
        exc_type=exc_type or "UnknownError",
        message=detail[:2048],
        traceback=callstack[-60_000:],
    )


# --- the user's command line -----------------------------------------------------------------

_LAYOUT: Final = "unicorn renders it from the layout it plans, which changes at each recovery"
_SPLIT: Final = (
    "it fixes how layers split over pipeline stages for one pipeline size, "
    "and unicorn changes the pipeline size at recoveries"
)
_CONVERT: Final = "converting a checkpoint is a run of its own, not training under unicorn"

_REFUSED: Final[Mapping[str, str]] = {
    # The layout: unicorn's.
    "--tensor-model-parallel-size": _LAYOUT,
    "--model-parallel-size": f"it is the old name of --tensor-model-parallel-size; {_LAYOUT}",
    "--pipeline-model-parallel-size": _LAYOUT,
    "--num-layers-per-virtual-pipeline-stage": _LAYOUT,
    "--num-virtual-stages-per-pipeline-rank": _LAYOUT,
    "--micro-batch-size": _LAYOUT,
    "--use-distributed-optimizer": _LAYOUT,
    "--overlap-param-gather": (
        "Megatron-LM allows it only with the distributed optimizer, which unicorn's layout decides "
        "(off at DP 1, or with plan.distributed_optimizer = false)"
    ),
    "--overlap-param-gather-with-optimizer-step": (
        "it needs the distributed optimizer and an interleaved schedule, which unicorn's layout decides"
    ),
    "--tp-comm-overlap": "Megatron-LM refuses it at TP 1, a layout unicorn may pick",
    "--recompute-granularity": _LAYOUT,
    "--recompute-method": _LAYOUT,
    "--recompute-num-layers": _LAYOUT,
    "--recompute-activations": f"it sets the recompute granularity; {_LAYOUT}",
    "--checkpoint-activations": f"it is the old --recompute-activations; {_LAYOUT}",
    "--pipeline-model-parallel-layout": _SPLIT,
    "--decoder-first-pipeline-num-layers": _SPLIT,
    "--decoder-last-pipeline-num-layers": _SPLIT,
    "--account-for-embedding-in-pipeline-split": _SPLIT,
    "--account-for-loss-in-pipeline-split": _SPLIT,
    "--microbatch-group-size-per-virtual-pipeline-stage": (
        "it tunes the interleaved schedule for one pipeline size; unicorn changes PP and VPP at recoveries"
    ),
    "--rampup-batch-size": (
        "unicorn plans for the model file's fixed global_batch; a ramp-up batch need not divide "
        "by micro-batch x DP of the layout a relaunch picks"
    ),
    "--use-megatron-fsdp": (
        "Megatron FSDP replaces the data parallelism unicorn plans and needs --ckpt-format "
        "fsdp_dtensor, which does not reshard to another TP/PP"
    ),
    "--use-torch-fsdp2": (
        "FSDP2 replaces the data parallelism unicorn plans and refuses pipeline parallelism "
        "and the distributed optimizer, which a planned layout may use"
    ),
    "--yaml-cfg": "Megatron-LM then ignores every command-line argument, the layout unicorn renders included",
    "--use-mp-args-from-checkpoint-args": (
        "it takes TP/PP/VPP/EP from the checkpoint instead of the layout unicorn renders"
    ),
    "--encoder-num-layers": "unicorn renders --num-layers from the model file, and Megatron-LM refuses both",
    "--encoder-seq-length": "unicorn renders --seq-length from the model file, and Megatron-LM refuses both",
    # Resumption: every relaunch must continue the run from its latest checkpoint.
    "--no-load-optim": "every relaunch would drop the optimizer state",
    "--no-save-optim": "the checkpoints a relaunch resumes from would lack the optimizer state",
    "--no-load-rng": "every relaunch would drop the random state",
    "--no-save-rng": "the checkpoints a relaunch resumes from would lack the random state",
    "--finetune": "every relaunch would restart at iteration 0 without the optimizer state",
    "--ckpt-step": "every relaunch would load that iteration again, not the latest checkpoint",
    "--load-main-params-from-ckpt": "it needs --no-load-optim: every relaunch would drop the optimizer state",
    "--use-legacy-models": (
        "legacy models save only --ckpt-format torch, which does not reshard to the layout of a relaunch"
    ),
    "--ckpt-convert-format": _CONVERT,
    "--ckpt-convert-save": _CONVERT,
    "--ckpt-convert-update-legacy-dist-opt-format": _CONVERT,
}
"""Flags refused whatever their value, and why (Megatron-LM's own spellings)."""

_ONLY: Final[Mapping[str, tuple[str, str]]] = {
    "--context-parallel-size": ("1", "unicorn plans no context parallelism"),
    "--expert-model-parallel-size": ("1", "unicorn plans no expert parallelism"),
    "--expert-tensor-parallel-size": (
        "1",
        "Megatron-LM needs expert TP x EP x PP to divide the world size; a relaunch changes PP and the world",
    ),
    "--num-distributed-optimizer-instances": ("1", "it must divide DP, which changes at each recovery"),
    "--ckpt-format": ("torch_dist", "only torch_dist checkpoints reshard to the layout of a relaunch"),
    "--non-persistent-ckpt-type": (
        "global",
        "'local' checkpoints stay on their node in one layout; 'in_memory' ones cannot be loaded",
    ),
    "--exit-signal": (
        "SIGTERM",
        "the node agent stops ranks with SIGTERM, which must make Megatron-LM save and exit",
    ),
}
"""Flags accepted with one value only: (that value, why)."""

_SHAPE: Final[Mapping[str, str]] = {
    "--num-layers": "layers",
    "--hidden-size": "hidden",
    "--ffn-hidden-size": "ffn_hidden",
    "--num-attention-heads": "heads",
    "--seq-length": "sequence",
    "--num-query-groups": "num_query_groups",
    "--global-batch-size": "global_batch",
}
"""Flags that must equal a :class:`ModelSpec` field (the planner plans from the spec)."""

_VALUED: Final = frozenset(
    {*_ONLY, *_SHAPE, "--max-position-embeddings", "--save", "--load", "--save-interval"}
)
"""Flags whose value :func:`check_user_args` reads (each takes exactly one)."""
_ALIASES: Final[Mapping[str, str]] = {"--persistent-save-interval": "--save-interval"}
_KNOWN: Final = frozenset({*_REFUSED, *_VALUED, *_ALIASES, "--group-query-attention"})


@dataclass(frozen=True)
class MegatronUserArgs:
    """A Megatron-LM command that passed :func:`check_user_args`.

    ``args`` are the user's arguments, unchanged. ``load_dir`` is the user's ``--load``
    (equal to ``save_dir``) or ``save_dir``. ``given``: every option the user passed, in
    Megatron-LM's canonical spelling, so rendering can leave out what is already there.
    """

    script: str
    args: tuple[str, ...]
    save_dir: str
    load_dir: str
    save_interval: int
    given: frozenset[str]


def _options(args: Sequence[str]) -> Iterator[tuple[str, str, str | None]]:
    """(as written, canonical flag, value) per option in ``args``, as argparse reads them:
    ``--flag value`` or ``--flag=value``. The value is read only for :data:`_VALUED` flags
    (None otherwise); other tokens (the values of flags unicorn does not read) are skipped."""
    i = 0
    while i < len(args):
        word = args[i]
        i += 1
        if not word.startswith("--") or word == "--":
            continue
        written, eq, inline = word.partition("=")
        flag = _ALIASES.get(written, written)
        if flag not in _VALUED:
            yield written, flag, None
        elif eq:
            yield written, flag, inline
        elif i < len(args) and not args[i].startswith("--"):
            i += 1
            yield written, flag, args[i - 1]
        else:
            raise InvalidArgument(f"{written} needs a value")


def _int(written: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise InvalidArgument(f"{written} {value!r} is not an integer") from None


def _is(value: str, allowed: str) -> bool:
    if allowed.isdigit():
        try:
            return int(value) == int(allowed)
        except ValueError:
            return False
    return value == allowed


def check_user_args(command: Sequence[str], model: ModelSpec) -> MegatronUserArgs:
    """Check a ``--framework megatron`` task's command against what unicorn owns; pure.

    The command must be ``SCRIPT.py ARGS...``: each rank runs the script with the nodes'
    python under ``-m launcher.mcore_ckpt``. Raises :class:`InvalidArgument`, naming the
    flag and why, for a flag unicorn renders from the layout or that breaks resuming
    (:data:`_REFUSED`, :data:`_ONLY`), a missing ``--save`` or ``--save-interval``, a
    ``--load`` other than ``--save``, a model shape or ``--global-batch-size`` that
    differs from ``model`` (the planner plans from it; both values shown), or a
    ``--max-position-embeddings`` below the sequence. Where a flag repeats, the last
    counts, as in argparse. Not refused: ``--use-checkpoint-args`` (without
    ``--use-mp-args-from-checkpoint-args`` it takes only model arguments, from a
    checkpoint this very run saved) and ``--async-save`` (Megatron-LM finishes pending
    saves before the SIGTERM exit; the memory tier runner completes them at once).
    """
    if not command or not command[0].endswith(".py"):
        got = command[0] if command else ""
        raise InvalidArgument(
            f"framework megatron needs the command SCRIPT.py ARGS... (e.g. pretrain_gpt.py ...): "
            f"torchrun runs the script with the nodes' python under -m {MEMORY_TIER_RUNNER}; got {got!r}"
        )
    args = tuple(command[1:])
    given: set[str] = set()
    values: dict[str, tuple[str, str]] = {}
    for written, flag, value in _options(args):
        dashed = written.replace("_", "-")
        if written != dashed and written not in _KNOWN and dashed in _KNOWN:
            raise InvalidArgument(f"{written} is not a Megatron-LM option: it is spelled {dashed}")
        if flag in _REFUSED:
            raise InvalidArgument(f"{written} cannot be given to a task under unicorn: {_REFUSED[flag]}")
        given.add(flag)
        if value is not None:
            values[flag] = (written, value)
    _check_values(values, model)
    if (
        "--group-query-attention" in given
        and "--num-query-groups" not in values
        and model.num_query_groups == model.heads
    ):
        raise InvalidArgument(
            "--group-query-attention without --num-query-groups means 1 query group; the model file "
            f"has num_query_groups = heads = {model.heads} (no grouped-query attention)"
        )
    if "--swiglu" in given and "--ffn-hidden-size" not in values:
        raise InvalidArgument(
            "--swiglu needs --ffn-hidden-size: unicorn renders --ffn-hidden-size from the model file "
            f"({model.ffn_hidden}), which would replace Megatron-LM's own SwiGLU default; give it, equal "
            "to the model file's ffn_hidden"
        )
    save, load, interval = _checkpointing(values)
    return MegatronUserArgs(
        script=command[0],
        args=args,
        save_dir=save,
        load_dir=load,
        save_interval=interval,
        given=frozenset(given),
    )


def _check_values(values: Mapping[str, tuple[str, str]], model: ModelSpec) -> None:
    """The one-value flags (:data:`_ONLY`), the shape (:data:`_SHAPE`), max positions."""
    for flag, (allowed, why) in _ONLY.items():
        if flag in values and not _is(values[flag][1], allowed):
            written, value = values[flag]
            raise InvalidArgument(f"{written} {value} cannot be used under unicorn (only {allowed}): {why}")
    for flag, field in _SHAPE.items():
        if flag in values:
            written, value = values[flag]
            number, expected = _int(written, value), getattr(model, field)
            if number != expected:
                raise InvalidArgument(
                    f"{written} {number} differs from the model file's {field} = {expected}: "
                    "unicorn plans the layout from the model file, so they must agree"
                )
    if "--max-position-embeddings" in values:
        written, value = values["--max-position-embeddings"]
        if _int(written, value) < model.sequence:
            raise InvalidArgument(
                f"{written} {value} is below the model file's sequence = {model.sequence} "
                "(Megatron-LM needs max positions >= the sequence length)"
            )


def _checkpointing(values: Mapping[str, tuple[str, str]]) -> tuple[str, str, int]:
    """(save dir, load dir, save interval): ``--save`` and ``--save-interval`` required,
    ``--load`` (if given) the same directory as ``--save``."""
    save = values["--save"][1] if "--save" in values else ""
    if not save:
        raise InvalidArgument(
            "--save DIR is required under unicorn: every relaunch resumes from the checkpoints there "
            "(unicorn passes --load DIR, the same directory)"
        )
    if "--save-interval" not in values:
        raise InvalidArgument(
            "--save needs --save-interval N (Megatron-LM's rule); unicorn's save on SIGTERM comes on top"
        )
    written, value = values["--save-interval"]
    interval = _int(written, value)
    if interval <= 0:
        raise InvalidArgument(f"{written} must be positive, got {interval}")
    load = values["--load"][1] if "--load" in values else save
    if posixpath.normpath(load) != posixpath.normpath(save):
        raise InvalidArgument(
            f"--load {load} differs from --save {save}: a relaunch must resume from the checkpoints "
            "this run saves (leave --load out; unicorn passes --load with the --save directory)"
        )
    return save, load, interval


def _without(argv: Sequence[str], given: frozenset[str]) -> list[str]:
    """``argv`` less each flag in ``given`` and its values (rendered values never start with ``--``)."""
    out: list[str] = []
    keep = True
    for token in argv:
        if token.startswith("--"):
            keep = token not in given
        if keep:
            out.append(token)
    return out


ITERATIONS_TO_SKIP: Final = "--iterations-to-skip"


def skip_args(user_args: Sequence[str], skip: Sequence[tuple[int, int]]) -> tuple[list[str], list[str]]:
    """(the user's arguments less any ``--iterations-to-skip`` and its values, the flag to
    append): Megatron-LM's ``--iterations-to-skip`` with the user's values and, for each of
    unicorn's 1-based ranges ``(A, B)``, Megatron's numbers ``A-1 .. B-1``.

    Megatron-LM tests ``iteration in args.iterations_to_skip`` before it trains a step,
    where ``iteration`` counts the steps done: the step its log line calls ``k`` is skipped
    by ``k-1``. It then consumes the step's batches without training on them (the data stays
    aligned) and logs no line for it. argparse keeps the last ``--iterations-to-skip`` only,
    so the user's values are merged into the one flag appended."""
    kept: list[str] = []
    values: set[int] = set()
    taking = False
    for token in user_args:
        if token == ITERATIONS_TO_SKIP:
            taking = True
            continue
        if taking and token.lstrip("-").isdigit():
            values.add(int(token))
            continue
        taking = False
        kept.append(token)
    for first, last in skip:
        values.update(range(first - 1, last))
    return kept, ([ITERATIONS_TO_SKIP, *(str(v) for v in sorted(values))] if values else [])


RERUN_DISABLED: Final = ("--rerun-mode", "disabled")
"""What a launch that skips data after a roll back adds (after the user's arguments, so it
wins over a user's ``--rerun-mode``). Megatron-LM's rerun state machine (default ``validate_results``)
answers a NaN or Inf loss it can reproduce by saving the iteration before it, marked to
re-run the step on another GPU, and exiting 16; a run that loads that version resumes the
re-run, and with the step skipped exits 17 without training (seen with megatron-core
0.16.1). Disabled, Megatron ignores the saved re-run state and still checks every loss: a
NaN or Inf raises a RuntimeError naming the iteration, classified ``nan_loss``."""

SKIPPED_FILE: Final = "unicorn-skipped"
"""In a Megatron-LM version folder (``iter_NNNNNNN``): the iterations the saving run had
skipped by then (``A-B,C-D``, 1-based as the log lines count; absent: none). Written by the
runner (:mod:`launcher.mcore_ckpt`) with every memory-tier save."""
TRACKER_FILE: Final = "latest_checkpointed_iteration.txt"


def skipped_ranges(args: Sequence[str]) -> tuple[tuple[int, int], ...]:
    """The 1-based iteration ranges Megatron-LM's ``--iterations-to-skip`` values in ``args``
    skip (Megatron's value ``v`` skips the step its log calls ``v + 1``)."""
    _, flag = skip_args(args, ())
    return parse_ranges(",".join(str(int(v) + 1) for v in flag[1:]))


def skipped_by(save_dir: str | Path, iteration: int) -> str:
    """What the run that saved ``iteration`` in ``save_dir`` had skipped (:data:`SKIPPED_FILE`)."""
    try:
        return (Path(save_dir) / f"iter_{iteration:07d}" / SKIPPED_FILE).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return ""


def rollback_load(args: Sequence[str]) -> list[str]:
    """A Megatron-LM command that skips data (``--iterations-to-skip``) made to load only a
    version of its own past: the newest complete one in ``--load`` whose saving run skipped
    what this run skips by then (never one trained on the skipped data, such as the
    versions the run that met a loss spike saved after it). Appends ``--ckpt-step N`` when
    that is not the tracker's latest; drops ``--load`` when no version qualifies (the run
    starts from its initial state). Unchanged without skips, with ``--ckpt-step`` given, or
    without ``--load``."""
    out = list(args)
    skip = skipped_ranges(out)
    if not skip or "--ckpt-step" in out or "--load" not in out:
        return out
    at = out.index("--load")
    if at + 1 >= len(out):
        return out
    load = Path(out[at + 1])
    try:
        latest: int | None = int((load / TRACKER_FILE).read_text().strip())
    except (FileNotFoundError, ValueError):
        latest = None
    versions = sorted(
        (
            int(p.name.removeprefix("iter_"))
            for p in load.glob("iter_[0-9]*")
            if p.name.removeprefix("iter_").isdigit() and (p / "metadata.json").is_file()
        ),
        reverse=True,
    )
    for version in versions:
        if latest is not None and version > latest:
            continue
        if skipped_by(load, version) == format_ranges(skipped_before(skip, version)):
            return out if version == latest else [*out, "--ckpt-step", str(version)]
    return out[:at] + out[at + 2 :] if versions or latest is not None else out


def pretrain_command(
    torchrun: Sequence[str],
    command: Sequence[str],
    *,
    layout: Layout,
    model: ModelSpec,
    skip: Sequence[tuple[int, int]] = (),
) -> list[str]:
    """One node's argv for a Megatron-LM task: the one place that assembles it.

    torchrun, ``-m launcher.mcore_ckpt`` (no ``--no-python``: torchrun runs the module
    with its own python), the script and the user's arguments unchanged, then what
    unicorn owns: :func:`launcher.render.megatron_args` for ``layout`` and ``model`` with
    ``--save``/``--load`` the user's ``--save`` directory, ``--ckpt-format torch_dist``
    and ``--exit-signal-handler``, less the flags the user already gave
    (:func:`check_user_args`, run here, made sure they agree). Raises
    :class:`InvalidArgument` when the command fails that check or the layout's global
    batch is not the model's.

    No ``--override-opt_param-scheduler``: on load, Megatron's scheduler checks that max
    and min LR, warmup and decay steps, decay style and the weight-decay schedule equal
    the checkpoint's (``OptimizerParamScheduler._check_and_set``). Those derive from the
    user's LR arguments, ``--train-iters``/``--train-samples`` and the global batch, never
    from DP or the micro-batch, and all of them are the same at every layout, so a
    relaunch passes the check as is. The override would only hide a real change, and
    Megatron refuses it next to a user's ``--use-checkpoint-opt_param-scheduler``.

    ``skip``: iterations (1-based ranges, as Megatron's log lines number them) whose data
    the task skips after a roll back past a loss spike or NaN; appended as Megatron-LM's own
    ``--iterations-to-skip`` (:func:`skip_args`), after :data:`RERUN_DISABLED`.
    """
    user = check_user_args(command, model)
    if layout.global_batch != model.global_batch:
        raise InvalidArgument(
            f"layout global_batch {layout.global_batch} differs from the model's {model.global_batch}"
        )
    ours = megatron_args(layout, model, MegatronCheckpointing(save_dir=user.save_dir, load_dir=user.load_dir))
    args, skipping = skip_args(user.args, skip)
    rerun = RERUN_DISABLED if skip else ()
    unicorns = [*_without(ours, user.given), *rerun, *skipping]
    return [*torchrun, "-m", MEMORY_TIER_RUNNER, user.script, *args, *unicorns]
