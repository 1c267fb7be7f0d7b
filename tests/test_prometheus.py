"""A real Prometheus (Debian's package) scrapes live mounts with the alert rules of
deploy/prometheus/kvfs-rules.yml loaded, and every query of the Grafana dashboard
deploy/grafana/kvfs.json returns data: each alert's condition is brought about for real on
the mounts (damaged data, slow loads, churn, a full pinned pool, a stalled host, Redis stalled,
stopped and come back empty) and Prometheus's rule engine is seen to raise every alert.

Skipped where Prometheus is not installed (scripts/setup.sh installs it).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import KVFS_CLI, REPO, KvfsMount, blob_files, drop_caches, stats, wait_for
from local_redis import LocalRedis
from prometheus_server import INSTALL, LocalPrometheus, installed
from test_operations import free_port

MiB = 1 << 20
RULES = REPO / "deploy" / "prometheus" / "kvfs-rules.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "kvfs.json"
SLOW_MODEL = "meta-llama-SEP-Llama-3.1-70B@1@0@-{:x}@bfloat16.data"  # a break-even by default

pytestmark = pytest.mark.skipif(not installed(), reason=f"no prometheus: {INSTALL}")


def alerts_in_rules() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}


def dashboard_queries() -> list[str]:
    """Every query of the Grafana dashboard, with Grafana's variables as Prometheus takes
    them: all mounts, a rate window of a minute."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"].replace("$instance", ".+").replace("$__rate_interval", "1m")
            for panel in panels for target in panel["targets"]]


def test_promtool_checks_the_rules() -> None:
    checked = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alerts_in_rules())} rules found" in checked.stdout


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator:
    started: list[LocalPrometheus] = []

    def factory(targets: list[str]) -> LocalPrometheus:
        started.append(LocalPrometheus(tmp_path / "prometheus", targets, [RULES]).start())
        return started[-1]

    yield factory
    for server in started:
        server.stop()


def raised(prom: LocalPrometheus, alert: str, instance: str) -> bool:
    """Whether Prometheus's rules hold `alert` pending or firing for `instance` now."""
    return bool(prom.query(f'ALERTS{{alertname="{alert}",instance="{instance}"}}'))


def errno_of(path: Path) -> int:
    try:
        path.read_bytes()
    except OSError as error:
        return error.errno or 0
    return 0


def damage_and_read(local: KvfsMount) -> None:
    """A stored file whose data fails its checksum: its read is refused (EIO)."""
    (local.mountpoint / "victim").write_bytes(os.urandom(MiB))
    blob = max(blob_files(local), key=lambda path: path.stat().st_size)
    local.remount()
    with open(blob, "r+b") as damaged:
        damaged.seek(MiB // 2)
        damaged.write(b"\xff" if damaged.read(1) != b"\xff" else b"\0")
    drop_caches()
    assert errno_of(local.mountpoint / "victim") == errno.EIO


def slow_loads(local: KvfsMount) -> None:
    """Two loads of a Llama-3.1-70B chunk, each held open a while: far below its break-even."""
    (local.mountpoint / SLOW_MODEL.format(1)).write_bytes(b"s" * 4096)
    for _ in range(2):
        with open(local.mountpoint / SLOW_MODEL.format(1), "rb") as load:
            load.read()
            time.sleep(1.5)


def test_prometheus_scrapes_live_mounts_and_raises_every_alert(
        make_mount, redis_server: LocalRedis, prometheus, tmp_path: Path) -> None:
    ports = [free_port() for _ in range(3)]
    local = make_mount("--capacity", "8M", "--metrics-port", str(ports[0]))
    hosts = [make_mount("--meta", redis_server.url, "--session-ttl", "1", "--capacity", "64M",
                        "--metrics-port", str(port), data=tmp_path / "pool")
             for port in ports[1:]]
    targets = [f"127.0.0.1:{port}" for port in ports]
    prom = prometheus(targets)
    assert wait_for(lambda: len(prom.query('up{job="kvfs"} == 1')) == 3)
    assert wait_for(lambda: len(prom.query("kvfs_hosts == 2")) == 2)
    assert len(prom.query("kvfs_hosts == 1")) == 1
    rules = prom.api("rules")["groups"]
    assert {rule["name"] for group in rules for rule in group["rules"]} == alerts_in_rules()
    seen: set[str] = set()

    def expect(alert: str, instance: str, timeout: float = 30) -> None:
        assert wait_for(lambda: raised(prom, alert, instance), timeout), alert
        seen.add(alert)

    # One host: damaged data, slow loads, churn, then a pool full of pinned files.
    damage_and_read(local)
    expect("KvfsVerificationFailures", targets[0])
    slow_loads(local)
    expect("KvfsLoadsSlowerThanBreakEven", targets[0])
    for index in range(16):  # twice the capacity, never loaded
        (local.mountpoint / f"unused{index}").write_bytes(b"n" * MiB)
    expect("KvfsEvictionChurn", targets[0])
    pinned = local.mountpoint / "pinned"
    pinned.mkdir()
    subprocess.run([KVFS_CLI, "pin", str(pinned)], check=True, timeout=60)
    for index in range(8):  # 95.7 % of the capacity, with the blocks they take
        (pinned / f"p{index}").write_bytes(b"p" * 1_000_000)
    expect("KvfsPoolAboveHighWatermark", targets[0])

    # A shared pool: a host stalled past its session TTL is reaped and loses its session.
    os.kill(hosts[1].pid, signal.SIGSTOP)
    try:
        expect("KvfsDown", targets[2])
        expect("KvfsHostDeclaredDead", targets[1])
    finally:
        os.kill(hosts[1].pid, signal.SIGCONT)
    expect("KvfsSessionLost", targets[2])

    # Redis stalled: a request waits out its deadline and fails.
    assert redis_server.process is not None
    os.kill(redis_server.process.pid, signal.SIGSTOP)
    try:
        failed: list[int] = []
        stat = threading.Thread(target=lambda: failed.append(
            errno_of(hosts[0].mountpoint / "never-made")))
        stat.start()
        stat.join(30)
        assert failed == [errno.EIO]
    finally:
        os.kill(redis_server.process.pid, signal.SIGCONT)
    expect("KvfsMetadataTimeouts", targets[1])

    # Redis stopped: scrapes say the metadata is out of reach. It comes back empty.
    redis_server.stop()
    try:
        expect("KvfsRedisUnreachable", targets[1])
    finally:
        shutil.rmtree(redis_server.directory)
        redis_server.start()
    assert wait_for(lambda: stats(hosts[0].mountpoint)["pool_lost"], 30)
    expect("KvfsPoolLost", targets[1])

    assert seen == alerts_in_rules()
    # Every query of the dashboard drew data over the run (Prometheus started with it)
    for query in dashboard_queries():
        assert prom.query_range(query, 600), query
    for group in prom.api("rules")["groups"]:
        for rule in group["rules"]:
            assert rule["health"] == "ok", rule
