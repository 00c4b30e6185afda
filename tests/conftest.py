"""Shared fixtures: real servers (session-scoped) and fresh object stores.

Helpers such as ``eventually`` live in ``tests/support.py``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from robustrl.config import Settings
from robustrl.infra.embedded import EmbeddedInfra
from robustrl.launcher.zygote import FORK_START_ENV
from robustrl.storage.objects import S3ObjectStore
from robustrl.storage.redis_stores import connect

# Members fork from one pre-imported zygote (robustrl.launcher.zygote) in every stack the suite
# starts: a cold start's 5.5 s of imports per member, several at once on 2 cores, was most of the
# suite's time. Cold starts stay covered: test_local_launcher (cold and forked), placed testbed
# members and vLLM members (always cold), the Docker and Ray launchers; the benchmarks run cold.
os.environ.setdefault(FORK_START_ENV, "1")


@pytest.fixture(scope="session")
def infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """NATS (JetStream), Redis-protocol and S3 servers for the whole session; yields their Settings."""
    embedded = EmbeddedInfra(tmp_path_factory.mktemp("infra"))
    try:
        yield embedded.start()
    finally:
        embedded.stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Servers of the test module's own: a service under test that reads every job's keys (a
    request manager resuming the registry's jobs, scanning every outbox) must not meet another
    module's jobs."""
    embedded = EmbeddedInfra(tmp_path_factory.mktemp("module-infra"))
    try:
        yield embedded.start()
    finally:
        embedded.stop()


