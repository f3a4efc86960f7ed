"""Shared fixtures: every test works on a real SQLite file under tmp_path.

The store fixtures come from asyncplane's own pytest plugin (``asyncplane_store``,
``asyncplane_clock``, ``asyncplane_store_factory``); the short names below are aliases.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import pytest

from asyncplane import ControlStore
from asyncplane.testing import ManualClock


@pytest.fixture
def clock(asyncplane_clock: ManualClock) -> ManualClock:
    return asyncplane_clock


@pytest.fixture
async def store(asyncplane_store: ControlStore) -> ControlStore:
    await asyncplane_store.create_project("alpha", "Project Alpha")
    return asyncplane_store


@pytest.fixture
def raw(asyncplane_store: ControlStore) -> Iterator[sqlite3.Connection]:
    """A plain sqlite3 connection to the store's file, for tampering behind its back."""
    conn = sqlite3.connect(asyncplane_store.path, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()
