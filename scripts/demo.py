"""Two LMCache instances share one long prompt's KV cache through a kvfs mount.

Mounts kvfs, runs LMCache instance A (its own process) storing a Llama-3.1-8B-shaped prefix
through LMCache's `fs` plugin, then instance B (another process) looking it up and loading it,
next to what B has without sharing (the same lookup on a private, empty directory). Then shows
the files, `du` and `df` of the mount, and always unmounts, also on error or Ctrl-C.

    .venv/bin/python scripts/demo.py [--data DIR] [--mnt DIR] [--chunks N] [--warm]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
ENGINE_ENV = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false",
              "LMCACHE_LOG_LEVEL": os.environ.get("LMCACHE_LOG_LEVEL", "INFO")}
KV_SEED = 42
console = Console(highlight=False)


class DemoError(Exception):
    """A step failed; the message says which and where its log is."""


def gib(nbytes: int) -> str:
    return f"{nbytes / 1024**3:.2f} GiB"


def is_mounted(mountpoint: Path) -> bool:
    return any(line.split()[4] == str(mountpoint)
               for line in Path("/proc/self/mountinfo").read_text().splitlines())


def mount(args: argparse.Namespace) -> None:
    args.mnt.mkdir(parents=True, exist_ok=True)
    extra = ["--capacity", args.capacity] if args.capacity else []
    result = subprocess.run([sys.executable, str(REPO / "mount_kvfs.py"), str(args.mnt),
                             "--data", str(args.data), *extra],
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
    argv = [sys.executable, "-m", "kvfs.lmcache_engine", *ops]
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


def show_kvfs_stats(mountpoint: Path) -> None:
    """kvfs's own counters (reset at mount): what the daemon served since the remount."""
    try:
        stats = json.loads((mountpoint / ".kvfs" / "stats").read_text())
    except (OSError, ValueError):
        return
    console.print(f"\n[bold]$ cat {mountpoint}/.kvfs/stats[/]  (since the last mount)")
    console.print(f"data path {stats['data_path']}: {stats['opens_passthrough']:,} opens read "
                  f"by the kernel after verifying {gib(stats['verified_bytes'])}, "
                  f"{stats['opens_daemon']:,} served by kvfs; "
                  f"lookup hits {stats['lookup_hits']:,}, misses {stats['lookup_misses']:,}; "
                  f"read {gib(stats['bytes_read'])}, written {gib(stats['bytes_written'])}; "
                  f"{stats['files']:,} files, {gib(stats['used_bytes'])} of "
                  f"{gib(stats['capacity_bytes'])} used", style="dim", soft_wrap=True)


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
            ("load time", lambda r: f"{r['retrieve']['seconds']:.2f} s"
             if r["retrieve"]["tokens_hit"] else "-"),
            ("load throughput", lambda r: f"{r['retrieve']['gbps']:.2f} GB/s"
             if r["retrieve"]["tokens_hit"] else "-"),
            ("bytes equal to A's", lambda r: "yes" if r["retrieve"]["exact"] else "-")]
    for name, cell in rows:
        table.add_row(name, cell(shared), cell(private))
    return table


def demo(args: argparse.Namespace) -> None:
    from kvfs.lmcache_engine import PRESETS

    shape = PRESETS[args.preset]
    tokens = args.chunks * shape.chunk_tokens
    console.print(Panel.fit(
        f"Model KV shape: {shape.model} ({shape.layers} layers, {shape.kv_heads} KV heads x "
        f"{shape.head_dim}, {str(shape.dtype).removeprefix('torch.')})\n"
        f"Shared prefix: {tokens:,} tokens = {args.chunks} chunks x {shape.chunk_tokens} tokens "
        f"x {shape.chunk_bytes // 2**20} MiB = {gib(args.chunks * shape.chunk_bytes)}\n"
        f"kvfs: {args.mnt} (data {args.data})", title="kvfs + LMCache 0.5.6"))
    logs = args.mnt.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    base = args.mnt / "lmcache"
    common = dict(preset=args.preset, chunks=args.chunks, kv_seed=KV_SEED)

    with console.status("Mounting kvfs"):
        mount(args)
    console.print(f"[green]✓[/] kvfs mounted at {args.mnt}")
    shutil.rmtree(base, ignore_errors=True)  # start from an empty cache every run

    with console.status(f"Instance A: prefill, then store {tokens:,} tokens of KV"):
        a = run_engine("A", ["store"], logs, dir=base, **common)
    store = a["store"]
    console.print(f"[green]✓[/] instance A (pid {a['pid']}) stored {store['chunks']} chunks, "
                  f"{gib(store['bytes'])} in {store['seconds']:.2f} s "
                  f"({store['bytes'] / store['seconds'] / 1e9:.2f} GB/s)")

    if not args.warm:
        with console.status("Remounting kvfs and dropping the page cache (cold read for B)"):
            unmount(args.mnt)
            mount(args)
            dropped = drop_page_cache()
        console.print(f"[green]✓[/] kvfs remounted{', page cache dropped' if dropped else ''}")

    with console.status("Instance B: lookup + retrieve through kvfs"):
        b = run_engine("B-shared", ["lookup", "retrieve"], logs, dir=base, **common)
    console.print(f"[green]✓[/] instance B (pid {b['pid']}) loaded "
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
    show_kvfs_stats(args.mnt)
    show_listing(base, args.mnt)
    console.print(f"\nLMCache logs: {logs}/", style="dim")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO / ".kvfs-demo" / "data",
                        help="kvfs data directory (default %(default)s)")
    parser.add_argument("--mnt", type=Path, default=REPO / ".kvfs-demo" / "mnt",
                        help="mountpoint (default %(default)s)")
    parser.add_argument("--chunks", type=int, default=32,
                        help="shared prefix length in 256-token chunks (default 32: 8192 tokens)")
    parser.add_argument("--preset", default="llama-3.1-8b", choices=["llama-3.1-8b", "small"],
                        help="KV shape (default %(default)s: 32 MiB per chunk)")
    parser.add_argument("--capacity", help="kvfs capacity at first mount, e.g. 4G")
    parser.add_argument("--warm", action="store_true",
                        help="B reads right after A, without remount and page-cache drop")
    args = parser.parse_args(argv)
    args.data, args.mnt = args.data.resolve(), args.mnt.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        demo(args)
    except DemoError as error:
        console.print(f"[red]demo failed:[/] {error}")
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    finally:
        with console.status("Unmounting kvfs"):
            unmount(args.mnt)
        console.print(f"[green]✓[/] kvfs unmounted from {args.mnt}"
                      if not is_mounted(args.mnt) else f"[red]{args.mnt} is still mounted[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
