"""``asyncplane dashboard``: serve a store's dashboard until a signal says stop.

    asyncplane dashboard DB|URL [--host 127.0.0.1] [--port 8080] [--allow-actions]
                         [--actor ID] [--token TOKEN]

Without ``--allow-actions`` the store is opened read-only (nothing can be written through
the dashboard, whatever it is sent). Off loopback a token is required: ``--token``, or
``$ASYNCPLANE_DASHBOARD_TOKEN`` (off the process list), or one is made and printed. Once
it serves, it prints ``listening on http://HOST:PORT`` on stdout (``--port 0`` picks a
free port). SIGINT, SIGTERM or SIGHUP stops it: requests in progress are answered first
(each within the dashboard's ``answer_within``), and the store is closed. A second signal,
or a stop not done within `STOP_SECONDS` (a server that stopped answering holds its
connections' closing up), ends the process at once: the dashboard holds no claim, and
what an action wrote stands or not as a whole.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from asyncplane import _errors, _loops, _validate
from asyncplane._store import ControlStore
from asyncplane.dashboard._server import Dashboard, check_address, checked_token

__all__ = ("TOKEN_VARIABLE", "check", "run")

#: The signals that stop the command (SIGHUP: its terminal closed).
_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name)
)
_HANGUP = getattr(signal, "SIGHUP", None)
#: Seconds a stop may take before the process ends at once.
STOP_SECONDS = 30.0
_log = logging.getLogger("asyncplane.dashboard")

#: Where the command finds its token when ``--token`` does not give one: an environment
#: is its process's owner's to read, a command line everyone's (``ps``).
TOKEN_VARIABLE = "ASYNCPLANE_DASHBOARD_TOKEN"


def check(args: argparse.Namespace) -> None:
    """`InvalidInput` for an option no dashboard could take (a short token, an empty
    actor or host, a port out of range): a usage error, found before the store opens.
    A token not given by ``--token`` is taken from `TOKEN_VARIABLE` here."""
    if args.token is None and TOKEN_VARIABLE in os.environ:
        given = os.environ[TOKEN_VARIABLE]
        if given != given.strip() or len(given) < 16:  # empty too: a secret not filled in
            raise _errors.InvalidInput(
                f"${TOKEN_VARIABLE} holds {len(given)} characters"
                f"{', with a space or a newline at an end' if given != given.strip() else ''}"
                ": a dashboard's token is at least 16, with none at either end"
            )
        args.token = given
    checked_token(args.token)
    _validate.optional_actor(args.actor)
    check_address(args.host, args.port)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; the exit status."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("asyncplane")
    root.addHandler(handler)
    root.setLevel(args.log_level.upper())
    return _loops.run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    store = ControlStore(args.db, read_only=not args.allow_actions)
    dashboard = Dashboard(
        store, actor_id=args.actor, allow_actions=args.allow_actions, token=args.token
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    heard = 0

    def stopping() -> None:
        nonlocal heard
        heard += 1
        if heard == 1:
            _log.info("stopping")
            stop.set()
            late = f"not stopped {STOP_SECONDS:g} s after the first signal"
            loop.call_later(STOP_SECONDS, _stop_now, late)
        else:
            _stop_now("a second signal")

    # (SIGHUP ignored when it started, under nohup, stays so.)
    taken = [s for s in _SIGNALS if not (s == _HANGUP and signal.getsignal(s) == signal.SIG_IGN)]
    for sig in taken:
        loop.add_signal_handler(sig, stopping)
    try:
        try:
            url = await dashboard.start(args.host, args.port)
        except OSError as exc:  # the port taken, the host unknown: the command line's
            raise _errors.InvalidInput(
                f"cannot serve on --host {args.host} --port {args.port}: {exc.strerror or exc}"
            ) from exc
        if dashboard.token is not None and args.token is None:
            print(f"token: {dashboard.token}", flush=True)
            print(f"open: {url}/?token={dashboard.token}", flush=True)
        print(f"listening on {url}", flush=True)
        await stop.wait()
    finally:
        await dashboard.stop()
        await store.close()
        for sig in taken:
            loop.remove_signal_handler(sig)
    return 0


def _stop_now(why: str) -> None:
    _log.error("stopped at once (%s)", why)
    logging.shutdown()  # the line above reaches its handler first
    os._exit(1)
