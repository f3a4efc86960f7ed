"""The two examples from asyncplane's origin, with ``await`` added, run exactly as written.

The first is a minimal round trip: a project, an item, one claim, one finish, a clean
ledger. The second shows that scope belongs to the store: an actor sees only the projects
assigned to it, and the store itself refuses the rest.

Run it with ``python examples/quickstart.py``; it works in a fresh temporary directory,
removed again when it ends.
"""

import asyncio
import os
import tempfile

from asyncplane import ControlStore, FenceRejected, ScopeDenied, verify_ledger


async def main() -> None:
    # --- a minimal round trip -------------------------------------------------------------
    store = ControlStore("control.db", lease_seconds=900)
    await store.create_project("alpha", "Project Alpha", status="open")
    item_id = await store.enqueue("alpha", {"task": "summarise the report"})

    claim = await store.claim(owner="worker-1")      # a ClaimedItem, or None if nothing is available
    assert claim is not None and claim.item_id == item_id
    assert await store.claim(owner="worker-2") is None   # it already belongs to worker-1

    try:
        ...  # do the work
        await store.finish(claim.item_id, fence=claim.fence, status="done")   # or "failed"
    except FenceRejected:
        ...  # the claim was taken over while this worker was away: discard its result

    assert [e["event_type"] for e in await store.events(item_id)] == ["queued", "claimed", "done"]
    assert await verify_ledger(store) == []

    # --- scope belongs to the store, not the caller ----------------------------------------
    await store.create_project("beta", "Project Beta", status="open")
    await store.assign("alpha", "specialist-a")
    await store.enqueue("beta", {"task": "not yours"})            # the control plane itself may enqueue into any existing project

    assert await store.visible_projects("specialist-a") == ["alpha"]
    assert await store.claim(owner="specialist-a", actor_id="specialist-a") is None

    try:
        await store.enqueue("beta", {}, actor_id="specialist-a")
    except ScopeDenied:
        ...  # refused by the store itself, whatever the caller's UI shows
    else:
        raise AssertionError("the store let specialist-a enqueue into beta")

    await store.close()
    print("quickstart: round trip and scope examples passed; ledger clean")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="asyncplane-quickstart-") as workdir:
        os.chdir(workdir)
        try:
            asyncio.run(main())
        finally:
            os.chdir(os.path.dirname(workdir))  # a directory can go only once left
