"""Work a weight push must not be cut off in the middle of."""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


async def run_to_end(work, what: str, orphaned=None):
    """Await `work` so that cancelling the caller (an RPC whose client went away, SIGTERM) does not cut it in
    the middle: it runs on, and `orphaned(result)` cleans up after it. Used for the staging write (cut, it
    would leave its file in /dev/shm) and for the commit (cut, it would leave engines paused with the new
    weights under the old version label; run to its end it is all-or-nothing as usual, and GetStatus shows
    the outcome)."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            log.warning("a weight push was cancelled during its %s; that runs to its end", what)

        def after(t: asyncio.Task) -> None:
            if t.cancelled():
                return
            if t.exception() is not None:
                log.warning("the cancelled push's %s failed: %s", what, t.exception())
            elif orphaned is not None:
                orphaned(t.result())
        task.add_done_callback(after)
        raise
