"""Print a deb-src entry (deb822) for a Debian release, built from the Debian archives this
machine's apt is configured with: their URIs and keyrings. So a build fetches sources from
the mirror the machine already uses, and apt's signatures vouch for them.

    python scripts/debian_sources.py trixie >parts/stable-src.sources

Exits 1 with one line on stderr where no Debian archive is configured.
"""

from __future__ import annotations

import sys
from pathlib import Path

SOURCES = Path("/etc/apt/sources.list.d")
ONE_LINE = Path("/etc/apt/sources.list")
DEFAULT_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"


def deb822_entries(text: str) -> list[dict[str, str]]:
    entries = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, value = line.split(":", 1)
            fields[key.strip().lower()] = value.strip()
        if fields:
            entries.append(fields)
    return entries


def one_line_entries(text: str) -> list[dict[str, str]]:
    entries = []
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if len(words) < 3 or words[0] not in ("deb", "deb-src"):
            continue
        options = {}
        if words[1].startswith("["):
            while not words[1].endswith("]"):
                words[1:3] = [words[1] + " " + words[2]]
            for option in words[1].strip("[]").split():
                key, _, value = option.partition("=")
                options[key.lower()] = value
            words.pop(1)
        entry = {"uris": words[1], "suites": words[2]}
        if "signed-by" in options:
            entry["signed-by"] = options["signed-by"]
        entries.append(entry)
    return entries


def debian_archives() -> list[tuple[str, str]]:
    """(URI, keyring) of each configured archive that carries Debian's main suites (not its
    security archive)."""
    entries = []
    for path in sorted(SOURCES.glob("*.sources")):
        entries += deb822_entries(path.read_text())
    for path in [ONE_LINE, *sorted(SOURCES.glob("*.list"))]:
        if path.exists():
            entries += one_line_entries(path.read_text())
    found = []
    for entry in entries:
        if entry.get("enabled", "yes").lower() == "no":
            continue
        keyring = entry.get("signed-by", DEFAULT_KEYRING)
        if "debian-archive-keyring" not in keyring:
            continue
        for uri in entry.get("uris", "").split():
            suites = entry.get("suites", "").split()
            if "security" in uri or all("security" in suite for suite in suites):
                continue
            if (uri, keyring) not in found:
                found.append((uri, keyring))
    return found


def main() -> int:
    release = sys.argv[1]
    archives = debian_archives()
    if not archives:
        print("no Debian archive (debian-archive-keyring) in /etc/apt sources", file=sys.stderr)
        return 1
    for uri, keyring in archives:
        print(f"Types: deb-src\nURIs: {uri}\nSuites: {release}\nComponents: main\n"
              f"Signed-By: {keyring}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
