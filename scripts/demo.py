"""Two LMCache instances share one long prompt's KV cache through a kvfs mount.

Mounts kvfs, runs LMCache instance A (its own process) storing a Llama-3.1-8B-shaped prefix
through LMCache's `fs` plugin, then instance B (another process) looking it up and loading it,
next to what B has without sharing (the same lookup on a private, empty directory). Then shows
the files, `du` and `df` of the mount, and always unmounts, also on error or Ctrl-C.

With `--hosts N` (N >= 2) the same runs on a shared pool: N kvfs daemons ("hosts", here all on
this machine) mount one data directory (a temporary one unless --data is given) with their
metadata in one Redis (a throwaway redis-server unless --meta is given). A stores through the
first mount, B retrieves through the last; then every mount's counters, and the pool as the
second mount lists it. Every mount is unmounted and Redis stopped at the end, also on error.

    .venv/bin/python scripts/demo.py [--data DIR] [--mnt DIR] [--chunks N] [--warm]
    .venv/bin/python scripts/demo.py --hosts 2 [--meta redis://HOST:PORT/DB] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

if TYPE_CHECKING:
    from local_redis import LocalRedis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # LMCache's engine driver lives with the tests
ENGINE_ENV = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false",
              "LMCACHE_LOG_LEVEL": os.environ.get("LMCACHE_LOG_LEVEL", "INFO")}
KV_SEED = 42
DEFAULT_DATA = REPO / ".kvfs-demo" / "data"
console = Console(highlight=False)


class DemoError(Exception):
    """A step failed; the message says which and where its log is."""


def gib(nbytes: int) -> str:
    return f"{nbytes / 1024**3:.2f} GiB"


def is_mounted(mountpoint: Path) -> bool:
    return any(line.split()[4] == str(mountpoint)
               for line in Path("/proc/self/mountinfo").read_text().splitlines())


@dataclass
class Pool:
    """The kvfs mounts of one run: one mount on one host, or several hosts sharing a pool."""

    data: Path
    mounts: list[Path]
    meta: str | None = None  # the shared pool's Redis URL (None: LMDB, one host)
    redis: LocalRedis | None = None  # the throwaway Redis this run started, if any
    temp: Path | None = None  # removed at the end: temporary data directory, Redis files
    pids: list[int] = field(default_factory=list)  # the shared pool's kvfs daemons

    @property
    def shared(self) -> bool:
        return len(self.mounts) > 1

    @property
    def temporary_data(self) -> bool:
        return self.temp is not None and self.data.is_relative_to(self.temp)


def mount(args: argparse.Namespace, pool: Pool | None = None,
          mountpoint: Path | None = None) -> None:
    mountpoint = mountpoint or args.mnt
    mountpoint.mkdir(parents=True, exist_ok=True)
    extra = ["--capacity", args.capacity] if args.capacity else []
    if pool is not None and pool.meta:
        extra += ["--meta", pool.meta]
    data = pool.data if pool is not None else args.data
    result = subprocess.run([sys.executable, str(REPO / "mount_kvfs.py"), str(mountpoint),
                             "--data", str(data), *extra],
                            capture_output=True, text=True, timeout=120)
    if result.returncode:
        raise DemoError(result.stderr.strip() or f"mount_kvfs.py exited {result.returncode}")


def unmount(mountpoint: Path) -> None:
    if not is_mounted(mountpoint):
        return
    if subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True).returncode:
        # Busy (a shell sitting in it): detach now, the kernel finishes when it is let go.
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)


def drop_page_cache() -> bool:
    """Make B read from the volume, not from RAM (root only)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def run_engine(label: str, ops: list[str], logs: Path, **options: Any) -> dict[str, Any]:
    """One LMCache instance in its own process; its log goes to `logs/<label>.log`."""
    argv = [sys.executable, str(REPO / "tests" / "lmcache_engine.py"), *ops]
    for name, value in options.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    log_path = logs / f"{label}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                env=ENGINE_ENV, cwd=REPO)
        try:
            stdout, _ = proc.communicate()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise DemoError(f"instance {label} failed (exit {proc.returncode}); see {log_path}")
    return json.loads(lines[-1])


def show_listing(base: Path, mountpoint: Path) -> None:
    listing = subprocess.run(["ls", "-l", str(base)], capture_output=True, text=True).stdout
    lines = listing.splitlines()
    console.print(f"\n[bold]$ ls -l {base}[/]")
    for line in lines[:6]:
        console.print(line, style="dim", soft_wrap=True)
    if len(lines) > 6:
        console.print(f"... {len(lines) - 6} more files", style="dim")
    for command in (["du", "-sh", str(base)], ["df", "-h", str(mountpoint)]):
        output = subprocess.run(command, capture_output=True, text=True).stdout.rstrip()
        console.print(f"\n[bold]$ {' '.join(command)}[/]")
        console.print(output, style="dim", soft_wrap=True)


