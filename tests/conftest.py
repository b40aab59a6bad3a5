"""Shared pytest fixtures: private Redis / PostgreSQL / RabbitMQ servers.

Session-scoped servers (started lazily, only when a test asks for them):

* ``redis_server``    -- ``RedisServer``, AOF on, ``appendfsync always``
* ``redis_sentinel``  -- ``SentinelDeployment``: master, 2 replicas, 3 sentinels
* ``redis_cluster``   -- ``ClusterDeployment``: 3 masters, 3 replicas
* ``pg_server``       -- ``PostgresServer``, a private cluster
* ``rabbitmq_server`` -- ``RabbitMQServer``, a private node

Per-test / per-module handles on them:

* ``redis_url``  (function) -- ``redis://127.0.0.1:PORT/N``, a database
  number of its own, emptied before the test
* ``pg_url``     (module)   -- ``postgresql+psycopg://...`` for a fresh
  database ``test_<module>_<rand>`` created for the test module
* ``sqlite_url`` (function) -- ``sqlite:////<tmp_path>/lease.sqlite3``
* ``sentinel_url`` / ``cluster_url`` (function) -- the shared deployments,
  emptied (``master_name``: ``tests.redis_ha.SENTINEL_MASTER``)

Tests that stop, kill or pause a server must not do it to the shared
session servers; they take their own from ``make_redis_server`` /
``make_pg_server`` (function-scoped factories, torn down after the test).

Tests marked ``@pytest.mark.slow`` (soak, chaos, benchmarks) are skipped
unless pytest runs with ``--slow`` (or ``CELERY_LEASE_SLOW=1``). Those also
marked ``ci`` (the CI-sized chaos runs, the quick benchmark pass, the short
soaks, and every install into a fresh virtualenv, marked ``packaging``) are
the long runs ``.ci/run`` runs after the default suite, ``scripts/test
--slow -m ci``: the default suite keeps its 15-minute budget.
"""

from __future__ import annotations

import itertools
import os
import re
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from tests.redis_ha import SENTINEL_MASTER, ClusterDeployment, SentinelDeployment
from tests.servers import (
    PostgresServer,
    RabbitMQServer,
    RedisServer,
    iter_live_servers,
)
from tests.workers import STARTED, error_lines

# pytester: tests/contract/test_servers.py checks the --slow switch. The celery-lease
# plugin is a pytest11 entry point once installed; named here too for a
# checkout whose installed metadata predates it (same name: loaded once).
pytest_plugins = ("pytester", "celery_lease.testing.pytest_plugin")

# --------------------------------------------------------------------------
# options and markers
# --------------------------------------------------------------------------

MARKERS = {
    "slow": "soak / chaos / benchmark test; skipped unless --slow is given",
    "ci": "a long run .ci/run runs after the default suite (--slow -m ci); always also slow",
    "redis": "needs the private Redis server",
    "postgres": "needs the private PostgreSQL cluster",
    "rabbitmq": "needs the private RabbitMQ node",
    "etcd": "needs a private etcd cluster (tests/etcd_cluster.py)",
    "packaging": "installs the package into a fresh virtualenv (deselect: -m 'not packaging')",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("celery-lease")
    group.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="also run tests marked 'slow' (soak, chaos, benchmarks); same as CELERY_LEASE_SLOW=1",
    )
    group.addoption(
        "--model-deep",
        action="store_true",
        default=False,
        help="tests/model: check the protocol model with the deep bounds (minutes per "
        "configuration) instead of the default ones",
    )


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    config.pluginmanager.register(LongTests(LONG_TEST_S), "celery-lease-long-tests")


#: A default-suite test whose call takes longer than this (seconds) is named at
#: the end of the run: one such test is a fifteenth of one pytest worker's
#: share of the default suite's 15 minutes (the chaos runs that kept the suite
#: over them took 150 s each). The longest left in it took 35 s.
LONG_TEST_S = 60.0


