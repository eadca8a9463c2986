"""Sections of the shared infrastructure, read by every unicorn process.

``[redis]`` (the coordination store: URL, timeouts, key prefix, password files and the
per-job ACL users; with ``read_secret`` for its password files), ``[slurm]`` (how to
reach the Slurm controller: backend, command timeout, client paths, MUNGE socket,
operators' group; and which nodes unicorn manages: partitions, node feature,
reservation) and ``[log]`` (level and format). unicornd, unicornctl and the sbatch
wrapper read all three; the node agent reads ``[redis]`` and ``[log]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from unicorn_core.config.schema import Section, _meta, _show
from unicorn_core.errors import ConfigError

SlurmBackend = Literal["auto", "cli", "pyslurm"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "json", "console"]

_REDIS_SCHEMES = ("redis", "rediss", "unix")
_SLURM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True, kw_only=True)
class RedisConfig(Section):
    """The Redis server that holds all coordination state (heartbeats, job records)."""

    url: str = field(
        default="redis://127.0.0.1:6379/0",
        metadata=_meta(
            "Redis server URL: redis://host:port/db, rediss:// for TLS, or unix:///path.sock. "
            "May carry credentials (redis://user:password@host), but password_file keeps the "
            "secret out of this file. Default: a local Redis on the standard port, database 0, "
            "as the dev cluster runs it."
        ),
    )
    password_file: str = field(
        default="",
        metadata=_meta(
            "Path of a file whose content (one trailing newline stripped) is the Redis "
            "password; empty = no password beyond any in url. A file rather than a value so "
            "the secret never sits in unicorn.toml or in the environment. Default: empty "
            "(the dev Redis has no auth)."
        ),
    )
    key_prefix: str = field(
        default="unicorn",
        metadata=_meta(
            "Prefix of every Redis key unicorn writes (<prefix>:...), so several deployments "
            "or test runs can share one Redis server. Default: unicorn."
        ),
    )
    socket_timeout_s: float = field(
        default=5.0,
        metadata=_meta(
            "Seconds one Redis command may take before it fails (as a temporary error). "
            "Default 5 s: far above a healthy round trip (under 1 ms on a LAN), short enough "
            "that a stuck server is noticed within a few heartbeats.",
            gt=0,
        ),
    )
    connect_timeout_s: float = field(
        default=2.0,
        metadata=_meta(
            "Seconds to wait for a connection to Redis to open. Default 2 s: a connection "
            "opens in milliseconds or the server is unreachable; fail fast and retry.",
            gt=0,
        ),
    )

    agent_acl: bool = field(
        default=True,
        metadata=_meta(
            "Give the agents of each Slurm job their own Redis user, confined to that job's "
            "heartbeats, event streams and commands (unicornd creates it with a random password "
            "when it launches the job's agents and deletes it when the task is gone); false = "
            "agents connect with unicornd's own credentials. Default: true. Needs Redis >= 7 and "
            "a unicornd user allowed ACL SETUSER/DELUSER/USERS."
        ),
    )
    operator_password_file: str = field(
        default="",
        metadata=_meta(
            "Password file of the Redis user <key_prefix>-operator, which may read the status "
            "and send drain/resume requests; unicornd (re)creates that user at start. unicornctl "
            "connects as the most privileged user whose password file the caller can read: "
            "password_file (unicornd's), then this, then user_password_file. Make it readable "
            "by operators only (e.g. mode 0640, group slurm.operators_group). Default: empty (no "
            "operator user)."
        ),
    )
    user_password_file: str = field(
        default="",
        metadata=_meta(
            "Password file of the Redis user <key_prefix>-user, which may read the status and "
            "register or stop tasks (the sbatch wrapper) but not drain; unicornd (re)creates it "
            "at start. Readable by every user of the cluster. Default: empty (no such user)."
        ),
    )
    sentinels: tuple[str, ...] = field(
        default=(),
        metadata=_meta(
            "Redis Sentinel endpoints as HOST:PORT entries (in the environment: comma-"
            "separated). Set = every unicorn process asks the sentinels for the current "
            "primary of master_name and follows a failover (redis-py's Sentinel client); the "
            "host and port of url are then unused, its user, password and database still "
            "apply. Default: empty (one Redis at url, no failover)."
        ),
    )
    master_name: str = field(
        default="unicorn",
        metadata=_meta(
            "The name the sentinels monitor the primary under (sentinel monitor NAME ...). Default: unicorn."
        ),
    )
    sentinel_password_file: str = field(
        default="",
        metadata=_meta(
            "Password file for the sentinels themselves (their requirepass); empty = they "
            "need none. Default: empty."
        ),
    )
    stream_retention_s: float = field(
        default=600.0,
        metadata=_meta(
            "Seconds of acknowledged history unicornd keeps in each agent event stream: every "
            "30 s it trims (XTRIM MINID) what every reader has acknowledged and is older than "
            "this, so Redis memory follows the event rate instead of the agents' cap of "
            "100,000 entries a stream (about 2 GB at 200 jobs). Never trims an entry a reader "
            "has not acknowledged. Default 600 s: recent history stays for operators and tools.",
            ge=0,
        ),
    )
    wait_replicas: int = field(
        default=0,
        metadata=_meta(
            "Replicas that must hold a write before unicornd treats it as safe: after taking "
            "the lease (so a failover cannot hand the same fencing token to two leaders) and "
            "after each commit (WAIT). 0 = no WAIT. Default 0 (a single Redis); set 1 with "
            "Sentinel (scripts/bench/commit.py measures the cost, see BENCHMARKS.md).",
            ge=0,
        ),
    )
    wait_timeout_ms: int = field(
        default=200,
        metadata=_meta(
            "Milliseconds a WAIT may block for the replicas. A lease not replicated within it "
            "is given up (taken again later); a commit not replicated within it is kept and "
            "logged (the primary holds it; only a failover within the replication lag loses "
            "it). Default 200: a replica on the same network acknowledges in about 1 ms.",
            ge=1,
        ),
    )

    def problems(self) -> list[str]:
        found = []
        parts = urlsplit(self.url)
        if parts.scheme not in _REDIS_SCHEMES:
            found.append(
                f"url = {_show(_redact_url(self.url))}: expected a URL starting with "
                + ", ".join(f"{scheme}://" for scheme in _REDIS_SCHEMES)
            )
        elif parts.password and self.password_file:
            found.append("url carries a password and password_file is set too; keep only one")
        if not self.key_prefix or self.key_prefix != self.key_prefix.strip():
            found.append(f"key_prefix = {_show(self.key_prefix)}: expected a non-empty name without spaces")
        found += [
            f"sentinels entry {_show(e)} is not HOST:PORT" for e in self.sentinels if _endpoint(e) is None
        ]
        if self.sentinels and parts.scheme == "unix":
            found.append("sentinels are set but url is a unix socket: Sentinel hands out TCP addresses")
        if not self.master_name.strip():
            found.append("master_name is empty")
        if self.wait_replicas and not self.sentinels:
            found.append("wait_replicas is set without sentinels: a lone Redis has no replica to wait for")
        return found

    def sentinel_endpoints(self) -> list[tuple[str, int]]:
        """``sentinels`` as (host, port) pairs (a loaded config has no bad entry)."""
        return [p for p in map(_endpoint, self.sentinels) if p is not None]

    def sentinel_password(self) -> str | None:
        """The sentinels' password (:attr:`sentinel_password_file`), None when unset."""
        if not self.sentinel_password_file:
            return None
        return read_secret("redis.sentinel_password_file", self.sentinel_password_file)

    def password(self) -> str | None:
        """The password read from ``password_file``; None when no file is configured.

        Reads the file on each call, so a rotated secret is picked up on reconnect.
        Raises ``ConfigError`` naming the file when it cannot be read or is empty.
        """
        return read_secret("redis.password_file", self.password_file) if self.password_file else None


