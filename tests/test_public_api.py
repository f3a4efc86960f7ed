"""The public surface: what ``import asyncplane`` offers, and nothing by accident."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import typing

import asyncplane
from asyncplane import AsyncplaneError


def test_all_is_a_tuple_of_real_names() -> None:
    assert isinstance(asyncplane.__all__, tuple)
    assert len(set(asyncplane.__all__)) == len(asyncplane.__all__)
    for name in asyncplane.__all__:
        assert hasattr(asyncplane, name), name


def test_the_contract_names_are_exported() -> None:
    contract = {
        "ControlStore",
        "ClaimedItem",
        "LedgerProblem",
        "verify_ledger",
        "AsyncplaneError",
        "FenceRejected",
        "ScopeDenied",
        "UnknownProject",
        "UnknownItem",
        "ItemPurged",
    }
    assert contract <= set(asyncplane.__all__)


def test_every_public_object_is_exported() -> None:
    # dir(), not vars(): the runtimes' names load on first use (asyncplane.__getattr__).
    public = {
        name
        for name in dir(asyncplane)
        if not name.startswith("_") and not inspect.ismodule(getattr(asyncplane, name))
    }
    assert public == set(asyncplane.__all__) - {"__version__"}


def test_exported_objects_present_themselves_as_asyncplane() -> None:
    for name in asyncplane.__all__:
        value = getattr(asyncplane, name)
        # (A type alias such as Handler is no class, though Python 3.10 says it is one.)
        alias = typing.get_origin(value) is not None
        if (inspect.isclass(value) and not alias) or inspect.isfunction(value):
            assert value.__module__ == "asyncplane", name


def test_errors_share_one_root_and_say_what_they_mean() -> None:
    errors = [
        getattr(asyncplane, name)
        for name in asyncplane.__all__
        if inspect.isclass(getattr(asyncplane, name))
        and issubclass(getattr(asyncplane, name), BaseException)
    ]
    assert len(errors) >= 12
    for error in errors:
        assert issubclass(error, AsyncplaneError), error
        assert error.__doc__ and len(error.__doc__.strip()) > 20, error
    assert issubclass(asyncplane.UnknownProject, LookupError)
    assert issubclass(asyncplane.UnknownItem, LookupError)
    assert issubclass(asyncplane.InvalidInput, ValueError)
    assert issubclass(asyncplane.InvalidType, TypeError)


def test_private_modules_are_private_and_typed() -> None:
    package = pathlib.Path(asyncplane.__file__).parent
    assert (package / "py.typed").exists()
    public_modules = {"__init__", "testing", "pytest_plugin", "probe", "cli"}
    for module in package.glob("*.py"):
        assert module.stem in public_modules or module.stem.startswith("_"), module.name
        importlib.import_module(
            f"asyncplane.{module.stem}" if module.stem != "__init__" else "asyncplane"
        )


def test_runtime_dependencies_are_only_aiosqlite_and_anyio() -> None:
    from importlib.metadata import requires

    runtime = [r for r in requires("asyncplane") or [] if "extra ==" not in r]
    assert sorted(r.split(">")[0].split("=")[0].strip() for r in runtime) == ["aiosqlite", "anyio"]


def test_errors_pickle_intact() -> None:
    import pickle

    error = asyncplane.FenceRejected(7, 1, current_fence=2, state="claimed")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is asyncplane.FenceRejected
    assert (copy.item_id, copy.fence, copy.current_fence, copy.state) == (7, 1, 2, "claimed")
    assert str(copy) == str(error)
    denied = pickle.loads(pickle.dumps(asyncplane.ScopeDenied("no")))
    assert type(denied) is asyncplane.ScopeDenied


def test_the_dashboard_package_exports_its_one_name() -> None:
    from asyncplane import dashboard

    assert dashboard.__all__ == ("Dashboard",)
    package = pathlib.Path(dashboard.__file__).parent
    for module in package.glob("*.py"):
        assert module.stem == "__init__" or module.stem.startswith("_"), module.name
    assert (package / "templates" / "base.html").exists()
    assert (package / "static" / "dashboard.js").exists()


def test_the_extras_name_what_each_optional_feature_imports() -> None:
    from importlib.metadata import requires

    extras: dict[str, set[str]] = {}
    for requirement in requires("asyncplane") or []:
        if "extra ==" in requirement:
            name = requirement.split(">")[0].split("=")[0].split(";")[0].strip()
            extra = requirement.split("extra ==")[1].strip().strip("\"'")
            extras.setdefault(extra, set()).add(name)
    assert extras["otel"] == {"opentelemetry-api"}
    assert extras["dashboard"] == {"aiohttp", "jinja2", "prometheus-client", "cronsim", "tzdata"}


def test_no_bounded_wait_can_swallow_a_cancellation() -> None:
    # asyncio.wait_for before Python 3.12 returns the result when a cancellation comes as
    # the work ends, and the caller never hears of it: asyncplane's bounded waits go
    # through _tasks.within instead (a stop cancelling a task as it sets its event did).
    package = pathlib.Path(asyncplane.__file__).parent
    calls = [
        f"{path.relative_to(package)}:{number}"
        for path in sorted(package.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "asyncio.wait_for(" in line and not line.lstrip().startswith("#")
    ]
    assert calls == []
