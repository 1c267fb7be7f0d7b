"""deploy/kubernetes/ without a cluster: the manifests against the Kubernetes API's schemas
(kubernetes-validate, offline), the mount layout they describe, and that layout run for real
with Linux mount namespaces, the DaemonSet's own start and preStop commands included:

- the node: a directory bind-mounted on itself with shared propagation (hostPath /var/lib/kvfs
  on a node whose root is shared, as the kubelet needs for Bidirectional);
- the kvfs pod: `unshare --mount --propagation shared` (Bidirectional), mounting kvfs at mnt/
  under the directory;
- an engine pod: `unshare --mount --propagation slave` (HostToContainer), a process that
  opens and reads files there (tests/namespace_engine.py).

A kill -9 of the daemon and a new one started by the DaemonSet's command (which clears the
dead mount with `fusermount3 -u -z` before mounting) reach the engine without touching it.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from conftest import KVFS_CLI, MOUNT_OPTIONS, REPO, is_mounted, wait_dead, wait_for
from test_operations import free_port

MiB = 1 << 20
DEPLOY = REPO / "deploy" / "kubernetes"
NODE_DIR = "/var/lib/kvfs"  # the hostPath the manifests share
ENGINE = Path(__file__).resolve().parent / "namespace_engine.py"
# What an engine gets from a mount whose daemon died: the connection is gone
DEAD = {errno.ENOTCONN, errno.ECONNABORTED, errno.EIO}


def documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(DEPLOY.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                yield path, document


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [document for _, document in documents() if document["kind"] == kind]


def test_manifests_validate_against_the_kubernetes_schemas() -> None:
    version = kubernetes_validate.latest_version()
    kinds = set()
    for _, document in documents():
        kubernetes_validate.validate(document, version, strict=True)
        kinds.add(document["kind"])
    assert {"DaemonSet", "Deployment", "PersistentVolume", "PersistentVolumeClaim",
            "StatefulSet", "Service", "ConfigMap", "Namespace"} <= kinds
    # (the check refuses what the API server would)
    broken = copy.deepcopy(node_daemonset())
    broken["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0][
        "mountPropagation"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def node_daemonset() -> dict[str, Any]:
    """The DaemonSet of a node-local pool (LMDB): kvfs-node.yaml."""
    (daemonset,) = [ds for ds in by_kind("DaemonSet") if ds["metadata"]["name"] == "kvfs"]
    return daemonset


def kvfs_container(daemonset: dict[str, Any]) -> dict[str, Any]:
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    return container


def host_paths(pod: dict[str, Any]) -> dict[str, str]:
    """Volume name -> node directory, through hostPath volumes and the static PV's claim."""
    (pv,) = by_kind("PersistentVolume")
    found = {}
    for volume in pod.get("volumes", []):
        if "hostPath" in volume:
            found[volume["name"]] = volume["hostPath"]["path"]
        elif volume.get("persistentVolumeClaim", {}).get("claimName") == pv["spec"][
                "claimRef"]["name"]:
            found[volume["name"]] = pv["spec"]["hostPath"]["path"]
    return found


def test_daemonsets_mount_under_the_parent_engines_share() -> None:
    daemonsets = by_kind("DaemonSet")
    assert {"kvfs", "kvfs-cluster"} == {ds["metadata"]["name"] for ds in daemonsets}
    for daemonset in daemonsets:
        pod = daemonset["spec"]["template"]["spec"]
        container = kvfs_container(daemonset)
        start = container["args"][0]
        assert container["securityContext"]["privileged"] is True
        assert f"until kvfs mount {NODE_DIR}/mnt " in start and "--foreground" in start
        assert ("--meta" in start) == (daemonset["metadata"]["name"] == "kvfs-cluster")
        (shared,) = [mount for mount in container["volumeMounts"]
                     if mount.get("mountPropagation") == "Bidirectional"]
        assert shared["mountPath"] == NODE_DIR == host_paths(pod)[shared["name"]]
        assert container["readinessProbe"]["exec"]["command"] == [
            "cat", f"{NODE_DIR}/mnt/.kvfs/stats"]
        assert f"fusermount3 -u {NODE_DIR}/mnt" in " ".join(
            container["lifecycle"]["preStop"]["exec"]["command"])
    engines = by_kind("Deployment")
    assert len(engines) == 2
    for engine in engines:
        pod = engine["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        (mount,) = [mount for mount in container["volumeMounts"]
                    if mount.get("mountPropagation") == "HostToContainer"]
        assert host_paths(pod)[mount["name"]] == NODE_DIR
        configured = json.dumps(by_kind("ConfigMap")) + json.dumps(container["args"])
        assert f'{mount["mountPath"]}/mnt/' in configured, "the client's directory is in mnt/"