def read_stats(mountpoint: Path) -> dict[str, Any] | None:
    try:
        return json.loads((mountpoint / ".kvfs" / "stats").read_text())
    except (OSError, ValueError):
        return None


def show_kvfs_stats(mountpoint: Path) -> None:
    """kvfs's own counters (reset at mount): what went in and out since the remount."""
    stats = read_stats(mountpoint)
    if stats is None:
        return
    console.print(f"\n[bold]$ cat {mountpoint}/.kvfs/stats[/]  (since the last mount)")
    console.print(f"data path {stats['data_path']}: {stats['opens_passthrough']:,} opens read "
                  f"by the kernel after verifying {gib(stats['verified_bytes'])}, "
                  f"{stats['opens_daemon']:,} served by kvfs; "
                  f"lookup hits {stats['lookup_hits']:,}, misses {stats['lookup_misses']:,}; "
                  f"loaded {gib(stats['bytes_opened'])}, stored {gib(stats['bytes_committed'])} "
                  f"(the daemon read {gib(stats['bytes_read'])}, "
                  f"received {gib(stats['bytes_written'])}); "
                  f"{stats['files']:,} files, {gib(stats['used_bytes'])} of "
                  f"{gib(stats['capacity_bytes'])} used", style="dim", soft_wrap=True)
    console.print(f"read-ahead from B's lookups: {gib(stats['prefetch_bytes'])} read and "
                  f"verified before B opened them, {gib(stats['prefetch_used_bytes'])} of it "
                  f"opened by B", style="dim")


def show_pool_stats(mounts: list[Path]) -> None:
    """Every host's counters side by side (each daemon counts only what it served)."""
    rows = [("opens read by the kernel (passthrough)", "opens_passthrough", str),
            ("opens served by kvfs", "opens_daemon", str),
            ("bytes verified before passthrough", "verified_bytes", gib),
            ("files written (commits)", "commits", str),
            ("writes by the kernel (passthrough)", "write_opens_passthrough", str),
            ("lookup hits", "lookup_hits", str),
            ("lookup misses", "lookup_misses", str),
            ("read ahead after lookups", "prefetch_bytes", gib),
            ("bytes loaded (opened for reading)", "bytes_opened", gib),
            ("bytes stored (committed)", "bytes_committed", gib),
            ("of them read by the daemon", "bytes_read", gib),
            ("of them written to the daemon", "bytes_written", gib),
            ("files in the pool", "files", str),
            ("pool used", "used_bytes", gib)]
    stats = [read_stats(m) or {} for m in mounts]
    table = Table(title="kvfs counters per host (.kvfs/stats, since each mount)")
    table.add_column("")
    for index, mountpoint in enumerate(mounts, 1):
        table.add_column(f"host {index}\n{mountpoint.name}", justify="right")
    for label, key, fmt in rows:
        table.add_row(label, *(fmt(s[key]) if key in s else "-" for s in stats))
    console.print()
    console.print(table)


def results_table(shared: dict[str, Any], private: dict[str, Any]) -> Table:
    table = Table(title=f"Instance B, prompt of {shared['tokens']:,} tokens")
    table.add_column("")
    table.add_column("with kvfs sharing", justify="right", style="green")
    table.add_column("without sharing", justify="right", style="red")
    rows = [("tokens found (lookup)", lambda r: f"{r['lookup']['tokens_hit']:,}"),
            ("tokens loaded", lambda r: f"{r['retrieve']['tokens_hit']:,}"),
            ("tokens to recompute (prefill)",
             lambda r: f"{r['tokens'] - r['retrieve']['tokens_hit']:,}"),
            ("KV bytes loaded", lambda r: gib(r["retrieve"]["bytes_loaded"])),
            ("first lookup to last byte", lambda r: f"{r['prompt']['seconds']:.2f} s"
             if r["retrieve"]["tokens_hit"] else "-"),
            ("throughput over it", lambda r: f"{r['prompt']['gbps']:.2f} GB/s"
             if r["retrieve"]["tokens_hit"] else "-"),
            ("retrieve alone", lambda r: f"{r['retrieve']['seconds']:.2f} s, "
             f"{r['retrieve']['gbps']:.2f} GB/s" if r["retrieve"]["tokens_hit"] else "-"),
            ("bytes equal to A's", lambda r: "yes" if r["retrieve"]["exact"] else "-")]
    for name, cell in rows:
        table.add_row(name, cell(shared), cell(private))
    return table


