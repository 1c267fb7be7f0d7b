"""A throwaway Prometheus (Debian's `prometheus` package) that scrapes given targets every
second and evaluates given rule files; stopped by its pid."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from local_redis import free_port

INSTALL = "apt-get install prometheus (scripts/setup.sh installs it)"


def installed() -> bool:
    return shutil.which("prometheus") is not None and shutil.which("promtool") is not None


class LocalPrometheus:
    def __init__(self, directory: Path, targets: list[str], rule_files: list[Path]) -> None:
        self.directory = directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets = targets
        self.rule_files = rule_files
        self.process: subprocess.Popen | None = None

    def start(self) -> LocalPrometheus:
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "prometheus.yml"
        # (JSON is YAML: no YAML writer needed)
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                       "scrape_timeout": "1s"},
            "rule_files": [str(path) for path in self.rule_files],
            "scrape_configs": [{"job_name": "kvfs",
                                "static_configs": [{"targets": self.targets}]}],
        }))
        self.process = subprocess.Popen(
            ["prometheus", f"--config.file={config}",
             f"--storage.tsdb.path={self.directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=open(self.directory / "prometheus.log", "w"))
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=1).read()
                return self
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"prometheus did not start (see "
                                       f"{self.directory / 'prometheus.log'})") from None
                time.sleep(0.1)

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as answer:
            body = json.loads(answer.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """The series an instant query returns now."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def query_range(self, expr: str, seconds: float, step: float = 1.0) -> list[dict]:
        end = time.time()
        return self.api("query_range", query=expr, start=str(end - seconds), end=str(end),
                        step=str(step))["result"]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
