"""Bad input gets a clear, typed error before anything is written."""

from __future__ import annotations

import json
import math
import sqlite3
from typing import Any

import pytest

from asyncplane import (
    AsyncplaneError,
    ControlStore,
    InvalidInput,
    InvalidPayload,
    InvalidType,
    ProjectExists,
    _models,
)


def counts(raw: sqlite3.Connection) -> tuple[int, int, int]:
    return (
        raw.execute("SELECT count(*) FROM items").fetchone()[0],
        raw.execute("SELECT count(*) FROM events").fetchone()[0],
        raw.execute("SELECT count(*) FROM projects").fetchone()[0],
    )


BAD_PAYLOADS: list[tuple[Any, str]] = [
    ([1, 2], "JSON object"),
    ("text", "JSON object"),
    (None, "JSON object"),
    ({"x": float("nan")}, "NaN"),
    ({"x": math.inf}, "NaN and infinity"),
    ({"x": [1, {"y": -math.inf}]}, "infinity"),
    ({"x": object()}, "not a JSON value"),
    ({"x": {1, 2}}, "set"),
    ({"x": (1, 2)}, "tuple"),
    ({"x": b"bytes"}, "bytes"),
    ({1: "int key"}, "key of type int"),
    ({"x": {"y": {None: 1}}}, "key of type NoneType"),
]


@pytest.mark.parametrize(("payload", "message"), BAD_PAYLOADS)
async def test_bad_payloads_are_refused_before_writing(
    store: ControlStore, raw: sqlite3.Connection, payload: Any, message: str
) -> None:
    before = counts(raw)
    with pytest.raises(InvalidPayload, match=message) as caught:
        await store.enqueue("alpha", payload)
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, AsyncplaneError)
    assert counts(raw) == before


async def test_deeply_nested_payload_is_refused(store: ControlStore) -> None:
    payload: dict[str, Any] = {}
    inner = payload
    for _ in range(5000):
        inner["x"] = {}
        inner = inner["x"]
    with pytest.raises(InvalidPayload, match="nested more than 100 levels"):
        await store.enqueue("alpha", payload)


async def test_payload_size_limit_is_configurable(
    asyncplane_store_factory: Any, raw: sqlite3.Connection
) -> None:
    small = await asyncplane_store_factory(max_payload_bytes=100)
    await small.create_project("p", "P")
    await small.enqueue("p", {"x": "a" * 80})
    before = counts(raw)
    with pytest.raises(InvalidPayload, match="more than the limit of 100 bytes"):
        await small.enqueue("p", {"x": "a" * 100})
    assert counts(raw) == before


async def test_default_payload_limit_is_one_mebibyte(store: ControlStore) -> None:
    await store.enqueue("alpha", {"x": "a" * (1024 * 1024 - 20)})
    with pytest.raises(InvalidPayload):
        await store.enqueue("alpha", {"x": "a" * (1024 * 1024)})


async def test_payload_round_trips_unicode_and_nesting(store: ControlStore) -> None:
    payload = {"task": "résumé ✓ 中文", "n": [1, 2.5, True, None, {"deep": ["x"]}]}
    item_id = await store.enqueue("alpha", payload)
    assert (await store.item(item_id))["payload"] == payload
    claim = await store.claim(owner="w")
    assert claim is not None and claim.payload == payload


@pytest.mark.parametrize("bad", [1.5, "7", None, True, b"7"])
async def test_item_ids_must_be_ints(store: ControlStore, bad: Any) -> None:
    with pytest.raises(InvalidType, match="item_id must be an int") as caught:
        await store.item(bad)
    assert isinstance(caught.value, TypeError)
    with pytest.raises(InvalidType):
        await store.finish(bad, fence=1)
    with pytest.raises(InvalidType):
        await store.events(bad)


@pytest.mark.parametrize("bad", [0, -3])
async def test_item_ids_must_be_positive(store: ControlStore, bad: int) -> None:
    with pytest.raises(InvalidInput, match="must be positive"):
        await store.item(bad)


@pytest.mark.parametrize("bad", [1, None, b"alpha", ("alpha",)])
async def test_project_ids_must_be_strings(store: ControlStore, bad: Any) -> None:
    with pytest.raises(InvalidType, match="project_id must be a str"):
        await store.enqueue(bad, {})
    with pytest.raises(InvalidType):
        await store.create_project(bad, "name")


@pytest.mark.parametrize("bad", ["", "   ", "x" * 257, "tab\there", "nul\x00"])
async def test_bad_text_ids_are_refused(
    store: ControlStore, raw: sqlite3.Connection, bad: str
) -> None:
    before = counts(raw)
    with pytest.raises(InvalidInput):
        await store.create_project(bad, "name")
    with pytest.raises(InvalidInput):
        await store.enqueue("alpha", {}, actor_id=bad)
    with pytest.raises(InvalidInput):
        await store.claim(owner=bad)
    assert counts(raw) == before


async def test_empty_owner_is_refused(store: ControlStore) -> None:
    await store.enqueue("alpha", {})
    with pytest.raises(InvalidInput, match="owner must not be empty"):
        await store.claim(owner="")
    claim = await store.claim(owner="w")  # nothing was claimed by the refused call
    assert claim is not None and claim.fence == 1


