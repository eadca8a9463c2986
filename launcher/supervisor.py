"""Start and supervise one node's training processes: torchrun (or any command) and its ranks.

The training command runs in its own session (through :mod:`launcher.deathsig`, so that
it gets SIGTERM if the agent dies without stopping it), its stdout and stderr merged into one pipe
that the agent reads (:class:`OutputPump`). torchrun starts each worker in a session of
its own, so the supervisor discovers the ranks as descendants of the command (through
``/proc/<pid>/task/<tid>/children``) and reads ``RANK``, ``LOCAL_RANK`` and
``TORCHELASTIC_ERROR_FILE`` from their environment. A command that is not torchrun is
its own rank (``RANK`` from the environment given to it, else unknown).

Exits are seen the moment they happen: every rank gets a pidfd (``os.pidfd_open``) on
the event loop; when it becomes readable the rank is a zombie, and its wait status is
read from field 52 of ``/proc/<pid>/stat`` before torchrun reaps it (torchrun polls every
0.1 s). When torchrun wins that race the status is reported as unknown, and the
worker's torchelastic error file (read at exit) still says what happened.

Stopping kills by process group: SIGTERM to the command's group and to every rank's
group, ``grace_s``, then SIGKILL to all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from launcher import deathsig
from unicorn_core.errors import CommandNotFound
from unicorn_core.logs import get_logger

log = get_logger(__name__)

_ERROR_FILE_MAX: Final = 32 * 1024
_DISCOVERY_FAST_S: Final = 0.05
_DISCOVERY_SLOW_S: Final = 0.5


@dataclass(frozen=True, slots=True)
class RankInfo:
    pid: int
    rank: int | None
    local_rank: int | None
    error_file: str | None


@dataclass(frozen=True, slots=True)
class ExitInfo:
    """How a supervised process ended (``exit_code`` xor ``signal``, both None: unknown)."""

    pid: int
    rank: int | None
    local_rank: int | None
    exit_code: int | None
    signal: int | None
    error_file_text: str | None
    is_main: bool

    @property
    def abnormal(self) -> bool:
        return self.signal is not None or self.exit_code not in (0, None)


def decode_wait_status(status: int) -> tuple[int | None, int | None]:
    """(exit_code, signal) from a waitpid-format status word."""
    if status & 0x7F:
        return None, status & 0x7F
    return (status >> 8) & 0xFF, None


def read_zombie_status(pid: int) -> tuple[int | None, int | None] | None:
    """The wait status of ``pid`` while it is a zombie (None when gone or still running)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    # fields[0] is field 3 (state); the exit code is field 52 (Linux >= 3.5).
    if not fields or fields[0] not in ("Z", "X") or len(fields) < 50:
        return None
    return decode_wait_status(int(fields[49]))


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out.extend(int(c) for c in (task / "children").read_text().split())
    return out


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (breadth first)."""
    found: list[int] = []
    frontier = [pid]
    while frontier:
        nxt: list[int] = []
        for p in frontier:
            kids = _children(p)
            found.extend(kids)
            nxt.extend(kids)
        frontier = nxt
    return found


_RANK_VARIABLES: Final = ("RANK", "LOCAL_RANK", "TORCHELASTIC_ERROR_FILE")


def rank_processes(pid: int) -> list[tuple[int, dict[str, str]]]:
    """The training ranks under ``pid``: the top-most descendants with ``RANK`` or
    ``LOCAL_RANK`` in their environment, with those variables (breadth first).

    A rank's own children inherit its variables but are no ranks: Megatron-LM's rank 0
    runs ``make`` at start-up, data loaders fork workers. Counting them made their ends
    (reaped by the rank, so of unknown status) look like failed ranks.
    """
    found: list[tuple[int, dict[str, str]]] = []
    frontier = [pid]
    while frontier:
        nxt: list[int] = []
        for p in frontier:
            for kid in _children(p):
                env = read_environ(kid, _RANK_VARIABLES)
                if "RANK" in env or "LOCAL_RANK" in env:
                    found.append((kid, env))
                else:
                    nxt.append(kid)
        frontier = nxt
    return found


def read_environ(pid: int, names: Sequence[str]) -> dict[str, str]:
    """Selected variables of ``pid``'s initial environment ({} when unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    wanted = {n.encode() for n in names}
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key in wanted:
            out[key.decode()] = value.decode(errors="replace")
    return out


