"""Fixtures shared by several test files."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from cluster import Cluster, ClusterUnavailable


@pytest.fixture
def two_hosts() -> Iterator[Cluster]:
    """Two network-namespace "hosts" (tests/cluster.py), torn down after the test; the
    test is skipped where there is no test bed (no root, no iproute2)."""
    try:
        with Cluster(2) as cluster:
            yield cluster
    except ClusterUnavailable as exc:
        pytest.skip(f"no multi-host test bed here: {exc}")


# ---- two tests at a time, and the ones that must run alone ------------------------
# The suite runs on two pytest-xdist workers (pyproject's addopts: -n 2): measured on the
# 2-core VM, the CPUs were idle 45% of a serial run (tests waiting on timeouts, restarts,
# start-up; a test process computing on one core), so two tests at a time fill them.
# A test marked `alone` holds the machine by itself: its verdict depends on timing that a
# neighbour's load would change (a 1-3 s hang timeout, a main thread's CPU share, a step
# timed against a period). A test marked `quiet` times such a wait too but computes
# little (a hang watchdog's tests sleep out their timeouts): it runs beside another
# `quiet` test, never beside a busy one (measured: the watchdog's tests, alone one after
# another, were 112 s of the run with a core idle). The others share the machine.
# Locks over every worker of the run (flock on files in the temp directory): a
# readers-writer lock that `alone` takes exclusively and every other test shares; a
# `busy-<worker>` file each worker holds exclusively while it runs a test that is
# neither, which a `quiet` test takes shared for every other worker (so it waits for
# their busy tests, and they for it); and a gate, taken while taking the others, so a
# waiting test is not starved.


LOCKS_ENV = "MESHFIT_TEST_LOCKS"  # the run's lock directory, made by the controller


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "alone: runs with no other test beside it under -n 2 (its verdict depends on timing)",
    )
    config.addinivalue_line(
        "markers",
        "quiet: runs beside other quiet tests only (it times a wait, and computes little)",
    )
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        # the xdist workers it starts inherit the variable
        os.environ[LOCKS_ENV] = tempfile.mkdtemp(prefix="meshfit-tests-")


def pytest_unconfigure(config) -> None:
    if not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop(LOCKS_ENV, ""), ignore_errors=True)


@contextlib.contextmanager
def _turn(kind: str) -> Iterator[None]:
    """This test's turn on the machine: `kind` is "alone", "quiet" or "busy" (above)."""
    locks = os.environ.get(LOCKS_ENV)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not locks or not worker:
        yield
        return
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    busy = {f"gw{i}": os.path.join(locks, f"busy-gw{i}") for i in range(count)}
    with contextlib.ExitStack() as held:
        gate = held.enter_context(open(os.path.join(locks, "gate"), "a"))
        lock = held.enter_context(open(os.path.join(locks, "lock"), "a"))
        if kind == "busy":
            taken = [(held.enter_context(open(busy[worker], "a")), fcntl.LOCK_EX)]
        elif kind == "quiet":
            others = [name for name in busy if name != worker]
            taken = [(held.enter_context(open(busy[name], "a")), fcntl.LOCK_SH) for name in others]
        else:
            taken = []
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if kind == "alone" else fcntl.LOCK_SH)
            for file, mode in taken:
                fcntl.flock(file, mode)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            for file, _ in taken:
                fcntl.flock(file, fcntl.LOCK_UN)
            fcntl.flock(lock, fcntl.LOCK_UN)


def _kind(item) -> str:  # noqa: ANN001 - a pytest item
    for kind in ("alone", "quiet"):
        if item.get_closest_marker(kind) is not None:
            return kind
    return "busy"


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001 - pytest's hook
    """The slow tests first, the everyday ones next, the `alone` ones, then the `quiet`
    ones last (each group in file order; pytest-xdist hands tests out in this order). An
    `alone` test waits for the test beside it to end before it starts: measured in the
    suite, 134 s of such waits (a 7.6 s test waited 60 s for a neighbour's 2-minute
    compile) while its worker idled. Last, the tests beside them are short everyday ones
    or other `alone` ones, and the `quiet` ones run two at a time."""
    order = {"slow": 0, "everyday": 1, "alone": 2, "quiet": 3}

    def group(item) -> int:  # noqa: ANN001
        kind = _kind(item)
        if kind != "busy":
            return order[kind]
        return order["slow" if item.get_closest_marker("slow") is not None else "everyday"]

    items.sort(key=group)  # stable: file order within each group


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ANN001, ANN201 - pytest's hook
    # around setup, call and teardown, so the wait is in no test's reported duration
    with _turn(_kind(item)):
        yield


# ---- the suite's budget ------------------------------------------------------------
# CI stops at 90 minutes and the suite must stay within 20 on the 2-core VM
# (DEVELOPERS.md): every run ends with the time of each tier, the ten slowest tests, and
# a warning naming them when the whole suite took over BUDGET_WARNING_S (time on these
# machines is noisy, so a warning, not a failure).
BUDGET_WARNING_S = 30 * 60
_session: dict[str, float] = {}


def pytest_sessionstart(session) -> None:
    import time

    _session["start"] = time.monotonic()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    import time

    wall = time.monotonic() - _session.get("start", time.monotonic())
    tests: dict[str, list] = {}  # nodeid -> [seconds, slow]
    for reports in terminalreporter.stats.values():
        for report in reports:
            duration = getattr(report, "duration", None)
            nodeid = getattr(report, "nodeid", None)
            if duration is None or not nodeid or not hasattr(report, "keywords"):
                continue
            entry = tests.setdefault(nodeid, [0.0, "slow" in report.keywords])
            entry[0] += duration
    if not tests:
        return
    tiers = {"everyday (-m 'not slow')": [0.0, 0], "slow": [0.0, 0]}
    for seconds, slow in tests.values():
        tier = tiers["slow" if slow else "everyday (-m 'not slow')"]
        tier[0] += seconds
        tier[1] += 1
    write = terminalreporter.write_line
    write("")
    side_by_side = getattr(config.option, "numprocesses", None) or 0  # pytest-xdist's -n
    summed = f" (test durations summed; {side_by_side} at a time)" if side_by_side > 1 else ""
    write(
        f"suite time by tier{summed}: "
        + "; ".join(f"{name} {_minutes(s)} over {n} tests" for name, (s, n) in tiers.items())
        + f"; the whole run {_minutes(wall)} (DEVELOPERS.md has the budget)"
    )
    slowest = sorted(tests.items(), key=lambda item: -item[1][0])[:10]
    write("ten slowest: " + "; ".join(f"{_minutes(s)} {nodeid}" for nodeid, (s, _) in slowest))
    if wall > BUDGET_WARNING_S:
        write(
            f"WARNING: the suite took {_minutes(wall)}, over its {BUDGET_WARNING_S // 60}-minute "
            f"warning line (budget: 20 minutes on the 2-core VM; CI stops at 90): make the "
            f"slowest cheaper (one launch of workers for several runs, tiny configs)",
            yellow=True,
            bold=True,
        )


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s"