@pytest.fixture
async def redis(infra: Settings) -> AsyncIterator[object]:
    """An asyncio Redis client on the session's server (closed after the test)."""
    client = connect(infra.redis_url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def object_store(infra: Settings) -> Iterator[S3ObjectStore]:
    """An S3 object store on the session's server, in a bucket of its own."""
    store = S3ObjectStore(infra.s3_endpoint, infra.s3_access_key, infra.s3_secret_key,
                          bucket=f"t-{uuid.uuid4().hex[:16]}", secure=infra.s3_secure)
    try:
        yield store
    finally:
        store.delete_prefix("")


@pytest.fixture(scope="session")
def stack(infra: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Controller, detector and request manager as real processes on the session's servers."""
    from robustrl.stack import Stack

    st = Stack(tmp_path_factory.mktemp("stack"), external=infra)
    st.start()
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture(scope="session")
def api(stack: object) -> Iterator[object]:
    from robustrl.client import ApiClient

    client = ApiClient(stack.api_url, stack.settings.api_token)  # type: ignore[attr-defined]
    try:
        yield client
    finally:
        client.close()


_PREBUILDING: list[object] = []
"""Modules whose ``start_prebuild`` was called (``abandon_prebuild`` at the session's end)."""


# Modules that use something of the machine's own, not the test's: the one dockerd data root
# (tests/docker_engine.py), Ray's fixed default ports, /run/robustrl-testbed and its sweeps, the
# network namespaces. Under pytest-xdist (scripts/test.sh runs three workers) they run one after
# another on one worker, as one group.
MACHINE_MODULES = frozenset({
    "test_compose_stack", "test_docker_engine_lock", "test_docker_standby", "test_docker_spares", "test_ray_launcher",
    "test_ray_testbed", "test_testbed",
    "test_testbed_gang", "test_testbed_heal", "test_testbed_job", "test_bench_testbed_fanout"})
DOCKER_MODULES = frozenset({"test_compose_stack", "test_docker_engine_lock", "test_docker_standby",
                            "test_docker_spares"})
"""The machine group's modules that run a dockerd: last in the group, after the compose image's
prebuild had the group's other modules' time to build."""
SLOW_FIRST = ("machine", "test_campaign", "test_recovery", "test_local_launcher", "test_cli",
              "test_controller_runtime", "test_standby_failover", "test_start_deadline", "test_standby_faults",
              "test_control_plane_faults", "test_rollout_replica", "test_rm_dispatch", "test_vllm_engine")
"""Groups handed out first, longest first (from ``--durations``): the last group to start should
be a short one, so that the workers end together. ``test_vllm_engine`` comes later than its
length alone would put it: ``scripts/test.sh`` sets up its environment beside the suite (about 2
minutes on a fresh machine, many more at low priority beside the tests), and its tests wait for
that (53 s when it came after ``test_recovery`` on two workers, 41 s in CI after ``test_cli``,
226 s on three workers after ``test_control_plane_faults``)."""


def group_of(nodeid: str) -> str:
    """The group a test runs in under pytest-xdist: its module's (a module's fixtures are set up
    once, on one worker), or ``machine`` for the modules in ``MACHINE_MODULES``."""
    module = nodeid.split("::", 1)[0]
    stem = module.rsplit("/", 1)[-1].removesuffix(".py")
    return "machine" if stem in MACHINE_MODULES else stem


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Whole groups (``group_of``) to a worker, in collection order. (xdist's own ``loadgroup``
    names a test's group by a suffix to its node id, which pytest 9.2's node ids no longer take.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the slow groups first. Every worker collects, and sorts, the same way
    (xdist checks that the collections match)."""
    if not _xdist_worker(config):
        return
    rank = {g: i for i, g in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: (rank.get(group_of(item.nodeid), len(rank)),  # stable: file order kept
                                 item.path.stem in DOCKER_MODULES))


def _xdist_worker(config: pytest.Config) -> str | None:
    return getattr(config, "workerinput", {}).get("workerid")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Modules that can begin slow preparation as the session starts, beside the other tests
    (``start_prebuild``: the compose stack's image); not for a session that runs no test."""
    opt = session.config.option
    if opt.collectonly or getattr(opt, "showfixtures", False) or getattr(opt, "show_fixtures_per_test", False) \
            or getattr(opt, "setupplan", False) or session.testsfailed:
        return
    if _xdist_worker(session.config):
        # Every worker collects every module: a prebuild on each would run two dockerds on one
        # data root. The worker that runs the machine group starts it (pytest_runtest_setup).
        return
    _start_prebuilds(session.items)


def _start_prebuilds(items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        start = getattr(module, "start_prebuild", None)
        if start is not None and module not in _PREBUILDING:
            _PREBUILDING.append(module)
            start()


_machine_group_begun = False


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under pytest-xdist, the prebuilds start with the first test of the machine group, on its
    worker: the group's other modules run while the image builds (the Docker modules come last
    in the group: ``pytest_collection_modifyitems``), and no other dockerd runs meanwhile."""
    global _machine_group_begun
    if _machine_group_begun or not _xdist_worker(item.config) or group_of(item.nodeid) != "machine":
        return
    _machine_group_begun = True
    if not item.session.testsfailed:
        _start_prebuilds(item.session.items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """A batch sampler a failed test left running (``support.sample_batches``) stops with it,
    before the fixtures it reads (its Redis server, its stack) are torn down."""
    from support import stop_samplers

    stop_samplers()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop what a prebuild left (an interrupted or failed session: its dockerd, its context)."""
    for module in _PREBUILDING:
        module.abandon_prebuild()  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Where each failure or error was, innermost frames last, next to the short summary: CI
    keeps only the end of the output, and a timeout's own traceback (where the main thread was
    stuck) is printed far above it, behind the other threads' stacks."""
    reports = [r for kind in ("failed", "error") for r in terminalreporter.stats.get(kind, [])]
    if not reports:
        return
    terminalreporter.section("where each failure was (innermost frames)")
    for report in reports:
        terminalreporter.line(f"{report.nodeid} ({report.when}):")
        entries = getattr(getattr(report.longrepr, "reprtraceback", None), "reprentries", [])
        for entry in entries[-8:]:
            loc = getattr(entry, "reprfileloc", None)
            if loc is not None:
                code = next((line[1:].strip() for line in getattr(entry, "lines", []) if line.startswith(">")), "")
                terminalreporter.line(f"    {loc.path}:{loc.lineno}: {code or loc.message}")
