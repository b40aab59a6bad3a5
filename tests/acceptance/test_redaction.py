"""A planted password is in no output of any failure path (issue 17, must-show 3).

The secret ``s3cr3t-planted`` is planted in every form a secret reaches
celery-lease: a URL's user info (``user:s3cr3t-planted@``), its query
(``?password=s3cr3t-planted``), for Redis, PostgreSQL and etcd store URLs and
a PostgreSQL result URL, and client options (``{"password": ...}``). Then every
failure path runs for real and each captured output is searched for it:

* the store's and its errors' ``repr``/``str`` and formatted tracebacks;
* the CLI (``lease list`` / ``show`` / ``migrate`` subprocesses) with the
  store or result database unreachable;
* a worker refusing a bad setting at start (its whole log);
* a worker whose store is down: its log, and the ``LEASE_DEFERRED`` event's
  fields as an event receiver reads them from the broker.

A TLS key file is named by path (the key is in the file, never read by
celery-lease), so a path is shown where it is wrong, as any file path.
"""

from __future__ import annotations

import json
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import celery_lease
from celery_lease import LeaseConfigError, LeaseStore, StoreUnavailable
from celery_lease.redaction import MASK, redact
from tests.event_capture import EventCapture
from tests.sec_cluster import Cluster
from tests.servers import RedisServer, free_port, wait_for

pytestmark = pytest.mark.timeout(240)

SECRET = "s3cr3t-planted"


def planted_urls(port: int) -> dict[str, str]:
    """Store URLs of an unreachable server, each carrying the secret."""
    return {
        "redis-userinfo": f"redis://user:{SECRET}@127.0.0.1:{port}/0",
        "redis-query": f"redis://127.0.0.1:{port}/0?password={SECRET}",
        "pg-userinfo": f"postgresql+psycopg://user:{SECRET}@127.0.0.1:{port}/db",
        "pg-query": f"postgresql+psycopg://user@127.0.0.1:{port}/db?password={SECRET}",
    }


def assert_clean(what: str, text: str) -> None:
    assert SECRET not in text, f"{what} shows the planted secret:\n{text[-3000:]}"


# -- the redaction itself, as a property ---------------------------------------

#: Characters a password may hold in a URL's user info (urllib splits at the last '@').
_USERINFO_PW = st.text(
    st.characters(whitelist_categories=("L", "N", "P", "S"), blacklist_characters="'\"`\\"),
    min_size=1,
    max_size=20,
)
_QUERY_PW = st.text(st.sampled_from("abcdefXYZ0123456789._~-+!*%"), min_size=1, max_size=20)


@settings(max_examples=300, deadline=None)
@given(
    scheme=st.sampled_from(["redis", "rediss", "postgresql+psycopg", "postgresql", "etcds"]),
    user=st.sampled_from(["", "alice", "svc_user"]),
    pw=_USERINFO_PW,
    qpw=_QUERY_PW,
    around=st.sampled_from(["{}", "failed: {} (retrying)", "({!r})", "url={}", "'{}'"]),
)
def test_redact_masks_every_password_form_and_keeps_the_rest(
    scheme: str, user: str, pw: str, qpw: str, around: str
) -> None:
    pw, qpw = "PW" + pw, "QP" + qpw  # never a part of the rest of the URL
    for url, secrets in (
        (f"{scheme}://{user}:{pw}@db.example:5432/x", (pw,)),
        (f"{scheme}://{user}@db.example:5432/x?sslmode=require&password={qpw}", (qpw,)),
        (f"{scheme}://{user}:{pw}@db.example/x?password={qpw}", (pw, qpw)),
    ):
        shown = redact(around.format(url))
        for secret in secrets:
            assert secret not in shown, (url, shown)
        assert MASK in shown and "db.example" in shown, shown
    plain = f"{scheme}://{user}@db.example:5432/x"
    assert redact(plain) == plain, "a URL with no password is shown whole"


def test_a_url_with_a_user_and_no_password_keeps_its_user() -> None:
    """It was shown as ``postgresql+psycopg:***@host``: the user and ``//`` gone."""
    url = "postgresql+psycopg://user@127.0.0.1:5432/db?password=pw"
    assert redact(url) == "postgresql+psycopg://user@127.0.0.1:5432/db?password=***"


# -- in process: repr and errors of a store whose server is down -------------


@pytest.mark.parametrize("kind", sorted(planted_urls(1)))
def test_repr_and_errors_of_a_store_that_is_down_hide_the_secret(kind: str) -> None:
    url = planted_urls(free_port())[kind]
    store = LeaseStore.from_url(url)
    try:
        assert_clean("repr(store)", repr(store))
        assert_clean("str(store)", str(store))
        for op in (
            lambda: store.claim("k", ttl=5.0, owner_id="o"),
            lambda: store.inspect("k"),
            lambda: store.list(""),
        ):
            with pytest.raises(StoreUnavailable) as info:
                op()
            # Proof the fault happened: the server really refused the connection.
            assert "refused" in str(info.value).lower(), str(info.value)
            for shown in (
                str(info.value),
                repr(info.value),
                "".join(traceback.format_exception(info.value)),
            ):
                assert_clean(f"{kind} error", shown)
            assert MASK in str(info.value)
    finally:
        store.close()