def test_the_node_pool_keeps_its_change_log_in_the_nodes_memory() -> None:
    """A container's own /run goes with it: the node-local pool's change log and lock table
    (the runtime directory) are the node's /run/kvfs, so that a restarted container replays
    what its killed daemon answered."""
    daemonset = node_daemonset()
    (runtime,) = [mount for mount in kvfs_container(daemonset)["volumeMounts"]
                  if mount["mountPath"] == "/run/kvfs"]
    assert host_paths(daemonset["spec"]["template"]["spec"])[runtime["name"]] == "/run/kvfs"


@pytest.fixture
def node_dir(tmp_path: Path) -> Iterator[Path]:
    """A node's /var/lib/kvfs: a directory bind-mounted on itself, shared propagation."""
    node = tmp_path / "node" / "var-lib-kvfs"
    node.mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(node), str(node)], check=True)
    subprocess.run(["mount", "--make-shared", str(node)], check=True)
    yield node
    if is_mounted(node / "mnt"):
        subprocess.run(["fusermount3", "-u", "-z", str(node / "mnt")], check=False)
    subprocess.run(["umount", "-l", str(node)], check=True)


class Engine:
    """tests/namespace_engine.py in a mount namespace of its own (slave propagation)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "slave", sys.executable, str(ENGINE)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, op: str, **request: Any) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"op": op, **request}) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture
def engine() -> Iterator[Engine]:
    started = Engine()
    yield started
    started.stop()


def pod_processes(pid: int) -> list[int]:
    """`pid` and its descendants: what a container's end kills (the daemon's helpers too)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *(descendant for child in children for descendant in pod_processes(int(child)))]


def daemon_command(node: Path, data: Path, extra: list[str]) -> str:
    """The kvfs DaemonSet's start command, with this machine's paths."""
    start = kvfs_container(node_daemonset())["args"][0]
    start = start.replace(" /data ", f" {data} ").replace(NODE_DIR, str(node))
    start = start.replace("kvfs mount", f"{KVFS_CLI} mount")
    options = " ".join([*extra, *MOUNT_OPTIONS])
    return start.replace("9477", str(free_port())).replace("; do", f" {options}; do", 1)


def start_pod(node: Path, data: Path, extra: list[str], engine: Engine) -> subprocess.Popen:
    """The kvfs pod's container: its start command in a mount namespace of its own, shared
    propagation; returns once the engine sees the mount ready."""
    pod = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "shared", "/bin/sh", "-c",
         daemon_command(node, data, extra)], env={**os.environ, "KVFS_CAPACITY": "64M"})
    # (readiness, as the engine sees it)
    assert wait_for(lambda: engine.ask("exists", path=f"{node}/mnt/.kvfs/stats")["exists"], 30)
    return pod


