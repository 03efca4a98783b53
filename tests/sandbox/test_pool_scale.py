"""The sandbox pool with 1,000 leases churned and cancelled: the real pool over the real ``local``
backend, every lease a real jail running a real command (``tests/sandbox/pool_churn.py``).

All leases call ``acquire`` at once against a pool of ``CAP`` sandboxes (4 kept warm, reuse on);
each runs ``echo`` of its own name and a ``sleep`` of ``COMMAND_S``, then releases; a quarter are
cancelled before their acquire, while it waits or makes their sandbox, during their command, or
during their release. Asserted: every lease not cancelled gets its own output back, nothing is
left (processes, mounts, directories), the pool's tables are empty again, room went out first come
first served, no lease waited longer than the work queued ahead of it allows (Graham's bound, see
``Churn.wait_bound_excess``), and neither the pool's count nor the sandbox directories on disk ever
passed the cap.

Why 16 sandboxes: a lease costs about 6.5 ms of CPU (4 ms in this process, 2.5 ms in its jail's
processes), so with 0.2 s commands 16 sandboxes turn over about 73 leases/s on half a core: the
cap, not the two cores of the test machine, sets the pace, which is what the wait bound is about.
At 64 the same commands would need the whole machine.

``LOONGSAGE_POOL_SCALE_LEASES`` sets the number of leases (1,000), ``LOONGSAGE_POOL_SCALE_SEED``
the random seed of the cancellations (0).
"""

from __future__ import annotations

import asyncio
import os

from loongsage.sandbox.local import LocalSandbox
from loongsage.sandbox.pool import SandboxPool
from tests.sandbox.conftest import SMALL, leftovers, needs_jail, owner
from tests.sandbox.pool_churn import STAGES, churn

pytestmark = needs_jail
LEASES = int(os.environ.get("LOONGSAGE_POOL_SCALE_LEASES", "1000"))
SEED = int(os.environ.get("LOONGSAGE_POOL_SCALE_SEED", "0"))
CAP, WARM, COMMAND_S = 16, 4, 0.2
SLACK_S = 0.25  # sandbox-time the leases do not show: the warm set's first creations, background deletes


def test_a_thousand_leases_churned_and_cancelled(root):
    result = asyncio.run(churn(root, SMALL, leases=LEASES, cap=CAP, warm=WARM, command_s=COMMAND_S, seed=SEED))
    summary = result.summary()
    print("pool scale", summary)

    errors = [(lease.rank, lease.error) for lease in result.leases if lease.error]
    assert errors == [], errors[:5]
    unfinished = [lease.rank for lease in result.leases if lease.landed is None and lease.released is None]
    assert unfinished == [], unfinished[:10]  # every lease not cancelled ran to its release
    assert set(summary["cancelled_in"]) == set(STAGES), summary  # cancellations landed at every stage
    assert summary["completed"] + summary["cancelled"] == LEASES

    assert result.overtaken() == 0, summary  # room went out in the order the acquires came
    over = result.wait_bound_excess(SLACK_S)
    assert over == [], over[:5]  # (rank, waited s, bound s): no lease waited past the work ahead of it

    assert result.samples > 100 and result.max_live <= CAP and result.max_dirs <= CAP, summary

    idle = result.tables_after_leases.pop("idle")
    assert 0 <= idle <= WARM and not any(result.tables_after_leases.values()), result.tables_after_leases
    assert not any(result.tables_after_close.values()), result.tables_after_close
    assert result.backend_after_close == 0
    left = leftovers(root)
    assert not any(left.values()), left  # again in the root fixture, after a grace period


def test_a_late_acquire_does_not_overtake_a_waiting_one(root):
    """One sandbox: ``b`` waits for it; ``c`` comes while ``a``'s is being deleted (the room is
    not free yet) and must queue behind ``b``. Two acquires of one owner get one sandbox."""

    async def go():
        sb = LocalSandbox(SMALL, str(root))
        pool = SandboxPool(sb, run="run-test", max_sandboxes=1, reuse=False)
        await pool.start()
        try:
            await pool.acquire(owner("a"))
            b = asyncio.ensure_future(pool.acquire(owner("b")))
            b_again = asyncio.ensure_future(pool.acquire(owner("b")))  # the same owner: waits for b's
            await asyncio.sleep(0.05)
            assert not b.done() and pool.waiting == 1
            releasing = asyncio.ensure_future(pool.release(owner("a")))
            c = asyncio.ensure_future(pool.acquire(owner("c")))  # arrives while a's sandbox still exists
            done, _ = await asyncio.wait({b, c}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            assert done == {b} and await b_again == b.result() and len(sb.sandbox_ids()) == 1
            await releasing
            await pool.release(owner("b"))
            assert await asyncio.wait_for(c, 10) != b.result()
            assert pool.waiting == 0 and pool.live == 1
        finally:
            await pool.close()
            await sb.close()

    asyncio.run(go())
