"""A relay between the ``docker`` client and a real engine's API socket that changes only how the
engine's answers to ``exec start`` reach the client: as on a loaded machine (``hold``: the client
reads the answer only once the command's first output is there, so the answer's headers and that
output arrive in one piece, every time) or over a failing connection (``cut_after``: the connection
ends that many bytes into the output stream). Every byte it forwards is the engine's own."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

_HEAD_END = b"\r\n\r\n"


class EngineRelay:
    def __init__(self, engine_url: str, folder: Path, hold: bool = False, cut_after: int | None = None):
        self.engine_path = engine_url.removeprefix("unix://")
        self.path = folder / "relay.sock"
        self.url = f"unix://{self.path}"
        self.hold, self.cut_after = hold, cut_after
        self.exec_starts = 0  # exec start answers relayed
        self.together = 0  # of those, the ones whose headers and whole first output frame went in one piece
        self.cuts = 0  # of those, the ones cut short
        self._sockets: list[socket.socket] = []
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(str(self.path))
        self._listener.listen(64)
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept, which a close alone would not
        self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=5)
        for sock in self._sockets:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            engine = socket.socket(socket.AF_UNIX)
            engine.connect(self.engine_path)
            self._sockets += [client, engine]
            starting = threading.Event()  # this connection carries an exec start from now on
            for target in (self._to_engine, self._to_client):
                thread = threading.Thread(target=target, args=(client, engine, starting), daemon=True)
                self._threads.append(thread)
                thread.start()

    def _to_engine(self, client: socket.socket, engine: socket.socket, starting: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(1 << 16):
                if data.startswith(b"POST ") and b"/exec/" in data.split(b"\r\n", 1)[0] and b"/start " in data:
                    starting.set()  # requests on a connection go one at a time: what follows answers it
                engine.sendall(data)
            engine.shutdown(socket.SHUT_WR)

    def _to_client(self, client: socket.socket, engine: socket.socket, starting: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := engine.recv(1 << 16):
                if starting.is_set():
                    self._answer_exec_start(client, engine, data)
                    break
                client.sendall(data)
        for sock in (client, engine):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _answer_exec_start(self, client: socket.socket, engine: socket.socket, data: bytes) -> None:
        """Relay one exec start's answer: its headers, then the output stream to its end."""
        self.exec_starts += 1
        if self.hold:
            # a busy client: the command wrote before the answer was read. Held until the command's
            # first output frame is whole, not for a fixed while, which a loaded machine may outlast
            while not _output_in(data) and (more := engine.recv(1 << 16)):
                data += more
        if self.cut_after is not None:
            while (head := data.find(_HEAD_END)) < 0 or len(data) < head + len(_HEAD_END) + self.cut_after:
                if not (more := engine.recv(1 << 16)):
                    break  # the stream ended before the cut: nothing to cut
                data += more
            else:
                self.cuts += 1
                client.sendall(data[: head + len(_HEAD_END) + self.cut_after])
                return
        if _output_in(data):
            self.together += 1
        client.sendall(data)
        while data := engine.recv(1 << 16):
            client.sendall(data)


def _output_in(data: bytes) -> bool:
    """Whether ``data`` holds the answer's headers and, after them, a whole output frame (an 8-byte
    header whose last four bytes are the payload's length, and the payload)."""
    head = data.find(_HEAD_END)
    frames = data[head + len(_HEAD_END) :] if head >= 0 else b""
    return len(frames) >= 8 and len(frames) >= 8 + int.from_bytes(frames[4:8], "big")
