"""Scope belongs to the store: with actor_id, only the actor's projects exist for it."""

from __future__ import annotations

import pytest

from asyncplane import (
    AsyncplaneError,
    ControlStore,
    FenceRejected,
    ScopeDenied,
    UnknownItem,
    UnknownProject,
)


@pytest.fixture
async def scoped(store: ControlStore) -> ControlStore:
    await store.create_project("beta", "Project Beta")
    await store.assign("alpha", "specialist-a")
    return store


async def test_visible_projects_lists_only_assignments(scoped: ControlStore) -> None:
    assert await scoped.visible_projects("specialist-a") == ["alpha"]
    assert await scoped.visible_projects("nobody") == []
    await scoped.assign("beta", "specialist-a")
    await scoped.assign("beta", "specialist-a")  # idempotent
    assert await scoped.visible_projects("specialist-a") == ["alpha", "beta"]
    await scoped.unassign("alpha", "specialist-a")
    await scoped.unassign("alpha", "specialist-a")  # idempotent
    assert await scoped.visible_projects("specialist-a") == ["beta"]


async def test_assign_to_an_unknown_project_raises(scoped: ControlStore) -> None:
    with pytest.raises(UnknownProject):
        await scoped.assign("gamma", "specialist-a")
    with pytest.raises(UnknownProject):
        await scoped.unassign("gamma", "specialist-a")


async def test_control_plane_may_enqueue_anywhere_but_not_into_nothing(
    scoped: ControlStore,
) -> None:
    assert await scoped.enqueue("beta", {"task": "not yours"}) > 0
    with pytest.raises(UnknownProject) as caught:
        await scoped.enqueue("gamma", {})
    assert isinstance(caught.value, LookupError)
    assert isinstance(caught.value, AsyncplaneError)


async def test_actor_enqueues_only_into_its_projects(scoped: ControlStore) -> None:
    own = await scoped.enqueue("alpha", {}, actor_id="specialist-a")
    assert (await scoped.item(own))["project_id"] == "alpha"
    assert (await scoped.events(own))[0]["actor_id"] == "specialist-a"
    with pytest.raises(ScopeDenied):
        await scoped.enqueue("beta", {}, actor_id="specialist-a")


async def test_denial_does_not_tell_absent_from_not_yours(scoped: ControlStore) -> None:
    with pytest.raises(ScopeDenied) as not_yours:
        await scoped.enqueue("beta", {}, actor_id="specialist-a")
    with pytest.raises(ScopeDenied) as absent:
        await scoped.enqueue("does-not-exist", {}, actor_id="specialist-a")
    # The same exception type and the same words, with only the id asked about changed.
    assert str(not_yours.value).replace("beta", "X") == str(absent.value).replace(
        "does-not-exist", "X"
    )


async def test_actor_claims_only_from_its_projects(scoped: ControlStore) -> None:
    await scoped.enqueue("beta", {"task": "not yours"})
    assert await scoped.claim(owner="specialist-a", actor_id="specialist-a") is None
    mine = await scoped.enqueue("alpha", {"task": "yours"})
    claim = await scoped.claim(owner="specialist-a", actor_id="specialist-a")
    assert claim is not None and claim.item_id == mine
    events = await scoped.events(mine)
    assert events[-1]["actor_id"] == "specialist-a"


async def test_unassigned_actor_loses_access_at_once(scoped: ControlStore) -> None:
    item_id = await scoped.enqueue("alpha", {})
    claim = await scoped.claim(owner="specialist-a", actor_id="specialist-a")
    assert claim is not None
    await scoped.unassign("alpha", "specialist-a")
    with pytest.raises(ScopeDenied):
        await scoped.renew(item_id, fence=claim.fence, actor_id="specialist-a")
    with pytest.raises(ScopeDenied):
        await scoped.finish(item_id, fence=claim.fence, actor_id="specialist-a")
    with pytest.raises(ScopeDenied):
        await scoped.item(item_id, actor_id="specialist-a")
    # The control plane still sees the claim intact: the denial wrote nothing.
    assert (await scoped.item(item_id))["state"] == "claimed"


async def test_item_and_events_raise_rather_than_answer_empty(scoped: ControlStore) -> None:
    theirs = await scoped.enqueue("beta", {})
    missing = theirs + 1000
    denials = []
    for item_id in (theirs, missing):
        with pytest.raises(ScopeDenied) as on_item:
            await scoped.item(item_id, actor_id="specialist-a")
        with pytest.raises(ScopeDenied) as on_events:
            await scoped.events(item_id, actor_id="specialist-a")
        denials.append(
            (
                str(on_item.value).replace(str(item_id), "N"),
                str(on_events.value).replace(str(item_id), "N"),
            )
        )
    assert denials[0] == denials[1]


async def test_renew_and_finish_outside_scope_are_denied_not_fenced(scoped: ControlStore) -> None:
    theirs = await scoped.enqueue("beta", {})
    claim = await scoped.claim(owner="w")
    assert claim is not None and claim.item_id == theirs
    with pytest.raises(ScopeDenied):
        await scoped.renew(theirs, fence=claim.fence, actor_id="specialist-a")
    with pytest.raises(ScopeDenied):
        await scoped.finish(theirs, fence=claim.fence, actor_id="specialist-a")
    with pytest.raises(ScopeDenied):  # absent: the same error, not UnknownItem
        await scoped.finish(theirs + 99, fence=1, actor_id="specialist-a")
    await scoped.finish(theirs, fence=claim.fence)


async def test_actor_in_scope_still_meets_the_fence(scoped: ControlStore) -> None:
    item_id = await scoped.enqueue("alpha", {})
    with pytest.raises(FenceRejected):
        await scoped.finish(item_id, fence=1, actor_id="specialist-a")


async def test_control_plane_gets_unknown_item_for_absent_ids(scoped: ControlStore) -> None:
    for call in (
        scoped.item(424242),
        scoped.events(424242),
        scoped.renew(424242, fence=1),
        scoped.finish(424242, fence=1),
    ):
        with pytest.raises(UnknownItem) as caught:
            await call
        assert isinstance(caught.value, LookupError)


async def test_item_ids_are_not_secrets(scoped: ControlStore) -> None:
    # Ids are sequential and visible; scope, not obscurity, is what protects an item.
    first = await scoped.enqueue("beta", {})
    second = await scoped.enqueue("alpha", {})
    assert second == first + 1