async def test_unknown_finish_status_is_refused_and_the_claim_stays(
    store: ControlStore,
) -> None:
    await store.enqueue("alpha", {})
    claim = await store.claim(owner="w")
    assert claim is not None
    for status in ("finished", "DONE", "ready", ""):
        with pytest.raises(InvalidInput, match="unknown status"):
            await store.finish(claim.item_id, fence=claim.fence, status=status)
    with pytest.raises(InvalidType):
        await store.finish(claim.item_id, fence=claim.fence, status=None)  # type: ignore[arg-type]
    assert (await store.item(claim.item_id))["state"] == "claimed"
    await store.finish(claim.item_id, fence=claim.fence, status="done")


@pytest.mark.parametrize("bad", [0, -1])
async def test_fences_must_be_positive_ints(store: ControlStore, bad: int) -> None:
    item_id = await store.enqueue("alpha", {})
    with pytest.raises(InvalidInput):
        await store.finish(item_id, fence=bad)
    with pytest.raises(InvalidType):
        await store.renew(item_id, fence="1")  # type: ignore[arg-type]


async def test_unknown_project_status_is_refused(store: ControlStore) -> None:
    with pytest.raises(InvalidInput, match="unknown project status"):
        await store.create_project("beta", "Beta", status="maybe")
    with pytest.raises(InvalidInput):
        await store.set_project_status("alpha", "gone")
    assert [p["project_id"] for p in await store.projects()] == ["alpha"]


async def test_duplicate_project_is_refused(store: ControlStore) -> None:
    with pytest.raises(ProjectExists):
        await store.create_project("alpha", "Again")
    assert (await store.project("alpha"))["name"] == "Project Alpha"


@pytest.mark.parametrize("bad", [0, -5, math.nan, math.inf, "900", True])
def test_bad_lease_seconds_are_refused(tmp_path: Any, bad: Any) -> None:
    with pytest.raises((InvalidInput, InvalidType)):
        ControlStore(tmp_path / "x.db", lease_seconds=bad)


async def test_lease_override_must_be_valid(store: ControlStore) -> None:
    with pytest.raises(InvalidInput):
        await store.claim(owner="w", lease_seconds=-1)


def test_constructor_refuses_bad_options(tmp_path: Any) -> None:
    with pytest.raises(InvalidInput):
        ControlStore(tmp_path / "x.db", synchronous="OFF")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        ControlStore(":memory:")
    with pytest.raises(InvalidType):
        ControlStore(42)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        ControlStore(tmp_path / "x.db", max_payload_bytes=0)
    with pytest.raises(InvalidInput, match="at least a byte"):  # it came to 0: every append rotated
        ControlStore(tmp_path / "x.db", archive_max_mb=1e-9)
    assert ControlStore(tmp_path / "x.db", archive_max_mb=1 / 1024 / 1024) is not None


def test_construction_does_no_io(tmp_path: Any) -> None:
    ControlStore(tmp_path / "never.db")
    assert list(tmp_path.iterdir()) == []


async def test_sql_is_parameterised(store: ControlStore) -> None:
    hostile = "alpha'; DROP TABLE items; --"
    await store.create_project(hostile, "Robert')")
    item_id = await store.enqueue(hostile, {"q": "' OR 1=1 --"})
    assert (await store.item(item_id))["project_id"] == hostile
    assert [p["project_id"] for p in await store.projects()] == ["alpha", hostile]


async def test_nul_characters_are_refused_in_names_and_errors(store: ControlStore) -> None:
    # PostgreSQL text cannot hold NUL; both backends refuse it, before writing anything.
    with pytest.raises(InvalidInput, match="NUL"):
        await store.create_project("nul", "bad\x00name")
    item_id = await store.enqueue("alpha", {"text": "a NUL inside JSON is fine: \x00"})
    claim = await store.claim("w")
    assert claim is not None and claim.payload == {"text": "a NUL inside JSON is fine: \x00"}
    with pytest.raises(InvalidInput, match="NUL"):
        await store.finish(item_id, fence=claim.fence, status="failed", error="bad\x00error")
    with pytest.raises(InvalidInput, match="NUL"):
        await store.retry(item_id, fence=claim.fence, error="bad\x00error")
    assert (await store.item(item_id))["state"] == "claimed"
    assert [p["project_id"] for p in await store.projects()] == ["alpha"]


@pytest.mark.parametrize(
    "text",
    [
        '{"n": 1, "task": "x"}',
        '[1, 2.5, null, true, "\\u00e9"]',
        '"text"',
        "7",
        ' {"n": 1} ',  # whitespace around the value: json.loads's own path
        b'{"n": 2}',  # bytes
        '{"n": 1}x',  # trailing text
        '{"n": }',
        "",
        "\ufeff{}",  # a byte-order mark
        "NaN",
    ],
)
def test_stored_json_decodes_as_json_loads_decodes_it(text: str | bytes) -> None:
    # The claim's path reads payloads through _models.loads, which calls json.loads's
    # scanner directly: values and errors must be json.loads's own.
    def outcome(decode: Any) -> tuple[str, str]:
        try:
            return "value", json.dumps(decode(text))
        except ValueError as exc:
            return type(exc).__name__, str(exc)

    assert outcome(_models.loads) == outcome(json.loads)


def test_stored_json_nested_too_deep_is_a_recursion_error() -> None:
    with pytest.raises(RecursionError):
        _models.loads("[" * 100_000)
