"""The error taxonomy shared by every package.

Each error says whether retrying the same call may succeed (``temporary``): a timeout or
a refused connection may clear; a bad config key, a malformed message or an unknown
node will not. Callers branch on the type, never on message text.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence


class UnicornError(Exception):
    """Base of every error unicorn raises on purpose."""

    temporary: bool = False


class ConfigError(UnicornError):
    """A configuration file or override is invalid. Nothing was applied."""


class ProtocolError(UnicornError):
    """A wire message could not be decoded or validated.

    ``kind`` is a short stable label (``malformed``, ``unknown_version``,
    ``unknown_type``, ``invalid``, ``too_large``) that readers use as a counter key.
    """

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class InvalidArgument(UnicornError):
    """A caller passed a value that cannot be valid (bad node name, impossible spec)."""


class UnknownNode(InvalidArgument):
    """A node name that the cluster does not have."""

    def __init__(self, node: str, known: Sequence[str] = ()) -> None:
        hint = f"; known nodes: {', '.join(known)}" if known else ""
        super().__init__(f"unknown node {node!r}{hint}")
        self.node = node


class UnknownJob(InvalidArgument):
    """A job id that the cluster does not know (never existed or already purged)."""

    def __init__(self, job_id: int) -> None:
        super().__init__(f"unknown job {job_id}")
        self.job_id = job_id


class ExternalCallError(UnicornError):
    """An external call (Slurm command, Redis, ssh) failed.

    Carries everything needed to diagnose it without re-running: the command as run,
    its exit code (``None`` when it never exited on its own), and its output.
    """

    def __init__(
        self,
        command: Sequence[str],
        exit_code: int | None,
        stdout: str = "",
        stderr: str = "",
        message: str = "",
    ) -> None:
        self.command = tuple(command)
        self.exit_code = exit_code
        self.stdout = stdout
        self.stderr = stderr
        text = message or f"exited with {exit_code}"
        tail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        super().__init__(f"{shlex.join(self.command)}: {text}" + (f": {tail}" if tail else ""))


class CommandFailed(ExternalCallError):
    """The command ran and exited non-zero."""


class CommandTimeout(ExternalCallError):
    """The command did not finish within its timeout and was killed. May clear on retry."""

    temporary = True

    def __init__(self, command: Sequence[str], timeout_s: float, stdout: str = "", stderr: str = "") -> None:
        super().__init__(command, None, stdout, stderr, message=f"timed out after {timeout_s:g} s")
        self.timeout_s = timeout_s


class CommandNotFound(ExternalCallError):
    """The executable does not exist on PATH (e.g. Slurm client tools not installed)."""


class SshError(ExternalCallError):
    """An SSH call failed: the connection, authentication or the remote command."""


class SshUnreachable(SshError):
    """No SSH session could be opened to the host (refused, timed out, host key rejected).

    ``network``: no route to a live sshd (refused, timed out, connection lost). False
    when the host answered but the session was refused (authentication, host key): the
    host is up, only the probe's credentials are wrong."""

    def __init__(self, command: Sequence[str], detail: str, *, network: bool = True) -> None:
        super().__init__(command, None, stderr=detail, message="unreachable")
        self.detail = detail
        self.network = network


class RedisCallError(ExternalCallError):
    """A Redis call failed (connection refused, timeout, auth, server error)."""

    temporary = True
