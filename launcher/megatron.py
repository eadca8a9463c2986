"""Megatron-LM adapter: run ``pretrain_gpt.py`` under unicorn without changing it.

How a user's Megatron-LM job runs under unicorn:

- **Launch.** Per node: ``torchrun`` argv from :func:`launcher.render.torchrun_argv`,
  then ``pretrain_gpt.py`` and the user's own model/data arguments, then
  :func:`launcher.render.megatron_args` for the current layout (TP, PP, VPP,
  micro/global batch, distributed optimizer, recompute) plus
  ``--save/--load --ckpt-format torch_dist --exit-signal-handler``. Later arguments win
  in argparse, so the rendered layout overrides whatever the user's script had.
  :func:`pretrain_command` assembles exactly that.
- **Iteration timings, non-intrusively.** The agent reads the last rank's stdout and
  feeds it to :class:`LogFollower`, which turns Megatron's own ``training_log`` lines
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
- **Memory tier.** With ``memory_tier``, ranks run the script under
  ``python -m launcher.mcore_ckpt`` (:mod:`launcher.mcore_ckpt`): megatron-core's
  registry then hands Megatron-LM unicorn's torch_dist strategies, so its saves (the
  ``--exit-signal-handler`` one included) go to shared memory and the node agent seals,
  persists and replicates them; loads come back nearest first, resharded.
- **Resharding.** ``--ckpt-format torch_dist`` (``--use-dist-ckpt`` in releases before
  it) saves a distributed checkpoint that Megatron reshards on load, so the relaunch
  at a new TP/PP/DP resumes from it; the global batch stays fixed and Megatron derives
  the number of micro-batches (gradient accumulation) from DP, so optimizer steps keep
  their meaning.

This module is pure parsing and argv assembly; it imports neither torch nor Megatron.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from launcher.render import MegatronCheckpointing, megatron_args
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


def to_timing(
    it: MegatronIteration, *, job_id: int, node: str, rank: int, wall_time_s: float
) -> IterationTiming:
    """The protocol message for one parsed line (the interval's average as the duration)."""
    return IterationTiming(
        job_id=job_id,
        node=node,
        wall_time_s=wall_time_s,
        rank=rank,
        iteration=it.iteration,
        duration_s=it.elapsed_ms / 1000.0,
        samples=it.global_batch,
        phase=IterationPhase.TRAIN,
        loss=it.lm_loss,
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


def pretrain_command(
    torchrun: Sequence[str],
    script: str,
    user_args: Sequence[str],
    *,
    layout: Layout,
    model: ModelSpec | None,
    checkpointing: MegatronCheckpointing,
    memory_tier: bool = False,
) -> list[str]:
    """Full argv of one node: torchrun, the script, the user's arguments, then the layout's.

    The checkpoint directory must be given (``save_dir`` and ``load_dir``): a relaunch
    without ``--load`` would silently start from scratch. ``memory_tier``: each rank runs
    the script under ``python -m launcher.mcore_ckpt`` (torchrun's ``-m``), which puts
    Megatron's torch_dist checkpoints into unicorn's tiers, memory first.
    """
    if checkpointing.save_dir is None or checkpointing.load_dir is None:
        raise InvalidArgument(
            "a job under unicorn needs both --save and --load (the relaunch resumes from them)"
        )
    runner = ["-m", MEMORY_TIER_RUNNER] if memory_tier else []
    return [*torchrun, *runner, script, *user_args, *megatron_args(layout, model, checkpointing)]