@pytest.mark.parametrize(
    ("url", "options"),
    [
        (f"etcd://user:{SECRET}@127.0.0.1:2379", {}),
        ("etcd://127.0.0.1:2379", {"password": SECRET}),
        ("redis://127.0.0.1:6379/0", {"password": SECRET, "no_such_option": 1}),
    ],
)
def test_config_errors_of_planted_urls_and_options_hide_the_secret(
    url: str, options: dict[str, object]
) -> None:
    with pytest.raises(LeaseConfigError) as info:
        LeaseStore.from_url(url, **options)
    for shown in (
        str(info.value),
        repr(info.value),
        "".join(traceback.format_exception(info.value)),
    ):
        assert_clean("config error", shown)


# -- real processes: the CLI and workers -----------------------------------------


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(Path(tmp_path_factory.mktemp("redaction")), appendonly=False)
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


def _cluster(
    broker: RedisServer, tmp_path: Path, store_url: str, results_url: str, **settings: object
) -> Cluster:
    return Cluster(
        tmp_path,
        broker=broker.url(0),
        backend=broker.url(1),
        store_url=store_url,
        results_url=results_url,
        ttl=5.0,
        settings={"lease_store_retry": 0.5, **settings},
    )


@pytest.mark.parametrize("kind", sorted(planted_urls(1)))
def test_cli_list_show_and_migrate_with_an_unreachable_store_hide_the_secret(
    kind: str, broker: RedisServer, tmp_path: Path
) -> None:
    url = planted_urls(free_port())[kind]
    results = url if kind.startswith("pg") else f"sqlite:///{tmp_path / 'r.sqlite3'}"
    c = _cluster(broker, tmp_path, url, results)
    try:
        commands = [("list",), ("show", "some-key"), ("show", "some-key", "--tenant", "acme")]
        if kind.startswith("pg"):
            commands.append(("migrate",))
        for args in commands:
            done = c.cli(*args)
            out = done.stdout + done.stderr
            assert done.returncode == 1, (args, done.returncode, out)  # proof: it failed
            assert "refused" in out.lower() or "unavailable" in out.lower(), out
            assert_clean(f"lease {' '.join(args)}", out)
    finally:
        c.close()


def test_cli_migrate_of_an_unreachable_result_database_hides_the_secret(
    broker: RedisServer, tmp_path: Path
) -> None:
    port = free_port()
    c = _cluster(broker, tmp_path, broker.url(2), planted_urls(port)["pg-userinfo"])
    try:
        done = c.cli("migrate")
        out = done.stdout + done.stderr
        assert done.returncode == 1 and str(port) in out, out
        assert_clean("lease migrate", out)
    finally:
        c.close()


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"lease_store_url": f"redis://u:{SECRET}@127.0.0.1:notaport/1"}, "lease_store_url"),
        (
            {"lease_store_url": f"etcd://user:{SECRET}@127.0.0.1:2379"},
            "etcd user/password authentication is not supported",
        ),
        ({"lease_result_url": f"redis://u:{SECRET}@127.0.0.1/1"}, "lease_result_url"),
        ({"lease_store_options": {"password": SECRET, "no_such_option": 1}}, "no_such_option"),
        ({"lease_ttl": "30", "lease_store_options": {"password": SECRET}}, "lease_ttl"),
    ],
)
def test_a_bad_setting_at_worker_start_hides_the_secret(
    settings: dict[str, object], named: str, broker: RedisServer, tmp_path: Path
) -> None:
    c = _cluster(broker, tmp_path, broker.url(2), f"sqlite:///{tmp_path / 'r.sqlite3'}", **settings)
    try:
        code, log = c.worker("bad-setting").run_to_exit(timeout=90)
        assert code != 0 and named in log, log[-3000:]  # proof: refused, naming the setting
        assert_clean("the worker's log", log)
    finally:
        c.close()


@pytest.mark.parametrize("kind", ["redis-userinfo", "pg-query"])
def test_a_worker_whose_store_is_down_hides_the_secret_in_logs_and_events(
    kind: str, broker: RedisServer, tmp_path: Path, pg_url: str
) -> None:
    celery_lease.migrate(pg_url)
    store_url = planted_urls(free_port())[kind]
    c = _cluster(broker, tmp_path, store_url, pg_url)
    try:
        c.worker(f"down-{kind}").start()
        with EventCapture(c.app) as events:
            result = c.tasks.work.delay(f"k-{uuid.uuid4().hex[:8]}", 0.0)
            deferred = wait_for(
                lambda: [e for e in events.of(result.id) if e["type"] == "task-LEASE_DEFERRED"],
                60,
                "a LEASE_DEFERRED event for the unreachable store",
            )
        fields = json.dumps(deferred, default=str)
        assert "lease store unavailable" in deferred[0]["reason"], fields  # proof of the fault
        assert MASK in deferred[0]["reason"], fields
        assert_clean("the LEASE_DEFERRED event", fields)
        assert_clean("the worker's log", c.worker_logs())
        assert_clean("every event received", json.dumps(events.snapshot(), default=str))
    finally:
        c.close()
