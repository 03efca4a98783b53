"""``gather_all``: a cancelled or failed group returns only once every member has ended."""

import asyncio

import pytest

from loongsage.core.concurrency import gather_all


async def _holder(ended: list[str], name: str, cleanup_s: float) -> str:
    """Holds something until cancelled, then takes ``cleanup_s`` to give it back (shielded, as
    an episode releasing its sandbox does)."""
    try:
        await asyncio.sleep(3600)
    finally:
        await asyncio.shield(asyncio.sleep(cleanup_s))
        ended.append(name)
    return name


def test_results_come_in_order():
    async def value(x: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return x

    assert asyncio.run(gather_all(value(1, 0.02), value(2, 0.0), value(3, 0.01))) == [1, 2, 3]


def test_a_cancelled_group_returns_after_every_member_cleaned_up():
    async def go():
        ended: list[str] = []
        group = asyncio.ensure_future(gather_all(_holder(ended, "fast", 0.0), _holder(ended, "slow", 0.2)))
        await asyncio.sleep(0.05)
        group.cancel()
        with pytest.raises(asyncio.CancelledError):
            await group
        return ended

    # plain asyncio.gather raises once "fast" is done, with "slow" still giving back what it holds
    assert sorted(asyncio.run(go())) == ["fast", "slow"]


def test_a_failure_cancels_the_others_and_waits_for_them():
    async def go():
        ended: list[str] = []

        async def fails():
            await asyncio.sleep(0.02)
            raise ValueError("bad episode")

        with pytest.raises(ValueError, match="bad episode"):
            await gather_all(_holder(ended, "a", 0.1), fails(), _holder(ended, "b", 0.0))
        return ended

    assert sorted(asyncio.run(go())) == ["a", "b"]


def test_a_second_cancellation_during_the_wait_still_waits_and_ends_cancelled():
    async def go():
        ended: list[str] = []

        async def fails():
            await asyncio.sleep(0.02)
            raise ValueError("bad episode")

        group = asyncio.ensure_future(gather_all(_holder(ended, "slow", 0.3), fails()))
        await asyncio.sleep(0.1)  # the failure is in, "slow" is cleaning up
        group.cancel()
        with pytest.raises(asyncio.CancelledError):
            await group
        return ended

    assert asyncio.run(go()) == ["slow"]
