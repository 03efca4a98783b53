"""WorkerGroup over real Ray actors: calls in rank order, per-rank arguments, kill, replace."""

from __future__ import annotations

import asyncio
import time

import pytest

from loongsage.core.worker_group import Slot, WorkerGroup, per_rank, wait_ready


def _member_class():
    """Defined in a function so that Ray ships the class itself (workers cannot import this test module)."""

    class Member:
        def __init__(self, rank: int, tag: str, slow_start_marker: str | None = None):
            import os
            import uuid

            if slow_start_marker and os.path.exists(slow_start_marker):
                time.sleep(60)  # a replacement that does not start in time
            self.rank, self.tag, self.uid = rank, tag, uuid.uuid4().hex

        def who(self) -> tuple[int, str, str]:
            return self.rank, self.tag, self.uid

        def echo(self, x, scale: int = 1, delay: float = 0.0) -> tuple[int, object]:
            time.sleep(delay)
            return self.rank, x * scale

        def resources(self) -> dict[str, float]:
            import ray

            return ray.get_runtime_context().get_assigned_resources()

    return Member


def _dies(ray, actor, within_s: float = 30.0) -> bool:
    """Whether ``actor``'s calls fail within ``within_s`` (ray.kill is asynchronous: a call made just
    after it may still be answered)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.who.remote(), timeout=within_s)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.1)
    return False


def _start(n: int, marker: str | None = None, options: list[dict] | None = None) -> WorkerGroup:
    slots = [Slot(None, (options or [{}] * n)[r] or {"num_cpus": 0}, (r, f"m{r}", marker)) for r in range(n)]
    group = WorkerGroup.start("member", _member_class(), slots, ready="who")
    wait_ready([group])
    return group


def test_calls_return_in_rank_order_with_shared_and_per_rank_arguments(ray_session) -> None:
    ray = ray_session
    group = _start(3)
    try:
        assert len(group) == 3 and [w[:2] for w in group.call("who")] == [(0, "m0"), (1, "m1"), (2, "m2")]
        # rank 0 answers last, and still comes first
        assert group.call("echo", 2, delay=per_rank([0.3, 0.1, 0.0])) == [(0, 2), (1, 2), (2, 2)]
        assert group.call("echo", per_rank(["a", "b", "c"]), scale=per_rank([1, 2, 3])) == [
            (0, "a"),
            (1, "bb"),
            (2, "ccc"),
        ]
        # some ranks, in the order given; per-rank values follow that order
        assert group.call("echo", per_rank([10, 20]), ranks=[2, 0]) == [(2, 10), (0, 20)]
        assert group.call("echo", per_rank([]), ranks=[]) == []
        with pytest.raises(ValueError, match="member.echo: 2 per-rank values for 3 ranks"):
            group.call_async("echo", per_rank([1, 2]))
        # the async form: one ObjectRef per rank, for ray.get or for an event loop
        refs = group.call_async("echo", per_rank([1, 2, 3]), delay=per_rank([0.2, 0.0, 0.1]))
        assert ray.get(refs) == [(0, 1), (1, 2), (2, 3)]

        async def awaited():
            return await asyncio.gather(*group.call_async("echo", 5))

        assert asyncio.run(awaited()) == [(0, 5), (1, 5), (2, 5)]
    finally:
        group.kill()


def test_kill_ends_every_member(ray_session) -> None:
    ray = ray_session
    group = _start(2)
    group.call("who")
    group.kill()
    assert all(_dies(ray, actor) for actor in group.actors)
    group.kill()  # nothing left: a second kill does nothing


def test_replace_starts_the_member_again_from_its_slot(ray_session) -> None:
    ray = ray_session
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"CPU": 0.5}, {"CPU": 0.5}])
    ray.get(pg.ready(), timeout=60)
    options = [
        {
            "num_cpus": 0.25,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=b),
        }
        for b in range(2)
    ]
    group = _start(2, options=options)
    try:
        before = group.call("who")
        placed = group.call("resources")
        old = group.actors[1]

        new = group.replace(1, timeout_s=60)
        assert group.actors[1] is new and group.actors[0] is not old
        rank, tag, uid = group.call("who")[1]
        assert (rank, tag) == (1, "m1") and uid != before[1][2]  # same arguments, a new actor
        assert group.call("resources") == placed  # in the same bundle
        assert group.call("who")[0] == before[0]  # the others untouched
        assert _dies(ray, old)

        # install=False: the caller swaps it in itself; the group still owns it
        spare = group.replace(0, install=False, timeout_s=60)
        assert group.actors[0] is not spare
        assert ray.get(spare.who.remote())[:2] == (0, "m0")
    finally:
        group.kill()
        remove_placement_group(pg)
    assert _dies(ray, spare)


def test_a_replacement_that_does_not_start_in_time_is_killed(ray_session, tmp_path) -> None:
    marker = tmp_path / "slow"
    group = _start(1, marker=str(marker))
    try:
        marker.write_text("")  # from now on the member's constructor hangs
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"member 0: its replacement did not start within 1 s"):
            group.replace(0, timeout_s=1)
        assert time.monotonic() - t0 < 30
        assert group._owned == []  # the lost member and the hung replacement are both gone
    finally:
        group.kill()


def test_only_is_the_single_member_or_none() -> None:
    assert WorkerGroup("critic", []).only() is None and not WorkerGroup("critic", [])
    assert WorkerGroup("reward", ["r"]).only() == "r"
    with pytest.raises(ValueError, match="trainer: 2 actors, not one"):
        WorkerGroup("trainer", ["a", "b"]).only()
    with pytest.raises(RuntimeError, match="not started from slots"):
        WorkerGroup("engine", ["e"]).replace(0)
