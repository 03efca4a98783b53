"""One exec's output from a Docker Engine API, every byte of it or a clear error.

The engine answers ``POST /exec/{id}/start`` with HTTP headers, then hands the connection over to
the command's output: frames of an 8-byte header (stream 1 = stdout, 2 = stderr, three zero bytes,
the payload's length, big-endian) and the payload, until the command ends and the engine closes
the connection.

Why not the ``docker`` client's ``exec_start(stream=True)``: it reads the frames from the raw socket
under the HTTP response, while the HTTP parser read the headers through a buffer of its own. When
the command wrote before the client parsed the headers (a fast command on a loaded machine), its
output already sits in that buffer, and the raw socket shows only the end of the connection: the
command seems to have printed nothing and exited 0. Here the frames are read from that very
buffered reader, and a stream that ends inside a frame, carries an unknown stream number or fails
raises :class:`StreamBroken` instead of passing for a short output.

A stream cut exactly between two frames looks like its clean end; the caller then checks that the
engine saw the command end (see ``DockerSandbox._exit_code``).

:class:`SweepChannel` talks over the container's own stdin and stdout (``POST /containers/{id}/attach``,
framed the same way) to the sweeper that the container's PID 1 keeps (``docker_backend.INIT``).
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from typing import Any

from loongsage.sandbox.local import Capture

FRAME_HEADER = struct.Struct(">BxxxL")
STDOUT, STDERR = 1, 2
_PIECE = 1 << 16  # a frame's payload is read (and kept) in pieces of at most this many bytes


class StreamBroken(Exception):
    """The exec's output stream failed or ended before its clean end: output may be missing."""


class ExecStream:
    """Starts one exec and reads its output (``pump``, in a thread); ``abort`` ends the reading
    from any thread."""

    def __init__(self, api: Any, exec_id: str):
        self.api, self.exec_id = api, exec_id
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._aborted = False

    def pump(self, out: Capture, err: Capture) -> None:
        """Start the exec and read its output to the end into ``out``/``err``. Raises the client's
        ``APIError`` (``NotFound``: the container is gone) when the engine refused the start, and
        :class:`StreamBroken` when the output did not arrive whole."""
        response = self.api._post_json(
            self.api._url("/exec/{0}/start", self.exec_id),
            headers={"Connection": "Upgrade", "Upgrade": "tcp"},
            data={"Tty": False, "Detach": False},
            stream=True,
        )
        try:
            self.api._raise_for_status(response)
            parsed = response.raw._fp  # http.client's response: the headers came through its reader
            if parsed.chunked:  # no engine frames a handed-over connection in HTTP chunks
                raise StreamBroken("the engine sent the exec's output in HTTP chunks, not as a raw stream")
            reader = parsed.fp
            self._hold(getattr(reader.raw, "_sock", None))
            _read_frames(reader, out, err)
            if self._aborted:
                raise StreamBroken("abandoned: the engine did not end the stream after the command ended")
        except OSError as exc:
            if self._aborted:
                raise StreamBroken("abandoned: the engine did not end the stream after the command ended") from None
            raise StreamBroken(f"reading it failed: {type(exc).__name__}: {exc}") from None
        finally:
            response.close()

    def abort(self) -> None:
        """Stop a ``pump`` blocked on an engine that never ends the stream (it raises StreamBroken)."""
        with self._lock:
            self._aborted = True
            if self._socket is not None:
                with contextlib.suppress(OSError):
                    self._socket.shutdown(socket.SHUT_RDWR)  # wakes a blocked read, where close() would not

    def _hold(self, sock: socket.socket | None) -> None:
        with self._lock:
            if sock is not None:
                # the client's API timeout would end a command that is silent longer than it; the
                # exec's own timeout bounds the wait, and abort() ends it if the engine hangs
                sock.settimeout(None)
            self._socket = sock
            if self._aborted:
                raise StreamBroken("abandoned before the stream opened")


