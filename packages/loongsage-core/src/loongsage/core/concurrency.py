"""Running coroutines together so that none outlives the call that started them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def gather_all(*awaitables: Awaitable[Any]) -> list[Any]:
    """Their results, in order, like :func:`asyncio.gather`; but on a failure or a cancellation
    the others are cancelled and **every one has ended before this raises**.

    ``asyncio.gather`` raises as soon as the first of them fails or ends cancelled, while the rest
    may still be running their cleanup (an episode giving its sandbox back, say), so whoever
    cancelled a group would go on before its episodes let go of what they hold. A second
    cancellation during that wait is held back and raised once they have all ended."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException as first:
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            if not task.cancelling():  # once is enough: a second one would cut its cleanup short
                task.cancel()
        cancelled_again = False
        while pending:
            try:
                await asyncio.wait(pending)  # waiting is cancellable, the tasks are not cancelled by it
            except asyncio.CancelledError:
                cancelled_again = True
            pending = [t for t in pending if not t.done()]
        if cancelled_again and not isinstance(first, asyncio.CancelledError):
            raise asyncio.CancelledError() from first
        raise
