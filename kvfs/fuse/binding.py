"""The FUSE binding kvfs runs on: its fork of pyfuse3 (vendor/pyfuse3/README.md lists what it
adds), built by scripts/build_fuse.sh against libfuse >= 3.17. The one place that checks for
it: `require` fails with one line saying how to build it where another pyfuse3 is installed,
so that nothing else need probe the binding's features."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

FORK_MARK = "+kvfs."


class BindingError(ImportError):
    pass


def require() -> str:
    """The fork's version; BindingError where the installed pyfuse3 is another."""
    try:
        installed = version("pyfuse3")
    except PackageNotFoundError:
        installed = ""
    if FORK_MARK not in installed:
        raise BindingError(
            f"pyfuse3 {installed or '(none)'} is not kvfs's fork (vendor/pyfuse3): "
            "run scripts/setup.sh, which builds it against libfuse >= 3.17")
    return installed