def test_dead_mount_cleared_and_restart_reaches_the_engine(node_dir: Path, tmp_path: Path,
                                                           engine: Engine) -> None:
    """Run for both data paths: with `--passthrough off` the daemon serves every read."""
    mnt, data = node_dir / "mnt", tmp_path / "data"
    daemons: list[subprocess.Popen] = []

    def start_daemon(extra: list[str]) -> subprocess.Popen:
        daemons.append(start_pod(node_dir, data, extra, engine))
        return daemons[-1]

    try:
        for extra in (["--passthrough", "off"], []):
            daemon = start_daemon(extra)
            assert is_mounted(mnt), "the mount reached the node"
            chunk = os.urandom(MiB)
            name = f"{mnt}/chunk-{len(daemons)}"
            assert engine.ask("write", path=name, hex=chunk.hex()) == {"ok": True}
            held = engine.ask("open", path=name)["fd"]
            assert engine.ask("pread", fd=held, size=2 * MiB) == {"hex": chunk.hex()}

            pod = pod_processes(daemon.pid)
            for pid in pod:  # the pod dies: every process of its container at once
                os.kill(pid, signal.SIGKILL)
            assert all(wait_dead(pid) for pid in pod)
            assert engine.ask("read", path=name).get("errno") in DEAD

            start_daemon(extra)  # (kvfs mount clears the dead mount first)
            assert engine.ask("read", path=name) == {"hex": chunk.hex()}, "new opens work"
            again = engine.ask("pread", fd=held, size=2 * MiB)
            if extra:  # the daemon served that file: its connection is gone
                assert again.get("errno") in DEAD, again
            else:  # the kernel reads the verified file itself: right bytes, or an error
                assert again == {"hex": chunk.hex()} or again.get("errno") in DEAD, again
            engine.ask("close", fd=held)

            # preStop, in the kvfs pod's namespace: the mount goes, the daemon exits 0
            pre_stop = kvfs_container(node_daemonset())["lifecycle"]["preStop"]
            command = [part.replace(NODE_DIR, str(node_dir))
                       for part in pre_stop["exec"]["command"]]
            subprocess.run(["nsenter", "-t", str(daemons[-1].pid), "-m", *command], check=True,
                           timeout=60)
            assert daemons[-1].wait(30) == 0
            assert not engine.ask("exists", path=f"{mnt}/.kvfs/stats")["exists"]
            assert not is_mounted(mnt)
    finally:
        for daemon in daemons:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()


def test_the_daemon_alone_dies_and_the_engine_sees_no_error(node_dir: Path, tmp_path: Path,
                                                            engine: Engine) -> None:
    """A crash or an OOM kill of the daemon process: the pod's loop mounts again, the new
    daemon takes the mount over from the keeper, and the engine's opens and reads wait it
    out; a file it held open by passthrough keeps reading."""
    mnt = node_dir / "mnt"
    pod = start_pod(node_dir, tmp_path / "data", [], engine)
    try:
        chunk = os.urandom(MiB)
        name = f"{mnt}/chunk"
        assert engine.ask("write", path=name, hex=chunk.hex()) == {"ok": True}
        held = engine.ask("open", path=name)["fd"]
        (daemon,) = [int(child) for child in
                     Path(f"/proc/{pod.pid}/task/{pod.pid}/children").read_text().split()]
        os.kill(daemon, signal.SIGKILL)
        assert wait_dead(daemon)
        assert engine.ask("read", path=name) == {"hex": chunk.hex()}, "waited, then read"
        assert engine.ask("pread", fd=held, size=2 * MiB) == {"hex": chunk.hex()}
        engine.ask("close", fd=held)
        assert pod.poll() is None, "the pod lives on"
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
        if pod.wait(30) is None:
            pod.kill()


def docker_works() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True, timeout=60).returncode == 0


@pytest.mark.skipif(not docker_works(), reason="no docker daemon (install docker and start "
                    "it to build deploy/kubernetes/Dockerfile)")
def test_image_builds_and_runs_kvfs(tmp_path: Path) -> None:
    tag = f"kvfs-test:{os.getpid()}"
    subprocess.run(["docker", "build", "-f", str(DEPLOY / "Dockerfile"), "-t", tag, str(REPO)],
                   check=True, timeout=1800)
    try:
        shown = subprocess.run(["docker", "run", "--rm", tag, "mount", "--help"],
                               capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0 and "--metrics-port" in shown.stdout
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], check=False, timeout=120)