def demo(args: argparse.Namespace, pool: Pool) -> None:
    from lmcache_engine import PRESETS

    shape = PRESETS[args.preset]
    tokens = args.chunks * shape.chunk_tokens
    where = (f"kvfs: {args.mnt} (data {args.data})" if not pool.shared else
             f"kvfs: {len(pool.mounts)} hosts, {', '.join(str(m) for m in pool.mounts)}\n"
             f"shared pool: data {pool.data}, metadata in "
             f"{pool.meta or 'a throwaway redis-server'}")
    console.print(Panel.fit(
        f"Model KV shape: {shape.model} ({shape.layers} layers, {shape.kv_heads} KV heads x "
        f"{shape.head_dim}, {str(shape.dtype).removeprefix('torch.')})\n"
        f"Shared prefix: {tokens:,} tokens = {args.chunks} chunks x {shape.chunk_tokens} tokens "
        f"x {shape.chunk_bytes // 2**20} MiB = {gib(args.chunks * shape.chunk_bytes)}\n"
        f"{where}", title="kvfs + LMCache 0.5.6"))
    logs = args.mnt.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    common = dict(preset=args.preset, chunks=args.chunks, kv_seed=KV_SEED)
    if pool.shared:
        start_pool(args, pool)
    else:
        with console.status("Mounting kvfs"):
            mount(args)
        console.print(f"[green]✓[/] kvfs mounted at {args.mnt}")
    # A writes through the first host, B reads through the last (on one host: the same mount).
    base, base_b = pool.mounts[0] / "lmcache", pool.mounts[-1] / "lmcache"
    shutil.rmtree(base, ignore_errors=True)  # start from an empty cache every run

    with console.status(f"Instance A: prefill, then store {tokens:,} tokens of KV"):
        a = run_engine("A", ["store"], logs, dir=base, **common)
    store = a["store"]
    console.print(f"[green]✓[/] instance A (pid {a['pid']}) stored {store['chunks']} chunks, "
                  f"{gib(store['bytes'])} in {store['seconds']:.2f} s "
                  f"({store['bytes'] / store['seconds'] / 1e9:.2f} GB/s)")

    if not args.warm and pool.shared:
        # B's host has never seen these files; only the machine's page cache is shared.
        with console.status("Dropping the page cache (cold read for B)"):
            dropped = drop_page_cache()
        if dropped:
            console.print("[green]✓[/] page cache dropped")
    elif not args.warm:
        with console.status("Remounting kvfs and dropping the page cache (cold read for B)"):
            unmount(args.mnt)
            mount(args)
            dropped = drop_page_cache()
        console.print(f"[green]✓[/] kvfs remounted{', page cache dropped' if dropped else ''}")

    on_host = f" on host {len(pool.mounts)} ({pool.mounts[-1]})" if pool.shared else ""
    with console.status(f"Instance B{on_host}: lookup + retrieve through kvfs"):
        b = run_engine("B-shared", ["lookup", "retrieve"], logs, dir=base_b, **common)
    console.print(f"[green]✓[/] instance B (pid {b['pid']}){on_host} loaded "
                  f"{b['retrieve']['tokens_hit']:,} tokens from kvfs")
    private_dir = Path(tempfile.mkdtemp(prefix="private-B-", dir=args.mnt.parent))
    try:
        with console.status("Instance B without sharing: lookup + retrieve on a private dir"):
            alone = run_engine("B-private", ["lookup", "retrieve"], logs, dir=private_dir,
                               **common)
    finally:
        shutil.rmtree(private_dir, ignore_errors=True)

    console.print()
    console.print(results_table(b, alone))
    if not b["retrieve"]["exact"]:
        raise DemoError("B did not get exactly A's bytes")
    if not pool.shared:
        show_kvfs_stats(args.mnt)
        show_listing(base, args.mnt)
        console.print(f"\nLMCache logs: {logs}/", style="dim")
        return
    console.print(f"[green]✓[/] B, on host {len(pool.mounts)}, hit all "
                  f"{b['lookup']['tokens_hit']:,} tokens A stored on host 1, every byte "
                  f"equal to A's")
    show_pool_stats(pool.mounts)
    show_listing(pool.mounts[1] / "lmcache", pool.mounts[1])
    kvfs_log = logs if pool.temporary_data else pool.data
    console.print(f"\nLMCache logs: {logs}/ (kvfs daemons: {kvfs_log}/kvfs.log)", style="dim")


def start_pool(args: argparse.Namespace, pool: Pool) -> None:
    """Redis (unless --meta), then one kvfs daemon per host over the shared data directory."""
    if pool.meta is None:
        from local_redis import LocalRedis

        with console.status("Starting a throwaway redis-server for the pool's metadata"):
            pool.redis = LocalRedis(pool.temp / "redis")
            try:
                pool.redis.start()
            except RuntimeError as error:
                raise DemoError(str(error)) from None
        pool.meta = pool.redis.url
        console.print(f"[green]✓[/] redis-server (pid {pool.redis.process.pid}) at {pool.meta}")
    for index, mountpoint in enumerate(pool.mounts, 1):
        with console.status(f"Mounting kvfs host {index} of {len(pool.mounts)}"):
            mount(args, pool, mountpoint)
        pool.pids.append(daemon_pid(pool.data, mountpoint))
        console.print(f"[green]✓[/] kvfs host {index} mounted at {mountpoint} "
                      f"(daemon pid {pool.pids[-1] or '?'})")