def _endpoint(entry: str) -> tuple[str, int] | None:
    """``HOST:PORT`` as (host, port); None when it is not one."""
    host, colon, port = entry.strip().rpartition(":")
    if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
        return None
    return host.strip("[]"), int(port)


def read_secret(key: str, path_text: str) -> str:
    """The content of the secret file ``path_text`` (config key ``key``), one trailing newline
    stripped; ``ConfigError`` naming both when it cannot be read or is empty."""
    path = Path(path_text)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{key} {str(path)!r}: cannot read: {reason}") from exc
    secret = text.removesuffix("\n").removesuffix("\r")
    if not secret:
        raise ConfigError(f"{key} {str(path)!r}: file is empty")
    return secret


def _redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


@dataclass(frozen=True, kw_only=True)
class SlurmConfig(Section):
    """How unicorn talks to the Slurm controller."""

    backend: SlurmBackend = field(
        default="auto",
        metadata=_meta(
            "How to reach Slurm: cli runs squeue/scontrol/sbatch; pyslurm calls the pyslurm "
            "bindings (no process per call, but must match the installed Slurm version); auto "
            "uses pyslurm when it imports and the CLI otherwise. Default: auto."
        ),
    )
    command_timeout_s: float = field(
        default=30.0,
        metadata=_meta(
            "Seconds one Slurm command or pyslurm call may run before it is killed and "
            "reported as a timeout. Default 30 s: slurmctld answers slowly under load (its "
            "own MessageTimeout defaults to 10 s), but a call stuck longer has failed.",
            gt=0,
        ),
    )
    bin_dir: str = field(
        default="",
        metadata=_meta(
            "Folder holding the Slurm client commands (squeue, scontrol, sbatch, srun); "
            "empty = find them on PATH. Default: empty; set it when a service manager starts "
            "unicorn with a minimal PATH."
        ),
    )
    conf: str = field(
        default="",
        metadata=_meta(
            "Path of the slurm.conf that Slurm commands use (passed as SLURM_CONF); empty = "
            "Slurm's default (an inherited $SLURM_CONF, else the compiled-in path). Default: "
            "empty; the dev cluster points it at its own slurm.conf."
        ),
    )
    munge_socket: str = field(
        default="",
        metadata=_meta(
            "Path of munged's socket, for the MUNGE credential that signs each task "
            "registration (unicornd accepts a registration only from the job's owner, root or "
            "the SlurmUser); empty = munge's default socket. Default: empty; the dev cluster "
            "points it at its own munged."
        ),
    )
    operators_group: str = field(
        default="",
        metadata=_meta(
            "Unix group whose members may change the cluster through unicornctl (drain, "
            "resume), besides root and Slurm's SlurmUser; empty = only those two. Default: "
            "empty. unicornctl checks it before it sends a request; Redis ACLs are what stop "
            "a client that bypasses unicornctl."
        ),
    )
    partitions: tuple[str, ...] = field(
        default=(),
        metadata=_meta(
            "The Slurm partitions whose nodes unicorn manages (in the environment: "
            "comma-separated); empty = every partition. A node in none of them is never "
            "drained, resumed, planned or probed, and unicornctl drain/resume refuses it. "
            "Default: empty (unicorn owns the whole cluster); on a cluster shared with "
            "other teams, name the training partitions. An unknown partition stops unicornd "
            "at start."
        ),
    )
    node_feature: str = field(
        default="",
        metadata=_meta(
            "Manage only nodes with this active Slurm feature (sinfo %b), on top of "
            "partitions; empty = no feature needed. Default: empty; set it when training "
            "nodes share a partition with others and carry a feature (e.g. a GPU type)."
        ),
    )
    reservation: str = field(
        default="",
        metadata=_meta(
            "Manage only the nodes of this Slurm reservation, on top of partitions and "
            "node_feature; empty = no reservation. Default: empty; set it when the site "
            "reserves nodes for training. A reservation that does not exist stops unicornd "
            "at start."
        ),
    )

    @property
    def scoped(self) -> bool:
        """Some scope key is set: unicorn manages part of the cluster, not all of it."""
        return bool(self.partitions or self.node_feature or self.reservation)

    def problems(self) -> list[str]:
        found = []
        for key, names in (
            ("partitions", self.partitions),
            ("node_feature", (self.node_feature,) if self.node_feature else ()),
            ("reservation", (self.reservation,) if self.reservation else ()),
        ):
            for name in names:
                if not _SLURM_NAME.match(name):
                    found.append(f"{key}: {_show(name)} is not a Slurm name (letters, digits, '_', '.', '-')")
        if len(set(self.partitions)) != len(self.partitions):
            found.append(f"partitions: {list(self.partitions)} names a partition twice")
        return found


@dataclass(frozen=True, kw_only=True)
class LogConfig(Section):
    """Logging of every unicorn process (see ``unicorn_core.logs.configure_logging``)."""

    level: LogLevel = field(
        default="info",
        metadata=_meta("Lowest level written: debug, info, warning or error. Default: info."),
    )
    format: LogFormat = field(
        default="auto",
        metadata=_meta(
            "json writes one JSON object per line (for daemons and log collectors); console "
            "writes readable lines (for people at a terminal); auto picks json when stderr is "
            "not a terminal and console when it is. Default: auto."
        ),
    )