class LongTests:
    """Names the tests not marked slow whose call took over :data:`LONG_TEST_S`,
    so that one joining the default suite is seen in the run that added it
    (not in a budget found broken later). A report, not a failure: how long a
    test takes on a shared machine is no property of the code."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.found: list[tuple[float, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" and report.duration > self.budget:
            if "slow" not in report.keywords:
                self.found.append((report.duration, report.nodeid))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.found:
            return
        terminalreporter.section("default-suite tests over the per-test budget")
        for seconds, nodeid in sorted(self.found, reverse=True):
            terminalreporter.write_line(
                f"{seconds:.0f} s {nodeid}: over {self.budget:.0f} s; if it is a chaos, "
                "benchmark or soak run, mark it slow and ci (.ci/run's long runs)"
            )


def _slow_enabled(config: pytest.Config) -> bool:
    return bool(config.getoption("--slow")) or os.environ.get("CELERY_LEASE_SLOW", "") not in (
        "",
        "0",
    )


#: tests using one of these fixtures get the marker automatically, so that
#: e.g. ``-m "not rabbitmq"`` deselects everything needing RabbitMQ
_FIXTURE_MARKERS = {
    "redis_server": "redis",
    "redis_url": "redis",
    "make_redis_server": "redis",
    "redis_sentinel": "redis",
    "sentinel_url": "redis",
    "redis_cluster": "redis",
    "cluster_url": "redis",
    "pg_server": "postgres",
    "pg_url": "postgres",
    "make_pg_server": "postgres",
    "rabbitmq_server": "rabbitmq",
    "amqp_url": "rabbitmq",
    "installed_venv": "packaging",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = _slow_enabled(config)
    skip_slow = pytest.mark.skip(reason="slow test: run with --slow (or CELERY_LEASE_SLOW=1)")
    skip_ci = pytest.mark.skip(reason="a long run of .ci/run's: scripts/test --slow -m ci")
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        for marker in sorted({_FIXTURE_MARKERS[f] for f in fixtures if f in _FIXTURE_MARKERS}):
            if item.get_closest_marker(marker) is None:
                item.add_marker(marker)
        if item.get_closest_marker("ci") is not None and item.get_closest_marker("slow") is None:
            # A ci test outside slow would run twice in .ci/run (and count against
            # the default suite's budget): say so at collection, not in a timing.
            raise pytest.UsageError(f"{item.nodeid}: marked 'ci' but not 'slow'")
        if (
            item.get_closest_marker("packaging") is not None
            and item.get_closest_marker("ci") is None
        ):
            # A fresh virtualenv costs a pip install (half a minute of CPU on two
            # cores, more with extras). Installs add up one test at a time, and a
            # suite's total time never says which test took it over its budget:
            # the marker is checked here instead.
            raise pytest.UsageError(
                f"{item.nodeid}: installs the package (marked 'packaging') but is not a "
                "long run: mark it slow and ci"
            )
        if not run_slow and item.get_closest_marker("slow") is not None:
            item.add_marker(skip_ci if item.get_closest_marker("ci") is not None else skip_slow)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    STARTED.clear()  # before the fixtures, which may start workers


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """On a failed test, list the running test servers and their logs, and the
    errors the test's workers logged (CI's output is often all there is)."""
    report = yield
    if report.failed:
        live = [f"{server!r}\n    log: {server.log_path}" for server in iter_live_servers()]
        if live:
            report.sections.append(("test servers", "\n".join(live)))
        logged = []
        for worker in dict.fromkeys(STARTED):
            errors = error_lines(worker.log_path)
            logged.append(f"{worker.name}: {worker.log_path}")
            logged += [f"    {line}" for line in errors or ["(no ERROR or CRITICAL line)"]]
        if logged:
            report.sections.append(("test workers", "\n".join(logged)))
    return report


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def _missing_binary(exc: FileNotFoundError) -> None:
    """Fail on CI, skip on a developer machine without the server installed."""
    message = f"{exc} (scripts/test installs it when run as root)"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def spin_tools() -> None:
    """spin and gcc, which tests/model needs to check the protocol model."""
    from tests.model.spin import tools

    missing = tools()
    if missing:
        _missing_binary(FileNotFoundError(f"{' and '.join(missing)} not found on PATH"))


@pytest.fixture(scope="session")
def servers_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory holding data and logs of the session's private servers."""
    return tmp_path_factory.mktemp("servers")


# --------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_server(servers_tmpdir: Path) -> Iterator[RedisServer]:
    """Private Redis (AOF on, appendfsync always), shared by the session."""
    try:
        server = RedisServer(servers_tmpdir, appendonly=True, appendfsync="always")
    except FileNotFoundError as exc:
        _missing_binary(exc)
        raise
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


_redis_db_numbers = itertools.cycle(range(1, RedisServer.databases))


@pytest.fixture
def fresh_redis(redis_server: RedisServer) -> Callable[[], str]:
    """Hands out URLs of the shared server's databases (1..63, rotating), each
    emptied first. A test never names a database number of its own: one another
    test used as a broker may still hold that test's messages, which a new
    worker would run before the test's own."""
    redis_server.ensure_running()

    def fresh() -> str:
        db = next(_redis_db_numbers)
        redis_server.flushdb(db)
        return redis_server.url(db)

    return fresh


@pytest.fixture
def redis_url(fresh_redis: Callable[[], str]) -> str:
    """URL of a Redis database (1..63, rotating) emptied for this test."""
    return fresh_redis()


@pytest.fixture(scope="session")
def redis_sentinel(servers_tmpdir: Path) -> Iterator[SentinelDeployment]:
    """One master, two replicas, three sentinels (tests/redis_ha.py), shared by the
    session: tests must not kill its nodes (they make their own deployment)."""
    deployment = SentinelDeployment(servers_tmpdir, master_name=SENTINEL_MASTER)
    try:
        yield deployment.start()
    finally:
        deployment.stop()


_sentinel_db_numbers = itertools.cycle(range(1, RedisServer.databases))


