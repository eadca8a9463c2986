"""A real Prometheus server for the system tests (Debian's ``prometheus`` package).

:func:`prometheus_server` starts one on a free port of 127.0.0.1 that scrapes the given
targets every second, with its configuration and time-series database under a folder the
caller owns (a test's ``tmp_path``), and stops it by pid when the block ends. Queries go
through Prometheus's HTTP API (``/api/v1/query``), as Grafana's do.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import free_port

SCRAPE_S = 1


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Prometheus:
    url: str
    log: Path

    def query(self, expr: str) -> list[Sample]:
        """An instant query's vector; raises on an HTTP error or a non-success status."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.loads(r.read())
        if doc.get("status") != "success" or doc["data"]["resultType"] != "vector":
            raise AssertionError(f"query {expr!r}: {doc}")
        return [Sample(dict(x["metric"]), float(x["value"][1])) for x in doc["data"]["result"]]

    def targets_up(self) -> list[str]:
        """The scrape URLs of the targets whose last scrape succeeded."""
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as r:
            doc = json.loads(r.read())
        return [t["scrapeUrl"] for t in doc["data"]["activeTargets"] if t["health"] == "up"]


@contextlib.contextmanager
def prometheus_server(folder: Path, targets: list[str], timeout_s: float = 60) -> Iterator[Prometheus]:
    """Prometheus scraping ``targets`` ("HOST:PORT", path ``/metrics``) every second, ready
    (``/-/ready``) when the block starts; its files stay under ``folder``."""
    exe = shutil.which("prometheus")
    if exe is None:
        raise RuntimeError("prometheus is not installed (scripts/bootstrap installs Debian's package)")
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "prometheus.yml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s"},
                "scrape_configs": [{"job_name": "unicornd", "static_configs": [{"targets": targets}]}],
            }
        )
    )
    port = free_port()
    log = folder / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                exe,
                f"--config.file={config}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=folder,
        )
    prom = Prometheus(f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {proc.returncode}: {log.read_text()[-2000:]}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as r,
            ):
                if r.status == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus not ready after {timeout_s}s: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield prom
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
