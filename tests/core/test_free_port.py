"""``free_port``: a port another process binds seconds later (a process group's store, a server),
so it must not come from the range the kernel hands every outgoing connection and every bind to
port 0, where any process could take it in between (EADDRINUSE at the store's start)."""

from __future__ import annotations

import socket

import pytest

from loongsage.core import placement
from loongsage.core.placement import EXPLICIT_PORTS_FROM, free_port


def test_ports_come_from_between_rays_workers_and_the_ephemeral_range() -> None:
    start = placement._ephemeral_start()
    for _ in range(20):
        port = free_port()
        assert EXPLICIT_PORTS_FROM <= port < start
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free when returned


def test_a_port_in_use_is_passed_over(monkeypatch) -> None:
    with socket.socket() as held, socket.socket() as spare:
        held.bind(("127.0.0.1", 0))
        held.listen()
        spare.bind(("127.0.0.1", 0))
        taken, free = held.getsockname()[1], spare.getsockname()[1]
        spare.close()
        monkeypatch.setattr(placement, "_ephemeral_start", lambda: 65536)
        draws = iter([taken, taken, free])

        class Draws:
            def choice(self, window: range) -> int:
                return next(draws)

        monkeypatch.setattr(placement.random, "SystemRandom", Draws)
        assert free_port() == free


@pytest.mark.parametrize("start", [EXPLICIT_PORTS_FROM, 1024])
def test_with_no_room_below_the_ephemeral_range_any_free_port_is_taken(monkeypatch, start: int) -> None:
    monkeypatch.setattr(placement, "_ephemeral_start", lambda: start)
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