@pytest.fixture
def sentinel_url(redis_sentinel: SentinelDeployment) -> str:
    """``sentinel://...;.../N`` of the shared deployment: a database of its own, emptied."""
    db = next(_sentinel_db_numbers)
    redis_sentinel.master().flushdb(db)
    return redis_sentinel.url(db)


@pytest.fixture(scope="session")
def redis_cluster(servers_tmpdir: Path) -> Iterator[ClusterDeployment]:
    """Three masters, three replicas (tests/redis_ha.py), shared by the session."""
    deployment = ClusterDeployment(servers_tmpdir)
    try:
        yield deployment.start()
    finally:
        deployment.stop()


@pytest.fixture
def cluster_url(redis_cluster: ClusterDeployment) -> str:
    """``redis+cluster://...`` of the shared cluster, every master emptied."""
    redis_cluster.flush()
    return redis_cluster.url()


@pytest.fixture
def make_redis_server(
    tmp_path: Path,
) -> Iterator[Callable[..., RedisServer]]:
    """Factory for private Redis servers the test may stop/kill/pause at will.

    ``make_redis_server(appendonly=True, appendfsync="always", **kw)`` returns
    a *started* server; all are killed after the test.
    """
    made: list[RedisServer] = []

    def make(
        appendonly: bool = True,
        appendfsync: Literal["always", "everysec", "no"] = "always",
        **kwargs: Any,
    ) -> RedisServer:
        try:
            server = RedisServer(tmp_path, appendonly=appendonly, appendfsync=appendfsync, **kwargs)
        except FileNotFoundError as exc:
            _missing_binary(exc)
            raise
        made.append(server)
        server.start()
        return server

    yield make
    for server in made:
        server.cleanup()


# --------------------------------------------------------------------------
# PostgreSQL
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_server(servers_tmpdir: Path) -> Iterator[PostgresServer]:
    """Private PostgreSQL cluster shared by the session."""
    try:
        server = PostgresServer(servers_tmpdir)
    except FileNotFoundError as exc:
        _missing_binary(exc)
        raise
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


def _database_name(module_name: str) -> str:
    base = module_name.rsplit(".", 1)[-1].lower()
    base = re.sub(r"^test_", "", base)
    base = re.sub(r"[^a-z0-9_]+", "_", base).strip("_") or "module"
    return f"test_{base[:40]}_{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def pg_url(pg_server: PostgresServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """SQLAlchemy URL of a fresh database for this test module."""
    pg_server.ensure_running()
    name = _database_name(request.module.__name__)
    url = pg_server.create_database(name)
    yield url
    if pg_server.running:
        try:
            pg_server.drop_database(name)
        except Exception as exc:  # noqa: BLE001 - cleanup must not fail the run
            print(f"could not drop test database {name}: {exc}")


@pytest.fixture
def make_pg_server(tmp_path: Path) -> Iterator[Callable[..., PostgresServer]]:
    """Factory for private PostgreSQL clusters the test may stop/kill at will.

    ``make_pg_server(**kw)`` returns a *started* cluster; all are killed and
    removed after the test.
    """
    made: list[PostgresServer] = []

    def make(**kwargs: Any) -> PostgresServer:
        try:
            server = PostgresServer(tmp_path, **kwargs)
        except FileNotFoundError as exc:
            _missing_binary(exc)
            raise
        made.append(server)
        server.start()
        return server

    yield make
    for server in made:
        server.cleanup()


# --------------------------------------------------------------------------
# SQLite
# --------------------------------------------------------------------------


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """SQLAlchemy URL of a SQLite file in the test's own tmp_path."""
    return f"sqlite:///{tmp_path / 'lease.sqlite3'}"


# --------------------------------------------------------------------------
# RabbitMQ
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def rabbitmq_server(servers_tmpdir: Path) -> Iterator[RabbitMQServer]:
    """Private RabbitMQ node shared by the session (about 6 s to start)."""
    try:
        server = RabbitMQServer(servers_tmpdir)
    except FileNotFoundError as exc:
        _missing_binary(exc)
        raise
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def amqp_url(rabbitmq_server: RabbitMQServer) -> str:
    """``amqp://guest:guest@127.0.0.1:PORT//`` of the private RabbitMQ node."""
    rabbitmq_server.ensure_running()
    return rabbitmq_server.url()


# ---------------------------------------------------------------------------
# the package as a user installs it


@pytest.fixture(scope="session")
def installed_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with the package installed non-editable (``pip install .``).

    Built once per session from a copy of the source tree, so the wheel's
    contents (migrations included) are what the tests see, never the checkout.
    """
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    base = tmp_path_factory.mktemp("installed")
    src = base / "src"
    shutil.copytree(
        root,
        src,
        ignore=shutil.ignore_patterns(
            ".venv",
            ".git",
            "*.egg-info",
            "__pycache__",
            ".*_cache",
            "build",
            "dist",
            ".example-data",
            "tests",
        ),
    )
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [
        str(venv / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
    ]
    result = subprocess.run(
        [*pip, f"{src}[redis,postgres]"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    shutil.rmtree(src)  # nothing may be imported from the copy
    return venv