class SweepChannel:
    """Asks a container's sweeper to end every process of the container but PID 1 and itself, and
    waits for its answer that none is left (``sweep``, in a thread; ``close`` from any thread).

    A request is a number on a line of the container's stdin, which only the engine's attach writes
    (a sandbox process cannot open PID 1's descriptors); the answer, ``swept N`` on its stdout, comes
    once the kill found no process left, or ``left N`` when some still lived after the sweeper's tries.
    One attach serves every sweep of the container: Podman closes a container's stdin when the attach
    that wrote it ends, and the sweeper with it, so a sweep that saw no answer in time leaves the
    attach open (the numbers tell its late answer from the one to a later request), and once the
    attach ended or broke every sweep fails at once (the caller falls back on other means)."""

    def __init__(self, api: Any, container: str):
        self.api, self.container = api, container
        self._lock = threading.Lock()  # one request at a time
        self._response: Any = None
        self._socket: socket.socket | None = None
        self._frames = b""  # received, not yet taken apart into frames
        self._lines = b""  # the stdout frames' payload, not yet taken apart into lines
        self._asked = 0
        self._closed = False

    def sweep(self, timeout: float) -> None:
        """Returns once the sweeper answered that no process is left, asking again while it answers
        that some still live. Raises :class:`StreamBroken` when no such answer came within
        ``timeout`` seconds or the attach ended, and ``OSError`` when the attach failed (the client's
        ``APIError`` is one: ``NotFound``, the container is gone) or broke."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._socket is None:
                self._attach()
            try:
                while not self._ask(deadline):
                    pass
            except OSError:
                self._drop()
                raise

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError, AttributeError):
            self._socket.shutdown(socket.SHUT_RDWR)  # wakes a sweep waiting for its answer
        with self._lock:
            self._drop()

    def _attach(self) -> None:
        if self._closed:
            raise StreamBroken("the container's attach was closed, or ended")
        response = self.api._post(
            self.api._url("/containers/{0}/attach", self.container),
            params={"stdin": 1, "stdout": 1, "stream": 1},
            headers={"Connection": "Upgrade", "Upgrade": "tcp"},
            stream=True,
        )
        try:
            self.api._raise_for_status(response)
            parsed = response.raw._fp  # as in ExecStream.pump: what came with the headers is in its reader
            sock = getattr(parsed.fp.raw, "_sock", None)
            if parsed.chunked or sock is None:
                raise StreamBroken("the engine's attach is not a raw stream")
            sock.setblocking(False)  # takes what the reader holds, without waiting for more
            try:
                frames = parsed.fp.peek(1 << 16)
            finally:
                sock.setblocking(True)  # from here on the socket itself is read, once select says so
        except BaseException:
            response.close()
            raise
        self._response, self._socket, self._frames, self._lines = response, sock, frames, b""

    def _ask(self, deadline: float) -> bool:
        """One request; True: ``swept``, False: ``left``."""
        self._asked += 1
        self._socket.sendall(b"%d\n" % self._asked)
        while True:
            answer = self._line(deadline)
            if answer in (b"swept %d" % self._asked, b"left %d" % self._asked):
                return answer.startswith(b"swept")
            # the late answer to an earlier request, which saw none in time: not this one's

    def _line(self, deadline: float) -> bytes:
        while b"\n" not in self._lines:
            self._lines += self._stdout(deadline)
        line, self._lines = self._lines.split(b"\n", 1)
        return line

    def _stdout(self, deadline: float) -> bytes:
        """The payload of the next stdout frame."""
        while True:
            if len(self._frames) >= FRAME_HEADER.size:
                stream, size = FRAME_HEADER.unpack_from(self._frames)
                end = FRAME_HEADER.size + size
                if len(self._frames) >= end:
                    payload, self._frames = self._frames[FRAME_HEADER.size : end], self._frames[end:]
                    if stream == STDOUT:
                        return payload
                    continue
            if not select.select([self._socket], [], [], max(deadline - time.monotonic(), 0))[0]:
                raise StreamBroken("the sweeper did not answer in time")
            data = self._socket.recv(1 << 16)
            if not data:
                self._drop()
                raise StreamBroken("the container's attach ended")
            self._frames += data

    def _drop(self) -> None:
        self._closed = True  # for good: the sweeper reads a stdin that ended with the attach
        if self._response is not None:
            self._response.close()
        self._response = self._socket = None


def _read_frames(reader, out: Capture, err: Capture) -> None:
    while True:
        header = reader.read(FRAME_HEADER.size)
        if not header:
            return  # the clean end: the connection closed between two frames
        if len(header) < FRAME_HEADER.size:
            raise StreamBroken(f"it ended inside a frame header ({len(header)} of {FRAME_HEADER.size} bytes)")
        stream, left = FRAME_HEADER.unpack(header)
        if stream not in (STDOUT, STDERR):
            raise StreamBroken(f"a frame of unknown stream {stream} (expected 1 = stdout or 2 = stderr)")
        capture = out if stream == STDOUT else err
        while left:
            piece = reader.read(min(left, _PIECE))
            if not piece:
                raise StreamBroken(f"it ended {left} bytes short of the end of a frame")
            capture.add(piece)
            left -= len(piece)
