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
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
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
