"""The `kvfs` command line. Failures are one line on stderr and a non-zero exit."""

from __future__ import annotations

import argparse
import errno
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import humanfriendly
from humanfriendly import format_size

from kvfs import daemon
from kvfs.cli import fsck, prewarm, statview
from kvfs.daemon import MountConfig
from kvfs.data.verify import VerifyMode
from kvfs.data.volume import DEFAULT_DATA_DIR, Volume, VolumeError
from kvfs.files.spares import SpareMode
from kvfs.fuse import binding
from kvfs.fuse.mounts import find_mount
from kvfs.meta import PIN_XATTR


class CliError(Exception):
    """A one-line reason to exit non-zero."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def size_or_zero(text: str) -> int:
    """512M, 10G, 2T (binary units, like df -h), or 0."""
    try:
        value = humanfriendly.parse_size(text, binary=True)
    except humanfriendly.InvalidSize as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"size must not be negative: {text!r}")
    return value


def size(text: str) -> int:
    """512M, 10G, 2T: a positive size."""
    value = size_or_zero(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def add_mount_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR,
                        help=f"volume directory for metadata and data (default {DEFAULT_DATA_DIR})")
    parser.add_argument("--capacity", type=size,
                        help="bytes kvfs may use, e.g. 512M, 10G, 2T (default: the volume's free "
                             "space at first mount; kept across mounts)")
    parser.add_argument("--foreground", action="store_true", help="stay attached, log to stderr")
    parser.add_argument("--debug", action="store_true", help="log every request")
    parser.add_argument("--allow-other", action="store_true",
                        help="let other users use the mount (needs user_allow_other for non-root)")
    parser.add_argument("--fsync", action="store_true",
                        help="flush file data to the volume before each commit (power-loss safe)")
    parser.add_argument("--cache-size", type=size, default=MountConfig.cache_bytes,
                        help="daemon read cache, bytes (default 256M)")
    parser.add_argument("--readahead", type=size, default=MountConfig.readahead_bytes,
                        help="bytes read from the volume per cache miss (default 32M)")
    parser.add_argument("--read-ahead-kb", type=int, default=MountConfig.read_ahead_kb,
                        help="kernel readahead of the mount, KiB (default %(default)s)")
    parser.add_argument("--max-background", type=int, default=MountConfig.max_background,
                        help="kernel FUSE requests in flight (default %(default)s)")
    parser.add_argument("--meta", metavar="redis://HOST:PORT/DB",
                        help="keep the metadata in this Redis server, shared by every host that "
                             "mounts the pool, or redis+sentinel://HOST:PORT[,HOST:PORT]/MASTER"
                             "[/DB] for the master Sentinel names (default: LMDB in DATA/meta, "
                             "one host)")
    parser.add_argument("--session-ttl", type=float, default=MountConfig.session_ttl,
                        help="shared pool: seconds without heartbeat after which other hosts "
                             "clean up after this one (default %(default)s)")
    parser.add_argument("--deadline", type=float, default=MountConfig.deadline,
                        metavar="SECONDS",
                        help="shared pool: the longest a request waits on Redis before it "
                             "fails with EIO (default %(default)s)")
    parser.add_argument("--takeover-wait", type=float, default=MountConfig.takeover_wait,
                        metavar="SECONDS",
                        help="after the daemon dies, how long engines' requests wait for the "
                             "next one (the same mount command) to take the mount over before "
                             "they fail with ENOTCONN (default %(default)s)")
    parser.add_argument("--meta-size", type=size, default=MountConfig.meta_map_size,
                        help="largest size of the LMDB metadata map (default 64G)")
    parser.add_argument("--verify", type=VerifyMode, choices=list(VerifyMode),
                        default=MountConfig.verify,
                        help="once: a file is verified once on this host after it changed, "
                             "then the kernel reads it (passthrough), trusting the device in "
                             "between; open: verified at every open unless it is still in "
                             "memory; always: the daemon serves and verifies every read "
                             "(default %(default)s)")
    parser.add_argument("--passthrough", choices=("auto", "off"), default="auto",
                        help="kernel FUSE passthrough where it is available (default auto)")
    parser.add_argument("--odirect", choices=("kernel", "daemon"), default=MountConfig.odirect,
                        help="kernel: O_DIRECT opens pass through too, with the volume's "
                             "alignment rules, as on a plain directory; daemon: kvfs serves "
                             "them, any alignment, at Python speed (default %(default)s)")
    parser.add_argument("--spares", type=SpareMode, choices=list(SpareMode),
                        default=MountConfig.spares,
                        help="writers' staged files made ahead by the volume helper process: "
                             "on, off (default %(default)s)")
    parser.add_argument("--prefetch", type=size_or_zero, default=MountConfig.prefetch_bytes,
                        metavar="SIZE",
                        help="read and verify chunks in the background when an engine looks "
                             "them up, before it opens them: at most SIZE queued and in flight; "
                             "0 turns it off (default 2G)")
    parser.add_argument("--log-file", type=Path, help="daemon log (default DATA/kvfs.log)")
    parser.add_argument("--syslog", action="store_true", help="log to syslog instead of a file")
    parser.add_argument("--metrics-port", type=int,
                        help="serve Prometheus metrics at http://ADDRESS:PORT/metrics")
    parser.add_argument("--metrics-address", default="127.0.0.1",
                        help="address for --metrics-port (default %(default)s)")


def mount_command(args: argparse.Namespace) -> None:
    config = MountConfig(
        mountpoint=args.mountpoint, data=args.data, capacity=args.capacity,
        foreground=args.foreground, debug=args.debug, allow_other=args.allow_other,
        fsync=args.fsync, cache_bytes=args.cache_size, readahead_bytes=args.readahead,
        read_ahead_kb=args.read_ahead_kb, max_background=args.max_background,
        meta_url=args.meta, session_ttl=args.session_ttl, deadline=args.deadline,
        takeover_wait=args.takeover_wait,
        meta_map_size=args.meta_size, log_file=args.log_file, syslog=args.syslog,
        metrics_port=args.metrics_port, metrics_address=args.metrics_address,
        passthrough=args.passthrough == "auto", verify=args.verify, odirect=args.odirect,
        prefetch_bytes=args.prefetch, spares=args.spares,
    )
    try:
        binding.require()
    except binding.BindingError as error:
        raise CliError(str(error)) from None
    daemon.run(config)


def umount_command(args: argparse.Namespace) -> None:
    mountpoint = args.mountpoint.resolve()
    mount = find_mount(mountpoint)
    if mount is None or not mount.source.startswith("kvfs:"):
        raise CliError(f"{mountpoint} is not a kvfs mount")
    pid = Volume(Path(mount.source.removeprefix("kvfs:"))).daemon_pid(mountpoint)
    result = subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True,
                            text=True)
    if result.returncode:
        raise CliError(result.stderr.strip().splitlines()[-1] if result.stderr else
                       f"fusermount3 -u {mountpoint} failed")
    deadline = time.monotonic() + 30
    while pid and _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def pin_command(args: argparse.Namespace) -> None:
    for path in args.paths:
        try:
            if args.unpin:
                os.removexattr(path, PIN_XATTR)
            else:
                os.setxattr(path, PIN_XATTR, b"1")
        except OSError as error:
            if not (args.unpin and error.errno == errno.ENODATA):  # not pinned: nothing to do
                raise CliError(f"{path}: {error.strerror}") from None


def model_rate(text: str) -> tuple[str, float]:
    """MODEL=GBPS, e.g. meta-llama/Llama-3.1-8B-Instruct=4.5."""
    model, _, rate = text.rpartition("=")
    try:
        value = float(rate)
    except ValueError:
        value = -1.0
    if not model or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MODEL=GBPS with GBPS > 0")
    return model, value


def stat_command(args: argparse.Namespace) -> None:
    try:
        statview.show(args.mountpoint, args.json, args.watch, dict(args.break_even))
    except FileNotFoundError:
        raise CliError(f"{args.mountpoint} is not a kvfs mount (no .kvfs/stats)") from None
    except KeyboardInterrupt:
        pass


def prewarm_command(args: argparse.Namespace) -> None:
    try:
        files, warmed = prewarm.prewarm(args.paths)
    except OSError as error:
        raise CliError(f"{error.filename}: {error.strerror}") from None
    print(f"warmed {files} files, {warmed} bytes ({format_size(warmed, binary=True)})")


def fsck_command(args: argparse.Namespace) -> None:
    if not fsck.run(args.data, repair=args.repair, meta_url=args.meta):
        sys.exit(1)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvfs", description="Shared KV-cache filesystem for LLM inference.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    mount = commands.add_parser("mount", help="mount a kvfs volume")
    add_mount_arguments(mount)
    mount.set_defaults(func=mount_command)
    umount = commands.add_parser("umount", help="unmount and wait for the daemon to finish")
    umount.add_argument("mountpoint", type=Path)
    umount.set_defaults(func=umount_command)
    for name, unpin, text in (("pin", False, "protect files or directories from eviction"),
                              ("unpin", True, "let pinned files be evicted again")):
        pin = commands.add_parser(name, help=text)
        pin.add_argument("paths", nargs="+", type=Path)
        pin.set_defaults(func=pin_command, unpin=unpin)
    show = commands.add_parser("stat", help="show a mount's usage, hits, traffic, models")
    show.add_argument("mountpoint", type=Path)
    show.add_argument("--json", action="store_true", help="print the raw JSON state")
    show.add_argument("--watch", action="store_true", help="refresh every second, with rates")
    show.add_argument("--break-even", type=model_rate, action="append", default=[],
                      metavar="MODEL=GBPS",
                      help="load rate above which reusing MODEL's KV beats recomputing it "
                           "(repeatable; defaults: the README's table)")
    show.set_defaults(func=stat_command)
    warm = commands.add_parser("prewarm", help="read files into memory ahead of traffic")
    warm.add_argument("paths", nargs="+", type=Path)
    warm.set_defaults(func=prewarm_command)
    check = commands.add_parser("fsck", help="check (and repair) an unmounted volume")
    check.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR)
    check.add_argument("--meta", metavar="redis://HOST:PORT/DB",
                       help="a shared pool's metadata engine (as given to mount)")
    check.add_argument("--repair", action="store_true",
                       help="drop damaged files, reclaim orphaned data, fix counters")
    check.set_defaults(func=fsck_command)
    return parser


def _run(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (CliError, VolumeError, fsck.FsckError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    return _run(build_parser(), argv)


def mount_main(argv: list[str] | None = None) -> int:
    """`python mount_kvfs.py MOUNTPOINT [options]`: the same as `kvfs mount`."""
    parser = Parser(prog="mount_kvfs.py", description="Mount a kvfs volume.")
    add_mount_arguments(parser)
    parser.set_defaults(func=mount_command)
    return _run(parser, argv)


# mount(8) options that concern the kernel or mount itself, not kvfs.
GENERIC_MOUNT_OPTIONS = {"rw", "defaults", "auto", "noauto", "user", "nouser", "users", "exec",
                         "noexec", "suid", "nosuid", "dev", "nodev", "nofail", "_netdev",
                         "relatime", "noatime"}


def fstab_main(argv: list[str] | None = None) -> int:
    """`mount.kvfs DATA MOUNTPOINT [-o opt,key=value]`: the helper mount(8) runs for fstab.

    /etc/fstab: `/var/lib/kvfs  /mnt/kvfs  kvfs  capacity=100G,allow_other  0 0`."""
    parser = Parser(prog="mount.kvfs", description="mount(8) helper for kvfs")
    parser.add_argument("data")
    parser.add_argument("mountpoint")
    parser.add_argument("-o", dest="options", default="")
    for flag in ("-s", "-f", "-n", "-v"):
        parser.add_argument(flag, action="store_true")
    args = parser.parse_args(argv)
    translated = [args.mountpoint, "--data", args.data]
    for option in filter(None, args.options.split(",")):
        key, _, value = option.partition("=")
        if key in GENERIC_MOUNT_OPTIONS or key.startswith("x-"):
            continue
        translated.append("--" + key.replace("_", "-"))
        if value:
            translated.append(value)
    return mount_main(translated)
