"""The operator dashboard: a store's fleet at a glance, over HTTP (the ``dashboard`` extra).

    asyncplane dashboard fleet.db --port 8080 [--allow-actions] [--actor ID]

or from Python, on the event loop the store lives on::

    dashboard = Dashboard(store, allow_actions=True)
    url = await dashboard.start("127.0.0.1", 0)   # port 0: a free one
    ...
    await dashboard.stop()

Pages: the overview (counts by state and project, throughput and queue depth over the
last hour, the oldest ready item, the failure rate), running items (owner, fence, time
running, lease left; lapsed leases highlighted), failures grouped by error, one item
(payload, result, error, its ledger, and the ledger check's verdict on it), and projects
(status, limits, schedules). They update live every 2 seconds. ``/api/stats`` and
``/metrics`` (Prometheus text) serve scripts and scrapers. See docs/dashboard.md.
"""

from __future__ import annotations

from asyncplane import _errors

try:
    import aiohttp  # noqa: F401
    import jinja2  # noqa: F401
    import prometheus_client  # noqa: F401
except ImportError:
    raise _errors.MissingExtra(
        "the dashboard needs the dashboard extra: pip install 'asyncplane[dashboard]'"
    ) from None

from asyncplane.dashboard._server import Dashboard

__all__ = ("Dashboard",)