def _check_runnable(command: str, path: str, cwd: str | None) -> None:
    """:class:`CommandNotFound` unless ``command`` can be executed as ``execvp`` would find
    it. The command starts through :mod:`launcher.deathsig`, so its own ``exec`` failing
    would otherwise read as a training that exited 127."""
    if "/" not in command:
        # relative PATH entries as the command's exec sees them: from its own cwd
        base = Path(cwd or ".")
        path = os.pathsep.join(str(base / (entry or ".")) for entry in path.split(os.pathsep))
        if shutil.which(command, path=path) is None:
            raise CommandNotFound([command], None, message=f"executable not found: {command}")
        return
    where = Path(cwd or ".") / command
    if not where.exists():
        raise CommandNotFound([command], None, message=f"executable not found: {command}")
    if where.is_dir() or not os.access(where, os.X_OK):
        raise CommandNotFound([command], None, message=f"not executable: {command}")


def _opt_int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from /proc (R, S, T, Z, ...), None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2 :]
    return rest[:1] or None


class OutputPump:
    """Reads the training output pipe in bounded chunks: a log file plus a line callback.

    Lines longer than ``max_line`` are cut (the rest is still logged). The pump yields to
    the event loop after every chunk, so a process flooding its output slows only
    itself (the pipe fills and its writes block) and never starves the agent.
    """

    def __init__(
        self,
        stream: asyncio.StreamReader,
        log_path: Path,
        on_line: Callable[[str], None],
        *,
        tail_lines: int = 50,
        max_line: int = 4096,
        chunk: int = 64 * 1024,
    ) -> None:
        self._stream = stream
        self._log_path = log_path
        self._on_line = on_line
        self._max_line = max_line
        self._chunk = chunk
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self.bytes_read = 0
        self.lines = 0

    async def run(self) -> None:
        partial = b""
        with self._log_path.open("ab", buffering=0) as sink:
            while True:
                data = await self._stream.read(self._chunk)
                if not data:
                    break
                self.bytes_read += len(data)
                sink.write(data)
                parts = (partial + data).split(b"\n")
                partial = parts.pop()
                if len(partial) > self._max_line:
                    parts.append(partial[: self._max_line])
                    partial = b""
                for raw in parts:
                    self._line(raw)
                await asyncio.sleep(0)
        if partial:
            self._line(partial)

    def _line(self, raw: bytes) -> None:
        line = raw[: self._max_line].decode(errors="replace").rstrip("\r")
        self.lines += 1
        self.tail.append(line)
        self._on_line(line)


