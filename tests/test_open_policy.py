"""How an open is served (kvfs/files/policy.py's `serve_open`): a table of opens and the state
of their kernel inode, each with its answer. Pure function: no mount."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from kvfs.files.policy import OpenFacts, Serving, serve_open, shares_kernel_inode

RD, WR, RW = os.O_RDONLY, os.O_WRONLY, os.O_RDWR
DIRECT, TRUNC = os.O_DIRECT, os.O_TRUNC


@dataclass(frozen=True)
class On:
    """An open already on the kernel inode."""

    writable: bool
    version: int
    backing: bool = True


READER_V1 = On(False, 1)
READER_V1_SERVED = On(False, 1, backing=False)
READER_V2 = On(False, 2)
WRITER = On(True, 1)

PT = {"passthrough": True}  # a mount where the kernel grants passthrough
ODIRECT_DAEMON = {"passthrough": True, "kernel_o_direct": False}

CASES = [
    # -- a kernel inode an earlier daemon of the connection may have left state on --
    ("reader on an inherited kernel inode", OpenFacts(RD, True, 1, inherited=True, **PT),
     Serving.RENEW),
    ("writer on an inherited kernel inode", OpenFacts(WR, True, 1, inherited=True, **PT),
     Serving.RENEW),
    ("reader joined there already", OpenFacts(RD, True, 1, inherited=True, joined=True, **PT),
     Serving.PASSTHROUGH_READER),
    ("kvfs's own open", OpenFacts(RD, True, 1, own=True, inherited=True, **PT), Serving.OWN),
    # -- the kernel inode: join, or not --
    ("alone reader", OpenFacts(RD, True, 1, **PT), Serving.PASSTHROUGH_READER),
    ("reader joins readers of its version", OpenFacts(RD, True, 1, others=[READER_V1], **PT),
     Serving.PASSTHROUGH_READER),
    ("reader beside readers of another version", OpenFacts(RD, True, 1, others=[READER_V2]),
     Serving.RENEW),
    ("reader beside a writer", OpenFacts(RD, True, 1, others=[WRITER], **PT), Serving.RENEW),
    ("writer beside readers", OpenFacts(WR, True, 1, others=[READER_V1], **PT), Serving.RENEW),
    ("read-write beside a writer", OpenFacts(RW, True, 1, others=[WRITER]), Serving.RENEW),
    ("reader's retry waits", OpenFacts(RD, True, 1, others=[WRITER], retrying=True),
     Serving.WAIT),
    ("read-write retry waits", OpenFacts(RW, True, 1, others=[READER_V1], retrying=True),
     Serving.WAIT),
    ("retry that waited is refused",
     OpenFacts(RD, True, 1, others=[WRITER], retrying=True, waited=True), Serving.RENEW),
    ("write-only retry served beside",
     OpenFacts(WR, True, 1, others=[READER_V1], retrying=True, **PT), Serving.WRITER_BESIDE),
    ("write-only retry beside a writer",
     OpenFacts(WR, False, 1, others=[WRITER], retrying=True, waited=True),
     Serving.WRITER_BESIDE),
    ("joined beside", OpenFacts(WR, True, 1, others=[READER_V1], joined=True, beside=True,
                                **PT), Serving.WRITER_BESIDE),
    ("joined: its claim is not asked again",
     OpenFacts(WR, True, 1, others=[On(True, 1, backing=False)], joined=True, **PT),
     Serving.PASSTHROUGH_WRITER),
    ("kvfs's own open", OpenFacts(WR, True, 1, own=True, others=[READER_V1], **PT),
     Serving.OWN),
    ("kvfs's own open, no passthrough", OpenFacts(WR, False, 1, own=True), Serving.OWN),
    # -- readers with passthrough --
    ("reader beside a daemon-served reader",
     OpenFacts(RD, True, 1, others=[READER_V1, READER_V1_SERVED], joined=True, **PT),
     Serving.DAEMON_READER),
    ("reader of an empty file", OpenFacts(RD, False, 1, **PT), Serving.DAEMON_READER),
    ("O_DIRECT reader", OpenFacts(RD | DIRECT, True, 1, **PT), Serving.PASSTHROUGH_READER),
    ("O_DIRECT reader, --odirect daemon", OpenFacts(RD | DIRECT, True, 1, **ODIRECT_DAEMON),
     Serving.DAEMON_READER),
    ("buffered reader, --odirect daemon", OpenFacts(RD, True, 1, **ODIRECT_DAEMON),
     Serving.PASSTHROUGH_READER),
    # -- writers with passthrough --
    ("write-only writer", OpenFacts(WR, True, 1, **PT), Serving.PASSTHROUGH_WRITER),
    ("maker of an empty file", OpenFacts(WR | TRUNC, False, 1, **PT),
     Serving.PASSTHROUGH_WRITER),
    ("O_DIRECT writer", OpenFacts(WR | DIRECT, True, 1, **PT), Serving.PASSTHROUGH_WRITER),
    ("O_DIRECT writer, --odirect daemon", OpenFacts(WR | DIRECT, True, 1, **ODIRECT_DAEMON),
     Serving.DAEMON_WRITER),
    ("read-write writer", OpenFacts(RW, True, 1, **PT), Serving.DAEMON_WRITER),
    ("writer that clears setuid", OpenFacts(WR, True, 1, clears_privileges=True, **PT),
     Serving.DAEMON_WRITER),
    # -- without passthrough --
    ("first reader of a version", OpenFacts(RD, True, 1), Serving.DIRECT_READER),
    ("reader of a version read directly once", OpenFacts(RD, True, 1, read_directly=1),
     Serving.PAGE_CACHE_READER),
    ("reader of the version in the page cache", OpenFacts(RD, True, 1, cached_version=1),
     Serving.PAGE_CACHE_READER),
    ("reader of a newer version than the page cache's",
     OpenFacts(RD, True, 2, cached_version=1, read_directly=1), Serving.DIRECT_READER),
    ("O_DIRECT reader, no passthrough", OpenFacts(RD | DIRECT, True, 1),
     Serving.DIRECT_READER),
    ("writer, no passthrough", OpenFacts(WR, True, 1), Serving.DIRECT_WRITER),
    ("read-write writer, no passthrough", OpenFacts(RW, True, 1, cached_version=1),
     Serving.DIRECT_WRITER),
]


@pytest.mark.parametrize(("facts", "answer"), [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_serve_open(facts: OpenFacts, answer: Serving) -> None:
    assert serve_open(facts) is answer


def test_every_answer_is_tabled() -> None:
    assert {case[2] for case in CASES} == set(Serving)


@pytest.mark.parametrize(("others", "writable", "version", "shares"), [
    ([], True, 1, True),
    ([], False, 1, True),
    ([READER_V1, READER_V1_SERVED], False, 1, True),
    ([READER_V1, READER_V2], False, 1, False),
    ([READER_V1], True, 1, False),
    ([WRITER], False, 1, False),
    ([WRITER], True, 1, False),
])
def test_shares_kernel_inode(others: list[On], writable: bool, version: int,
                             shares: bool) -> None:
    assert shares_kernel_inode(others, writable, version) is shares
