"""The one choke point for SSH: run a command on a node with timeouts and typed errors.

unicornd uses it to probe a node whose agent fell silent (out-of-band confirmation).
Every call opens its own connection: probes are rare (one per silent agent) and a
cached connection to a node that just died would only add a failure mode.

Errors: :class:`~unicorn_core.errors.SshUnreachable` when no session opens (connection
refused or timed out, host key unknown or changed, authentication refused): for a probe
that means "the node is dead or unreachable". :class:`~unicorn_core.errors.CommandTimeout`
when the remote command outlives its timeout. A non-zero exit is returned, not raised:
for a probe, the output is the answer.
"""

from __future__ import annotations

import asyncio
import shlex
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from unicorn_core.errors import CommandTimeout, InvalidArgument, SshUnreachable
from unicorn_core.proc import CommandOutput


@dataclass(frozen=True)
class Endpoint:
    """Where to reach a node: ``host:port`` as ``user``, checked against ``known_hosts``."""

    host: str
    port: int = 22
    user: str = "root"
    key_file: str = ""
    known_hosts: str = ""

    def __post_init__(self) -> None:
        if not self.host or any(c.isspace() for c in self.host):
            raise InvalidArgument(f"ssh host must be a non-empty name without spaces, got {self.host!r}")
        if not 0 < self.port < 65536:
            raise InvalidArgument(f"ssh port must be 1..65535, got {self.port}")

    def describe(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"


async def run(
    endpoint: Endpoint, argv: Sequence[str], *, connect_timeout_s: float, command_timeout_s: float
) -> CommandOutput:
    """Run ``argv`` on ``endpoint`` (quoted word by word for the remote shell) and wait.

    ``command`` in the result and in errors is ``("ssh", user@host:port, *argv)``.
    """
    if not argv:
        raise InvalidArgument("ssh run needs a command")
    shown = ("ssh", endpoint.describe(), *argv)
    known = endpoint.known_hosts or str(Path.home() / ".ssh" / "known_hosts")
    keys = [endpoint.key_file] if endpoint.key_file else ()
    t0 = time.monotonic()
    try:
        conn = await asyncio.wait_for(
            asyncssh.connect(
                endpoint.host,
                endpoint.port,
                username=endpoint.user,
                client_keys=keys or None,
                known_hosts=known,
                agent_path=None,
                connect_timeout=connect_timeout_s,
                login_timeout=connect_timeout_s,
                keepalive_interval=0,
            ),
            timeout=connect_timeout_s + 1.0,
        )
    except (OSError, asyncssh.Error, TimeoutError) as e:
        # No route, no answer, dropped: nothing on the node answers. A refused connection
        # (the host's kernel answered: sshd restarting, a wrong port, a firewall REJECT), a
        # name that does not resolve or a refused login say nothing against the node.
        network = isinstance(e, OSError | TimeoutError | asyncssh.ConnectionLost) and not isinstance(
            e, socket.gaierror | ConnectionRefusedError
        )
        raise SshUnreachable(shown, f"{type(e).__name__}: {e}".strip(), network=network) from e
    try:
        async with conn:
            try:
                done = await asyncio.wait_for(
                    conn.run(shlex.join(argv), check=False), timeout=command_timeout_s
                )
            except TimeoutError:
                raise CommandTimeout(shown, command_timeout_s) from None
    except (OSError, asyncssh.Error) as e:  # the connection dropped mid-command
        raise SshUnreachable(shown, f"{type(e).__name__}: {e}".strip()) from e
    return CommandOutput(
        command=shown,
        exit_code=done.exit_status if done.exit_status is not None else -1,
        stdout=_text(done.stdout),
        stderr=_text(done.stderr),
        duration_s=time.monotonic() - t0,
    )


def _text(data: object) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data if isinstance(data, str) else ""
