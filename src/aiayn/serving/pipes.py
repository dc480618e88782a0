"""The server's end of a lane process's pipe where the event loop may read it (Linux, where
a duplex ``multiprocessing.Pipe`` is a socket pair): how much of what was sent is still
unread (``unread_bytes``: a send that would wait is left to a thread), and the messages
both ways in Connection's framing (``Frames``): read as they arrive, without waiting for
the rest of one, and sent whole; and the lane's own check for what has arrived
(``arrival_check``). Sockets only, no model.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import sys
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler

log = logging.getLogger(__name__)

# SIOCOUTQ (= TIOCOUTQ): the memory a socket's sent and not yet read data holds, which
# a send waits on once it reaches SO_SNDBUF; Linux's, where a duplex Pipe is a socket pair.
CAN_COUNT_UNREAD = sys.platform.startswith("linux")
SEND_TIMEOUT = 3600.0  # seconds a send waits for a child that reads nothing: one stopped


class Frames:
    """The server's end of the socket ``fd``, in ``multiprocessing.Connection``'s framing (a
    4-byte big-endian length, or -1 and an 8-byte one, then the pickle), which the child's
    Connection writes and reads: ``read`` takes whatever has arrived and never waits for
    the rest of a message (one begun stays here between readers: the loop hands the reading
    back to a thread and takes it again); ``send`` writes a message whole."""

    def __init__(self, fd: int):
        # Non-blocking from here on (an event loop's poll makes it so anyway): reads never
        # wait, and a send waits for room here, so is never cut short (a Connection's write
        # to a socket an event loop made non-blocking can be).
        self.sock = socket.socket(fileno=os.dup(fd))  # its own descriptor, the same socket
        self.sock.settimeout(0.0)
        self.pending = bytearray()  # the start of a message whose rest has not come

    def send(self, message: bytes) -> None:
        """``message`` (a pickle) with Connection's frame, as its ``send_bytes`` writes it,
        whole: the child reads it with ``Connection.recv``."""
        size = len(message)
        head = struct.pack("!i", size) if size <= 0x7FFFFFFF else struct.pack("!iQ", -1, size)
        rest = memoryview(head + message)
        while rest:
            try:
                rest = rest[self.sock.send(rest):]
            except BlockingIOError:  # full: wait for room (the loop's sends never get here)
                room = select.poll()
                room.register(self.sock, select.POLLOUT)
                if not room.poll(SEND_TIMEOUT * 1000):
                    raise TimeoutError(f"a lane's process read nothing for {SEND_TIMEOUT:g} "
                                       "s") from None

    def read(self) -> list:
        """The messages completed by what has arrived since the last read (none: EOFError,
        the child has ended). A message that cannot be unpickled is logged and left out:
        the others, its neighbours in the pipe, still arrive."""
        try:
            data = self.sock.recv(1 << 16)
        except BlockingIOError:
            return []
        if not data:
            raise EOFError("the lane's process has closed its end")
        pending = self.pending
        pending += data  # a long message grows in place: linear, not a copy a read
        frames, at = [], 0
        while len(pending) - at >= 4:
            (size,), start = struct.unpack_from("!i", pending, at), at + 4
            if size == -1:
                if len(pending) - at < 12:
                    break
                (size,), start = struct.unpack_from("!Q", pending, at + 4), at + 12
            if len(pending) < start + size:
                break
            frames.append(pending[start:start + size])
            at = start + size
        del pending[:at]  # before unpickling: a bad message must not stay to spoil the next
        messages = []
        for frame in frames:
            try:
                messages.append(ForkingPickler.loads(frame))
            except Exception:
                log.exception("a lane's message (%d bytes) could not be read", len(frame))
        return messages

    def close(self) -> None:
        self.sock.close()


def arrival_check(conn) -> Callable[[], bool]:
    """A check, without waiting, whether ``conn`` has something to read (a message, or its
    other end closed: then ``recv`` raises). A poller kept for the connection's life where
    the platform has one: ``Connection.poll`` builds a selector each call, which a lane
    pays between every two of its steps (3 us warm here, 12-25 us after a step)."""
    if not hasattr(select, "poll"):
        return conn.poll
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return lambda: bool(poller.poll(0))


def unread_bytes(conn) -> int | None:
    """The memory that what was sent over ``conn``'s socket and not yet read at its other
    end holds, in bytes (more than the data: the kernel's accounting); None where the
    platform cannot say."""
    if not CAN_COUNT_UNREAD:
        return None
    import fcntl  # Unix only, as termios
    import termios
    return struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