class Supervisor:
    """One run of the training command on this node (start once, then stop or let it end).

    ``on_exit`` is called once per rank exit and once for the command itself
    (``is_main=True``), from the event loop, as soon as each is observed.
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        *,
        on_line: Callable[[str], None],
        on_exit: Callable[[ExitInfo], None],
        grace_s: float = 5.0,
        cwd: str | None = None,
    ) -> None:
        if not argv:
            raise ValueError("empty training command")
        self.argv = list(argv)
        self.env = dict(env)
        self.cwd = cwd
        self.log_path = log_path
        self._on_line = on_line
        self._on_exit = on_exit
        self.grace_s = grace_s
        self.proc: asyncio.subprocess.Process | None = None
        self.ranks: dict[int, RankInfo] = {}
        self.exited: dict[int, ExitInfo] = {}
        self.pump: OutputPump | None = None
        self._pidfds: dict[int, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.main_exit: asyncio.Future[ExitInfo] | None = None
        self.stopping = False

    @property
    def pids(self) -> list[int]:
        """Live pids: the command and its known ranks."""
        out = [] if self.proc is None or self.proc.returncode is not None else [self.proc.pid]
        out.extend(pid for pid in self.ranks if pid not in self.exited)
        return out

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        _check_runnable(self.argv[0], self.env.get("PATH", os.defpath), self.cwd)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *deathsig.argv_for(os.getpid(), self.argv),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
                limit=1 << 20,
            )
        except FileNotFoundError as e:
            raise CommandNotFound(self.argv, None, message=f"executable not found: {e.filename}") from None
        except PermissionError as e:
            raise CommandNotFound(self.argv, None, message=f"not executable: {e.filename}") from None
        self.main_exit = loop.create_future()
        assert self.proc.stdout is not None
        self.pump = OutputPump(self.proc.stdout, self.log_path, self._on_line)
        self._tasks = [
            asyncio.create_task(self.pump.run(), name="output-pump"),
            asyncio.create_task(self._wait_main(), name="wait-main"),
            asyncio.create_task(self._discover(), name="discover-ranks"),
        ]
        log.info("training_started", pid=self.proc.pid, argv=self.argv[:8])

    async def _wait_main(self) -> None:
        assert self.proc is not None and self.main_exit is not None
        code = await self.proc.wait()
        # Ranks may still be exiting: give their pidfds a moment to report first.
        await asyncio.sleep(0)
        exit_code, sig = (code, None) if code >= 0 else (None, -code)
        env = self.env
        info = ExitInfo(
            pid=self.proc.pid,
            rank=None if self.ranks else _opt_int(env.get("RANK")),
            local_rank=None if self.ranks else _opt_int(env.get("LOCAL_RANK")),
            exit_code=exit_code,
            signal=sig,
            error_file_text=None,
            is_main=True,
        )
        self._on_exit(info)
        if not self.main_exit.done():
            self.main_exit.set_result(info)

    async def _discover(self) -> None:
        assert self.proc is not None
        main = self.proc.pid
        while self.proc.returncode is None:
            for pid, env in rank_processes(main):
                if pid in self.ranks:
                    continue
                info = RankInfo(
                    pid=pid,
                    rank=_opt_int(env.get("RANK")),
                    local_rank=_opt_int(env.get("LOCAL_RANK")),
                    error_file=env.get("TORCHELASTIC_ERROR_FILE") or None,
                )
                self._watch(info)
            await asyncio.sleep(_DISCOVERY_FAST_S if not self.ranks else _DISCOVERY_SLOW_S)

    def _watch(self, info: RankInfo) -> None:
        try:
            fd = os.pidfd_open(info.pid)
        except OSError:
            return  # already gone: not a rank we can report on
        self.ranks[info.pid] = info
        self._pidfds[info.pid] = fd
        asyncio.get_running_loop().add_reader(fd, self._rank_exited, info)

    def _rank_exited(self, info: RankInfo) -> None:
        status = read_zombie_status(info.pid)
        fd = self._pidfds.pop(info.pid, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
        exit_code, sig = status if status is not None else (None, None)
        text = None
        if info.error_file:
            with contextlib.suppress(OSError):
                text = Path(info.error_file).read_text(errors="replace")[:_ERROR_FILE_MAX] or None
        ex = ExitInfo(info.pid, info.rank, info.local_rank, exit_code, sig, text, is_main=False)
        self.exited[info.pid] = ex
        self._on_exit(ex)

    def rank_of(self, pid: int) -> RankInfo | None:
        return self.ranks.get(pid)

    def signal_ranks(self, sig: int) -> int:
        """Send ``sig`` to every live rank (or the command when it has no ranks); count sent."""
        targets = [p for p in self.ranks if p not in self.exited]
        if not targets and self.proc is not None and self.proc.returncode is None:
            targets = [self.proc.pid]
        sent = 0
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
                sent += 1
        return sent

    def _signal_groups(self, sig: int) -> None:
        groups = set()
        if self.proc is not None:
            groups.add(self.proc.pid)
        groups.update(p for p in self.ranks if p not in self.exited)
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)

    async def stop(self, grace_s: float | None = None) -> ExitInfo | None:
        """SIGTERM every group, wait ``grace_s``, SIGKILL; returns the command's exit."""
        if self.proc is None or self.main_exit is None:
            return None
        self.stopping = True
        grace = self.grace_s if grace_s is None else grace_s
        if self.proc.returncode is None or any(p not in self.exited for p in self.ranks):
            self._signal_groups(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.main_exit), grace)
            self._signal_groups(signal.SIGKILL)
        info = await self.main_exit
        await self.close()
        return info

    async def close(self) -> None:
        """Release pidfds and wait for the output pump (after the command ended)."""
        for task in self._tasks:
            if task.get_name() == "discover-ranks":
                task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), 5.0)
        loop = asyncio.get_running_loop()
        for fd in self._pidfds.values():
            loop.remove_reader(fd)
            os.close(fd)
        self._pidfds.clear()
