"""Open a local HTML file in headless Chromium (Debian's ``chromium``, which
``scripts/dev-cluster install`` installs): a screenshot, the rendered DOM and the console.

Everything Chromium writes (its profile, caches, crash dumps, temporary files; it also
looks under ``$HOME`` and the XDG folders) goes to one temporary folder that
:func:`open_in_chromium` removes on exit, and its process group is killed when it is done
(and past its timeout): nothing is left behind in /tmp or ``$HOME``.

Chromium's ``--enable-logging=stderr`` log writes every console message (errors, warnings,
logs, uncaught exceptions, Content-Security-Policy violations, failed loads) as an
``INFO:CONSOLE`` line whatever its level, so :attr:`Rendered.console` holds them all: a page
without scripts that loads nothing has none.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

CONSOLE: Final = re.compile(r":CONSOLE[(:]\d*\)?\]\s*(.*)")
"""A console message in Chromium's stderr log (the message is group 1)."""


@dataclass(frozen=True)
class Rendered:
    """What Chromium made of a page: ``screenshot`` (a PNG of the viewport, inside the
    temporary folder: read it inside the ``with``), the serialised ``dom`` after loading,
    ``console`` messages (see the module docstring) and the whole ``stderr`` log."""

    screenshot: Path
    dom: str
    console: tuple[str, ...]
    stderr: str


def chromium() -> str | None:
    """The Chromium executable on PATH (None: not installed)."""
    return shutil.which("chromium")


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout_s: float) -> tuple[str, str]:
    """(stdout, stderr) of ``argv``, run in its own process group; past ``timeout_s`` the
    whole group is killed (before the leader is reaped, so the id is still ours) and
    TimeoutExpired is raised; after a normal exit, what is left of the group is killed."""
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        raise
    # Helpers Chromium left running in its group (its crash handler) go too: the group
    # outlives its reaped leader only while they do, so the id is still this run's.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return out, err


@contextlib.contextmanager
def open_in_chromium(
    page: Path, *, width: int = 1280, height: int = 2400, timeout_s: float = 60.0
) -> Iterator[Rendered]:
    """Load ``page`` (a local file) once in headless Chromium at ``width`` x ``height``:
    yields its :class:`Rendered`; the temporary folder goes on exit. Raises RuntimeError
    when Chromium is missing or makes no screenshot, TimeoutExpired past ``timeout_s``."""
    exe = chromium()
    if exe is None:
        raise RuntimeError("chromium is not installed (scripts/dev-cluster install installs it)")
    with tempfile.TemporaryDirectory(prefix="unicorn-chromium-") as tmp:
        root = Path(tmp)
        shot = root / "screenshot.png"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(root / "home"),
            "TMPDIR": str(root / "tmp"),
            "XDG_CONFIG_HOME": str(root / "home" / ".config"),
            "XDG_CACHE_HOME": str(root / "home" / ".cache"),
            "XDG_DATA_HOME": str(root / "home" / ".local" / "share"),
            "XDG_RUNTIME_DIR": str(root / "run"),
            "LANG": "C.UTF-8",
        }
        for key in ("HOME", "TMPDIR", "XDG_RUNTIME_DIR"):
            Path(env[key]).mkdir(mode=0o700)
        argv = [
            exe,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--hide-scrollbars",
            "--mute-audio",
            f"--user-data-dir={root / 'profile'}",
            f"--crash-dumps-dir={root / 'crash'}",
            f"--window-size={width},{height}",
            f"--screenshot={shot}",
            "--dump-dom",
            page.resolve().as_uri(),
        ]
        dom, stderr = _run(argv, env, root, timeout_s)
        if not shot.is_file():
            raise RuntimeError(f"chromium made no screenshot of {page}; its log:\n{stderr}")
        console = tuple(m.group(1) for line in stderr.splitlines() if (m := CONSOLE.search(line)))
        yield Rendered(shot, dom, console, stderr)
