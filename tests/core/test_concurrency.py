"""``gather_all``: a cancelled or failed group returns only once every member has ended."""

import asyncio

import pytest

from loongsage.core.concurrency import gather_all


class Holder:
    """Holds something until cancelled, then takes ``cleanup_s`` to give it back (shielded, as an
    episode releasing its sandbox does). Events, not timings, say where it is."""

    def __init__(self, ended: list[str], name: str, cleanup_s: float):
        self.ended, self.name, self.cleanup_s = ended, name, cleanup_s
        self.started, self.cleaning = asyncio.Event(), asyncio.Event()

    async def run(self) -> str:
        self.started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            self.cleaning.set()
            await asyncio.shield(asyncio.sleep(self.cleanup_s))
            self.ended.append(self.name)
        return self.name


async def _fails(after: asyncio.Event) -> None:
    await after.wait()
    raise ValueError("bad episode")


def test_results_come_in_order():
    async def value(x: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return x

    assert asyncio.run(gather_all(value(1, 0.02), value(2, 0.0), value(3, 0.01))) == [1, 2, 3]


def test_a_cancelled_group_returns_after_every_member_cleaned_up():
    async def go():
        ended: list[str] = []
        fast, slow = Holder(ended, "fast", 0.0), Holder(ended, "slow", 0.2)
        group = asyncio.ensure_future(gather_all(fast.run(), slow.run()))
        await asyncio.gather(fast.started.wait(), slow.started.wait())
        group.cancel()
        with pytest.raises(asyncio.CancelledError):
            await group
        return list(ended)  # now: asyncio.run would let what is left end before returning

    # plain asyncio.gather raises once "fast" is done, with "slow" still giving back what it holds
    assert sorted(asyncio.run(go())) == ["fast", "slow"]


def test_a_failure_cancels_the_others_and_waits_for_them():
    async def go():
        ended: list[str] = []
        a, b = Holder(ended, "a", 0.1), Holder(ended, "b", 0.0)
        both = asyncio.ensure_future(asyncio.gather(a.started.wait(), b.started.wait()))
        with pytest.raises(ValueError, match="bad episode"):
            await gather_all(a.run(), _fails(asyncio_event_of(both)), b.run())
        return list(ended)

    assert sorted(asyncio.run(go())) == ["a", "b"]


def test_a_second_cancellation_during_the_wait_still_waits_and_ends_cancelled():
    async def go():
        ended: list[str] = []
        slow = Holder(ended, "slow", 0.3)
        group = asyncio.ensure_future(gather_all(slow.run(), _fails(slow.started)))
        # the failure is in: "slow" was cancelled and gives back what it holds
        await asyncio.wait_for(slow.cleaning.wait(), 10)
        group.cancel()
        with pytest.raises(asyncio.CancelledError):
            await group
        return list(ended)

    assert asyncio.run(go()) == ["slow"]


def asyncio_event_of(future: asyncio.Future) -> asyncio.Event:
    """An event set once ``future`` is done."""
    event = asyncio.Event()
    future.add_done_callback(lambda _: event.set())
    return event
