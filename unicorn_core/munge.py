"""Who sent a request: MUNGE credentials, as Slurm itself authenticates users.

Anyone who may write unicornd's control stream could otherwise register a task for
*another* user's running job, and unicornd would start that task's command inside the
job, as its owner. So a registration carries a MUNGE credential whose payload is the
SHA-256 of the request (:func:`sign`); unicornd decodes it with ``unmunge``
(:func:`verify`), which yields the uid munged vouches for, and accepts the request only
from the job's owner, root, or the SlurmUser. munged rejects a replayed or expired
credential (its default TTL is 5 minutes). Both run ``munge``/``unmunge`` through
:func:`unicorn_core.proc.run` with a timeout; failures are typed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from unicorn_core import proc
from unicorn_core.errors import InvalidArgument, UnicornError

TIMEOUT_S: Final = 10.0
_UID: Final = re.compile(r"^UID:\s*.*\((\d+)\)\s*$", re.MULTILINE)
_STATUS: Final = re.compile(r"^STATUS:\s*(.*?)\s*$", re.MULTILINE)


class NotAuthenticated(InvalidArgument):
    """The credential is missing, invalid, replayed, expired, or for another request."""


@dataclass(frozen=True)
class Verified:
    uid: int
    payload: str


def digest(doc: Mapping[str, object]) -> str:
    """The SHA-256 of a request document (canonical JSON), the payload a credential signs."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _socket(socket: str) -> list[str]:
    return [f"--socket={socket}"] if socket else []


async def sign(payload: str, *, socket: str = "", timeout_s: float = TIMEOUT_S) -> str:
    """A MUNGE credential of the calling user for ``payload`` (raises UnicornError when munged
    cannot be reached: the request is not sent)."""
    out = await proc.run(["munge", *_socket(socket)], timeout_s=timeout_s, input_text=payload)
    return out.stdout.strip()


async def verify(credential: str, *, socket: str = "", timeout_s: float = TIMEOUT_S) -> Verified:
    """The uid and payload ``credential`` carries; NotAuthenticated when munged refuses it."""
    if not credential or not credential.startswith("MUNGE:") or "\n" in credential.strip():
        raise NotAuthenticated("the request carries no MUNGE credential")
    out = await proc.run(
        ["unmunge", *_socket(socket)],
        timeout_s=timeout_s,
        input_text=credential.strip() + "\n",
        check=False,
    )
    # Output: "KEY: value" metadata lines, a blank line, then the payload.
    meta, _, payload = out.stdout.partition("\n\n")
    if out.exit_code != 0:
        status = _STATUS.search(meta)
        why = status.group(1) if status else (out.stderr.strip() or f"unmunge exit {out.exit_code}")
        raise NotAuthenticated(f"munge credential refused: {why.removeprefix('unmunge: Error: ')}")
    found = _UID.search(meta)
    if found is None:
        raise UnicornError(f"unmunge printed no UID: {meta[-300:]!r}")
    return Verified(uid=int(found.group(1)), payload=payload)
