"""The Prometheus endpoint of a live mount: names by Prometheus's conventions, traffic counted
per client for the clients' own code (vLLM's tier, SGLang's HiCache, LMCache), never a file
name in a label, and evicted bytes told apart by whether anyone used them."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import stats, wait_for
from lmcache_engines import assert_exact
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from sglang_hicache import SGLANG_DIR
from sglang_hicache import run_worker as run_sglang
from test_operations import free_port
from vllm_tier import VLLM_DIR
from vllm_tier import run_worker as run_vllm

from kvfs.observe.clients import CLIENTS, client_of

MiB = 1 << 20
UNITS = ("bytes", "seconds", "ratio", "files", "bytes_per_second")


def scrape(port: int) -> list:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return [family for family in text_string_to_metric_families(body.decode())
            if family.name.startswith("kvfs_")]


def samples(port: int) -> Iterator[Sample]:
    for family in scrape(port):
        yield from family.samples


def value(port: int, name: str, **labels: str) -> float:
    (found,) = [sample.value for sample in samples(port)
                if sample.name == name and sample.labels == labels]
    return found


def names_under(root: Path) -> set[str]:
    return {name for _, dirs, files in os.walk(root) for name in (*dirs, *files)}


@pytest.mark.skipif(not (VLLM_DIR.is_dir() and SGLANG_DIR.is_dir()),
                    reason="vLLM's or SGLang's files are missing: run scripts/setup.sh")
def test_real_clients_counted_per_client_by_convention(make_mount, engines) -> None:
    port = free_port()
    kvfs = make_mount("--capacity", "1G", "--metrics-port", str(port))
    root = kvfs.mountpoint
    for sub in ("tier", "hicache", "chunks"):  # (not a label's value: names are checked below)
        (root / sub).mkdir()
    assert run_vllm("store", root / "tier", 4)["failed"] == []
    assert run_vllm("load", root / "tier", 4)["loaded"] == 4
    assert run_sglang("store", root / "hicache", 3, page_mib=1)["failed"] == []
    assert run_sglang("load", root / "hicache", 3, page_mib=1)["loaded"] == 3
    assert engines.run("store", dir=root / "chunks", chunks=2, kv_seed=5)["errors"] == []
    assert_exact(engines.run("lookup", "retrieve", dir=root / "chunks", chunks=2, kv_seed=5),
                 2, {5})
    lmcache_bytes = sum(path.stat().st_size for path in (root / "chunks").iterdir())
    assert lmcache_bytes > 0

    expected = {"vllm": 8 * MiB, "sglang": 3 * MiB, "lmcache": lmcache_bytes}
    for client, size in expected.items():
        assert value(port, "kvfs_stored_bytes_total", client=client) == size
        assert value(port, "kvfs_loaded_bytes_total", client=client) == size
    # The only others: vLLM's config.json and O_DIRECT probes, each written by both processes
    assert 0 < value(port, "kvfs_stored_bytes_total", client="other") < 64 << 10
    shown = stats(root)["clients"]
    assert {client: shown[client]["stored_bytes"] for client in expected} == expected
    assert sum(shown[client]["stored_bytes"] for client in CLIENTS) == stats(root)[
        "bytes_committed"]

    # Conventions: counters end in _total, units are suffixes, histograms have their parts,
    # and no label value is a file or directory name of the mount.
    written = names_under(root)
    assert {client_of(name.encode()) for name in written if name.endswith(".bin")} == {
        "vllm", "sglang"}
    families = scrape(port)
    for family in families:
        base = family.name.removeprefix("kvfs_")
        if family.type == "counter":
            assert {sample.name for sample in family.samples} <= {f"{family.name}_total",
                                                                  f"{family.name}_created"}
        for unit in ("bytes", "seconds"):
            if unit in base.split("_"):
                assert base.endswith(UNITS), family.name
        values = {value for sample in family.samples for key, value in sample.labels.items()
                  if key != "le"}
        assert not values & written, (family.name, values & written)
        assert len(values) <= 64, f"{family.name}: {len(values)} label values"
    by_name = {family.name: family for family in families}
    assert by_name["kvfs_request_seconds"].type == "histogram"
    assert by_name["kvfs_lookups"].type == "counter"
    assert value(port, "kvfs_metadata_reachable") == 1.0
    assert value(port, "kvfs_info", data_path=stats(root)["data_path"],
                 verify=stats(root)["verify"]) == 1.0


def test_evicted_bytes_told_apart_by_use(make_mount) -> None:
    port = free_port()
    kvfs = make_mount("--capacity", "8M", "--metrics-port", str(port))
    root = kvfs.mountpoint
    for index in range(4):  # stored, then loaded: used
        (root / f"used{index}").write_bytes(b"u" * MiB)
    for index in range(4):
        assert (root / f"used{index}").read_bytes() == b"u" * MiB
    for index in range(8):  # stored after those loads, never loaded
        (root / f"unused{index}").write_bytes(b"n" * MiB)
    assert wait_for(lambda: stats(root)["used_bytes"] <= 0.95 * 8 * MiB)
    shown = stats(root)
    left = set(os.listdir(root))
    assert not left & {f"used{index}" for index in range(4)}, "least recently used go first"
    gone_unused = 8 - len(left)
    assert shown["evicted_bytes"] == (4 + gone_unused) * MiB
    assert shown["evicted_unused_bytes"] == gone_unused * MiB > 0
    assert value(port, "kvfs_evicted_bytes_total") == shown["evicted_bytes"]
    assert value(port, "kvfs_evicted_unused_bytes_total") == shown["evicted_unused_bytes"]
    assert value(port, "kvfs_evictions_total") == 4 + gone_unused
    assert value(port, "kvfs_metadata_seconds_count", call="make") == 12  # one per create


@pytest.mark.parametrize(("name", "client"), [
    ("meta-llama-SEP-Llama-3.1-8B@1@0@-3622db64c3a453da@half.data", "lmcache"),
    ("meta-llama-SEP-Llama-3.1-8B@1@0@-3622db64c3a453da@half.tmp", "lmcache"),
    ("Qwen-Qwen2.5-7B@1@0@7f@float16.pt", "lmcache"),
    ("meta-llama-SEP-Llama-3.1-8B@0x00000000@0@9a1f.data", "lmcache"),
    ("a3" * 32 + ".bin", "vllm"),
    ("a3" * 32 + ".bin_123456789.tmp", "vllm"),
    ("a3" * 32 + "_meta-llama-Llama-3.1-8B_0_1.bin", "sglang"),
    ("." + "b4" * 16 + ".tmp", "sglang"),
    ("config.json", "other"),
    ("notes.bin", "other"),
])
def test_client_of_names(name: str, client: str) -> None:
    assert client_of(name.encode()) == client