def daemon_pid(data: Path, mountpoint: Path) -> int:
    """The pid of the kvfs daemon serving `mountpoint` in a shared pool (0: not known)."""
    from kvfs.data.volume import Volume

    try:
        return Volume(data).daemon_pid(mountpoint)
    except (OSError, ValueError):
        return 0


def is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def make_pool(args: argparse.Namespace) -> Pool:
    """One mount (args.mnt) on args.data; or --hosts mounts args.mnt1..N on a shared pool."""
    if args.hosts == 1:
        return Pool(args.data, [args.mnt])
    args.mnt.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix="shared-pool-", dir=args.mnt.parent))
    mounts = [args.mnt.with_name(f"{args.mnt.name}{i}") for i in range(1, args.hosts + 1)]
    return Pool(args.data or temp / "data", mounts, meta=args.meta, temp=temp)


def stop_pool(pool: Pool, logs: Path) -> None:
    """Unmount every host and wait for its daemon to leave the pool, then stop Redis and
    remove the temporary files (the daemons' log is kept next to LMCache's)."""
    for mountpoint in pool.mounts:
        unmount(mountpoint)
    deadline = time.monotonic() + 30
    while running := [pid for pid in pool.pids if pid and is_running(pid)]:
        if time.monotonic() > deadline:
            console.print(f"[red]kvfs daemons {running} still running after 30 s[/]")
            break
        time.sleep(0.05)
    if pool.redis is not None:
        pool.redis.stop()
    if pool.temporary_data and (pool.data / "kvfs.log").exists():
        logs.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pool.data / "kvfs.log", logs / "kvfs.log")
    if pool.temp is not None and not any(is_mounted(m) for m in pool.mounts):
        shutil.rmtree(pool.temp, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path,
                        help=f"kvfs data directory (default {DEFAULT_DATA}; with --hosts: a "
                             f"temporary directory, removed at the end)")
    parser.add_argument("--mnt", type=Path, default=REPO / ".kvfs-demo" / "mnt",
                        help="mountpoint (default %(default)s; with --hosts N: MNT1 .. MNTN)")
    parser.add_argument("--hosts", type=int, default=1,
                        help="kvfs daemons sharing one pool through Redis (default 1: one "
                             "mount on embedded LMDB)")
    parser.add_argument("--meta", metavar="redis://HOST:PORT/DB",
                        help="with --hosts: this Redis holds the pool's metadata (it must be "
                             "empty or hold this --data's pool; default: a throwaway "
                             "redis-server)")
    parser.add_argument("--chunks", type=int, default=32,
                        help="shared prefix length in 256-token chunks (default 32: 8192 tokens)")
    parser.add_argument("--preset", default="llama-3.1-8b", choices=["llama-3.1-8b", "small"],
                        help="KV shape (default %(default)s: 32 MiB per chunk)")
    parser.add_argument("--capacity", help="kvfs capacity at first mount, e.g. 4G")
    parser.add_argument("--warm", action="store_true",
                        help="B reads right after A, without remount and page-cache drop")
    args = parser.parse_args(argv)
    if args.hosts < 1:
        parser.error("--hosts must be at least 1")
    if args.meta and args.hosts == 1:
        parser.error("--meta needs --hosts 2 or more")
    if args.data is None and args.hosts == 1:
        args.data = DEFAULT_DATA  # a shared pool never uses it: it is an LMDB volume
    args.data = args.data and args.data.resolve()
    args.mnt = args.mnt.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pool = make_pool(args)
    try:
        demo(args, pool)
    except DemoError as error:
        console.print(f"[red]demo failed:[/] {error}")
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    finally:
        if pool.shared:
            with console.status("Unmounting every host, stopping Redis"):
                stop_pool(pool, args.mnt.parent / "logs")
            for mountpoint in pool.mounts:
                console.print(f"[green]✓[/] kvfs unmounted from {mountpoint}"
                              if not is_mounted(mountpoint)
                              else f"[red]{mountpoint} is still mounted[/]")
            if pool.redis is not None:
                console.print("[green]✓[/] redis-server stopped")
        else:
            with console.status("Unmounting kvfs"):
                unmount(args.mnt)
            console.print(f"[green]✓[/] kvfs unmounted from {args.mnt}"
                          if not is_mounted(args.mnt) else f"[red]{args.mnt} is still mounted[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
