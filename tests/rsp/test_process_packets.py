"""The gdbserver role's process packets at the wire (rsp/packets): host I/O's `vFile:` requests (hex numbers of 31
bits at most, hex paths, the protocol's open flags and modes, binary pwrite data), their replies (`F<result>`,
`F-1,<errno>`, `struct stat`), a malformed one answered `F-1,<EINVAL>` by the dispatcher as gdbserver answers it, and
`qXfer:libraries-svr4:read`'s annex read as gdbserver's linux-low.cc reads it."""

from __future__ import annotations

import struct

import pytest

from kgtp_sim.rsp.dispatch import Dispatcher, handles
from kgtp_sim.rsp.packets import connect as c
from kgtp_sim.rsp.packets import hostio as h
from kgtp_sim.rsp.packets.base import PacketError

PASSWD = b"/etc/passwd".hex().encode()


def test_open_takes_a_hex_path_and_the_protocols_flags_and_mode():
    assert h.Open.parse(PASSWD + b",0,1c0") == h.Open(b"/etc/passwd", 0, 0o700)
    assert h.Open.parse(b"2f61,601,1ff") == h.Open(b"/a", h.O_WRONLY | h.O_CREAT | h.O_TRUNC, 0o777)  # remote put
    assert h.Open.parse(b"2f61,0,81a4").mode == h.S_IFREG | 0o644


@pytest.mark.parametrize("body", [
    b"2f61,0", b"2f61,0,0,0", b"2f6,0,0", b"2f6x,0,0", b"2f0061,0,0",  # fields, odd or bad hex, a NUL in the path
    b"2f61,4,0", b"2f61,241,0",  # flags the protocol does not define (0x4; Linux's O_CREAT, 0x40)
    b"2f61,0,1000", b"2f61,0,20000",  # a mode bit it does not define, S_IFCHR (not for open)
    b"2f61,80000000,0", b"2f61,,0",  # more than 31 bits (gdbserver's require_int), empty
])
def test_a_malformed_open_is_refused(body):
    with pytest.raises(PacketError):
        h.Open.parse(body)


def test_pread_pwrite_close_fstat_setfs_readlink_unlink():
    assert h.Pread.parse(b"3,4000,1d5458") == h.Pread(3, 0x4000, 0x1D5458)
    assert h.Pread.parse(b"3,10,123456789a").offset == 0x123456789A  # offsets past 4 GiB
    assert h.Pwrite.parse(b"3,10,a,b,$\x7d") == h.Pwrite(3, 0x10, b"a,b,$\x7d")  # the data as the codec left it
    assert h.Pwrite.parse(b"3,0,") == h.Pwrite(3, 0, b"")
    assert (h.Close.parse(b"7"), h.Fstat.parse(b"3"), h.SetFs.parse(b"7b68")) == (h.Close(7), h.Fstat(3),
                                                                                 h.SetFs(0x7B68))
    assert h.Readlink.parse(PASSWD) == h.Readlink(b"/etc/passwd")
    assert h.Unlink.parse(PASSWD) == h.Unlink(b"/etc/passwd")
    assert (h.Stat.parse(PASSWD), h.Lstat.parse(PASSWD)) == (h.Stat(b"/etc/passwd"), h.Lstat(b"/etc/passwd"))
    for packet, body in ((h.Stat, b"2f6"), (h.Lstat, b"zz"), (h.Pread, b"3,10"), (h.Pread, b"80000000,10,0"), (h.Close, b""), (h.Close, b"-1"),
                         (h.Fstat, b"3,"), (h.SetFs, b"-1"), (h.SetFs, b""), (h.Pwrite, b"3,10"),
                         (h.Readlink, b"2f6"), (h.Unlink, b"zz")):
        with pytest.raises(PacketError):
            packet.parse(body)


class _Files:
    @handles(h.Close)
    def close(self, packet: h.Close) -> bytes:
        return h.reply(0)

    @handles(c.ReadAuxv)
    def auxv(self, packet: c.ReadAuxv) -> bytes:
        return b"l"


def test_a_malformed_host_io_request_is_answered_einval_as_gdbserver_does():
    """gdbserver's hostio_packet_error: `F-1,16`, which GDB's remote_hostio_send_command reads as an errno; other
    families keep E01; an unknown vFile packet (one this server has no handler for) is the empty reply."""
    dispatcher = Dispatcher((_Files(),))
    assert dispatcher.dispatch(b"vFile:close:3") == b"F0"
    assert dispatcher.dispatch(b"vFile:close:x") == b"F-1,16"
    assert dispatcher.dispatch(b"qXfer:auxv:read::zz") == b"E01"
    assert dispatcher.dispatch(b"vFile:lstat:" + PASSWD) == b""
    assert "vFile" not in ";".join(dispatcher.supported_features())  # gdbserver announces none: GDB tries


def test_replies_and_the_protocols_stat():
    assert (h.reply(3), h.reply(0x4000), h.error(h.FILEIO_ENOENT), h.error(h.FILEIO_ENAMETOOLONG)) == (
        b"F3", b"F4000", b"F-1,2", b"F-1,5b")
    stat = h.encode_stat(dev=1, ino=0xFFFF_8880_0123_4000, mode=0o104755, nlink=1, size=0x1E2F50, blksize=4096,
                         blocks=3864, mtime=7)
    assert len(stat) == h.STAT_SIZE == 64
    assert struct.unpack(">7I3Q3I", stat) == (1, 0x0123_4000, h.S_IFREG | 0o755, 1, 0, 0, 0, 0x1E2F50, 4096, 3864, 0,
                                              7, 0)  # setuid is no protocol bit; the inode cut to 32 bits
    assert struct.unpack_from(">I", h.encode_stat(dev=0, ino=0, mode=0o10600, nlink=1, size=0, blksize=0, blocks=0),
                              8) == (0o600,)  # a FIFO: no file type the protocol has


@pytest.mark.parametrize("annex, fields", [
    ("", (0, 0, 0)),
    ("lmid=7ffff7ffe118;start=7ffff7fc0200;prev=7ffff7ffdad0", (0x7FFFF7FFE118, 0x7FFFF7FC0200, 0x7FFFF7FFDAD0)),
    ("start=10", (0, 0x10, 0)),
    ("foo=9;start=a;bar=1;prev=b", (0, 0xA, 0xB)),  # unknown names skipped to their ';'
    ("start=;prev=5", (0, 0, 5)),  # an empty value is 0
    ("foo;start=10", (0, 0, 0)),  # the name runs to the next '=': "foo;start"
    ("start=5;junk;prev=6", (0, 5, 0)),  # "junk;prev" is one unknown name, and nothing follows its value
    ("start=5;junk", (0, 5, 0)),  # a part without '=' ends the annex
])
def test_the_libraries_svr4_annex_is_read_as_gdbserver_reads_it(annex, fields):
    packet = c.ReadLibrariesSvr4.parse(annex.encode() + b":0,1000")
    assert (packet.lmid, packet.start, packet.prev) == fields
    assert (packet.annex, packet.offset, packet.length) == (annex, 0, 0x1000)


@pytest.mark.parametrize("body", [b"start=zz:0,1000", b"start=10", b"prev=10000000000000000:0,10", b":0"])
def test_a_malformed_libraries_svr4_request_is_refused(body):
    with pytest.raises(PacketError):
        c.ReadLibrariesSvr4.parse(body)


def test_libraries_svr4_announces_the_augmented_form():
    assert c.ReadLibrariesSvr4.FEATURES == ("qXfer:libraries-svr4:read+", "augmented-libraries-svr4-read+")
