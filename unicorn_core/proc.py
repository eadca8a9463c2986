"""The one choke point for running external commands (Slurm tools, ssh helpers).

Every call has a timeout. A child runs in its own session so that on timeout the whole
process group is killed (SIGTERM, a grace period, SIGKILL), not only the direct child.
Failures become typed errors from :mod:`unicorn_core.errors` that carry the command,
its exit code and its output.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from unicorn_core.errors import CommandFailed, CommandNotFound, CommandTimeout

KILL_GRACE_S = 2.0


@dataclass(frozen=True, slots=True)
class CommandOutput:
    """What a finished command produced."""

    command: tuple[str, ...]
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float


def _kill_group(proc: asyncio.subprocess.Process, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


async def terminate_group(proc: asyncio.subprocess.Process, grace_s: float = KILL_GRACE_S) -> int:
    """SIGTERM the process group, wait ``grace_s``, then SIGKILL it; return the exit code."""
    if proc.returncode is not None:
        return proc.returncode
    _kill_group(proc, signal.SIGTERM)
    try:
        return await asyncio.wait_for(proc.wait(), grace_s)
    except TimeoutError:
        _kill_group(proc, signal.SIGKILL)
        return await proc.wait()


async def start(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdin_devnull: bool = True,
    capture: bool = True,
) -> asyncio.subprocess.Process:
    """Start a long-running command in its own session (for steps, agents, daemons).

    The caller owns the process and must end it with :func:`terminate_group`.
    """
    try:
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL if stdin_devnull else None,
            stdout=asyncio.subprocess.PIPE if capture else asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE if capture else asyncio.subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            start_new_session=True,
        )
    except FileNotFoundError as e:
        raise CommandNotFound(argv, None, message=f"executable not found: {e.filename}") from None


async def run(
    argv: Sequence[str],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    input_text: str | None = None,
    check: bool = True,
) -> CommandOutput:
    """Run a command to completion within ``timeout_s`` seconds.

    Raises :class:`CommandTimeout` (group killed, partial output attached),
    :class:`CommandNotFound`, or with ``check`` :class:`CommandFailed` on a non-zero exit.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    command = tuple(argv)
    t0 = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE if input_text is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(env) if env is not None else None,
            start_new_session=True,
        )
    except FileNotFoundError as e:
        raise CommandNotFound(command, None, message=f"executable not found: {e.filename}") from None
    stdout_chunks: list[bytes] = []
    stderr_chunks: list[bytes] = []

    async def pump(stream: asyncio.StreamReader | None, sink: list[bytes]) -> None:
        if stream is None:
            return
        while chunk := await stream.read(65536):
            sink.append(chunk)

    async def communicate() -> int:
        if input_text is not None and proc.stdin is not None:
            proc.stdin.write(input_text.encode())
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                await proc.stdin.drain()
            proc.stdin.close()
        await asyncio.gather(pump(proc.stdout, stdout_chunks), pump(proc.stderr, stderr_chunks))
        return await proc.wait()

    def text(chunks: list[bytes]) -> str:
        return b"".join(chunks).decode(errors="replace")

    try:
        code = await asyncio.wait_for(communicate(), timeout_s)
    except TimeoutError:
        await terminate_group(proc)
        raise CommandTimeout(command, timeout_s, text(stdout_chunks), text(stderr_chunks)) from None
    except BaseException:
        # Cancelled by our caller: never leave the child behind.
        _kill_group(proc, signal.SIGKILL)
        raise
    out = CommandOutput(command, code, text(stdout_chunks), text(stderr_chunks), time.monotonic() - t0)
    if check and code != 0:
        raise CommandFailed(command, code, out.stdout, out.stderr)
    return out
