"""The daemon's garbage collection (``kvstore.server.collector``), in a process of its own:
it changes the interpreter's collector, which the test runner's must not share."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import asyncio, gc, weakref

    from kvstore.server.collector import defer_full_passes, freeze_heap, full_passes

    class Node:
        pass

    def cyclic_garbage() -> weakref.ref:
        node = Node()
        node.me = node
        gc.collect(1)  # promoted to the oldest generation, where only full passes look
        gc.collect(1)
        return weakref.ref(node)

    freeze_heap()
    assert gc.get_freeze_count() > 0 and not gc.get_objects(generation=2)
    defer_full_passes()
    kept = cyclic_garbage()
    young = [[] for _ in range(200_000)]  # young collections by the hundred: none goes full
    assert kept() is not None, "a full pass ran before its time"

    async def one_pass() -> None:
        task = asyncio.create_task(full_passes(every_s=0.01))
        while kept() is not None:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(one_pass(), 10.0))
    print("ok")
    """
)


def test_full_passes_wait_for_the_timer_and_then_free_old_cycles() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
