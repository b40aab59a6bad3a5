"""Transport security: Redis over TLS with an ACL user, PostgreSQL with sslmode.

A certificate authority and server certificates are made here with
``openssl``; a private ``redis-server`` listens with TLS (and, for the test's
own administration only, on a plain loopback port), with an ACL user
``lease`` that may touch only ``celery-lease:*`` keys and no dangerous
commands. Over ``rediss://lease:secret@127.0.0.1:PORT/0``:

* claims, renewals (the timer of ``store.hold()``) and fenced commits work,
  with the CA given as ``LeaseStore.from_url(url, ssl_ca_certs=...)``, as the
  URL's ``?ssl_ca_certs=`` query, and as ``lease_store_options`` of a real
  worker whose task commits its result;
* the connections really are TLS connections of the ACL user (``CLIENT LIST``);
* a wrong CA is refused with :class:`StoreUnavailable` whose message says
  ``certificate verify failed``; a wrong password, a plain ``redis://`` to the
  TLS port, a key prefix outside the ACL user's pattern, a CA file that does
  not exist and a misspelt client option each fail with a named celery-lease
  error, never a raw redis-py exception.

PostgreSQL: ``sslmode``/``sslrootcert`` in the URL reach libpq, for the lease
store and the result table (a private cluster with ``ssl = on``).

If Debian's ``redis-server`` was built without TLS the Redis tests skip, saying so.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import celery_lease
from celery_lease import LeaseConfigError, LeaseError, LeaseStore, StoreUnavailable
from celery_lease.config import Config
from celery_lease.results import ResultTable
from tests.sec_cluster import Cluster
from tests.servers import PostgresServer, RedisServer, free_port, wait_for

pytestmark = pytest.mark.timeout(120)

USER, PASSWORD = "lease", "secret"


# --------------------------------------------------------------------------
# certificates and servers
# --------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    out = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _make_ca(d: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
        cwd=d,
    )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.crt (trusted), server.crt/.key for IP 127.0.0.1 signed by it, other-ca.crt."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("certs")
    _make_ca(d, "ca")
    _make_ca(d, "other-ca")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf", cwd=d,
    )  # fmt: skip
    return d


def _redis_tls_support() -> str | None:
    """None if redis-server has TLS; else why not."""
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.path.exists(binary):
        return "redis-server is not installed"
    out = subprocess.run(
        [binary, "--port", "0", "--tls-port", "1", "--tls-cert-file", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    text = out.stdout + out.stderr
    if "Bad directive" in text or ("tls-port" in text and "FATAL" in text):
        return f"Debian's redis-server was built without TLS support: {text.strip()[-200:]}"
    return None


class TLSRedis:
    def __init__(self, server: RedisServer, tls_port: int, certs: Path) -> None:
        self.server = server
        self.tls_port = tls_port
        self.certs = certs
        self.admin = redis.Redis(host="127.0.0.1", port=server.port)

    def url(self, db: int = 0, user: str = USER, password: str = PASSWORD) -> str:
        return f"rediss://{user}:{password}@127.0.0.1:{self.tls_port}/{db}"

    @property
    def ca(self) -> str:
        return str(self.certs / "ca.crt")


@pytest.fixture
def tls_redis(make_redis_server: Callable[..., RedisServer], certs: Path) -> Iterator[TLSRedis]:
    reason = _redis_tls_support()
    if reason:
        pytest.skip(reason)
    tls_port = free_port()
    server = make_redis_server(
        appendonly=False,
        extra_args=[
            "--tls-port", str(tls_port),
            "--tls-cert-file", str(certs / "server.crt"),
            "--tls-key-file", str(certs / "server.key"),
            "--tls-ca-cert-file", str(certs / "ca.crt"),
            "--tls-auth-clients", "no",
        ],
    )  # fmt: skip
    t = TLSRedis(server, tls_port, certs)
    # Least privilege: only celery-lease's keys, no dangerous commands.
    assert t.admin.execute_command(
        "ACL", "SETUSER", USER, "reset", "on", f">{PASSWORD}", "~celery-lease:*",
        "+@all", "-@dangerous",
    ) in (b"OK", "OK", True)  # fmt: skip
    yield t
    t.admin.close()


# --------------------------------------------------------------------------
# Redis over TLS
# --------------------------------------------------------------------------


def _tls_clients(t: TLSRedis) -> list[dict[str, Any]]:
    return [
        c
        for c in t.admin.client_list()
        if c.get("user") == USER and c.get("laddr", "").endswith(f":{t.tls_port}")
    ]


@pytest.mark.parametrize("how", ["keyword", "query"])
def test_claim_renew_commit_over_tls_as_acl_user(
    tls_redis: TLSRedis, tmp_path: Path, how: str
) -> None:
    t = tls_redis
    if how == "keyword":
        store = LeaseStore.from_url(t.url(), ssl_ca_certs=t.ca)
    else:
        store = LeaseStore.from_url(f"{t.url()}?ssl_ca_certs={t.ca}")
    assert "secret" not in repr(store)
    results = ResultTable(f"sqlite:///{tmp_path / 'results.sqlite3'}", store)
    key = f"payment-security-{uuid.uuid4().hex[:6]}"
    try:
        lease = store.claim(key, ttl=10)
        assert lease is not None
        assert store.claim(key, ttl=10) is None  # another owner is refused
        assert store.renew(lease) is True
        accepted = results.commit(lease, {"suite": "ok"})
        assert accepted.token == lease.token
        assert results.accepted(key) == accepted

        # renewals from the timer thread of hold(), over the same TLS connection pool;
        # a 3 s TTL leaves 2.8 s of slack, so a loaded machine's late renewal still
        # finds the lease held (the schedule is what is tested, not the margin)
        with store.hold(f"{key}-held", ttl=3.0, renew_interval=0.2) as held:
            wait_for(lambda: held.renewals >= 3, 10, "three renewals over TLS")
            assert held.held
        record = store.inspect(f"{key}-held")
        assert record is not None and not record.live  # released on exit

        # the work really went over TLS, as the ACL user, to the TLS port
        assert _tls_clients(t), t.admin.client_list()
        # the ACL user cannot run a dangerous command: the ACL is in force
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis.from_url(t.url(), ssl_ca_certs=t.ca).flushall()
    finally:
        store.close()


def test_a_real_worker_claims_renews_and_commits_over_tls(
    tls_redis: TLSRedis, make_redis_server: Callable[..., RedisServer], tmp_path: Path
) -> None:
    t = tls_redis
    broker = make_redis_server(appendonly=False)
    results = f"sqlite:///{tmp_path / 'results.sqlite3'}"
    c = Cluster(
        tmp_path,
        broker=broker.url(0),
        backend=broker.url(1),
        store_url=t.url(),
        results_url=results,
        ttl=1.5,
        settings={"lease_store_options": {"ssl_ca_certs": t.ca}},
    )
    try:
        c.worker("tls").start()
        key = f"tls-{uuid.uuid4().hex[:6]}"
        res = c.tasks.work.delay(key, sleep=2.0)  # longer than the TTL: renewed meanwhile
        value = res.get(timeout=30)
        end = c.wait_row("end", res.id)
        assert end["held"] is True, "the lease was renewed over TLS while the body ran"
        accepted = ResultTable(results).accepted(key)
        assert accepted is not None and accepted.task_id == res.id
        assert accepted.token == value["token"]
        assert "LEASE_LOST" not in c.worker_logs() and "FENCED" not in c.worker_logs()
    finally:
        c.close()


def test_a_wrong_ca_fails_with_a_clear_error(tls_redis: TLSRedis) -> None:
    t = tls_redis
    store = LeaseStore.from_url(t.url(), ssl_ca_certs=str(t.certs / "other-ca.crt"))
    with pytest.raises(StoreUnavailable, match=r"certificate verify failed") as info:
        store.claim("k", ttl=5)
    assert PASSWORD not in str(info.value)
    assert not isinstance(info.value, redis.RedisError)


def test_other_tls_and_acl_mistakes_fail_with_named_errors(tls_redis: TLSRedis) -> None:
    t = tls_redis
    # a wrong password: the server's answer, as StoreUnavailable, password redacted
    with pytest.raises(StoreUnavailable, match=r"invalid username-password pair") as info:
        LeaseStore.from_url(t.url(password="wrong"), ssl_ca_certs=t.ca).claim("k", ttl=5)
    assert "wrong" not in str(info.value)
    # plain redis:// to the TLS port: the server hangs up
    with pytest.raises(StoreUnavailable):
        LeaseStore.from_url(f"redis://{USER}:{PASSWORD}@127.0.0.1:{t.tls_port}/0").claim("k", ttl=5)
    # a key prefix outside the ACL user's key pattern (NOPERM): not a retryable outage
    outside = LeaseStore.from_url(t.url(), ssl_ca_certs=t.ca, key_prefix="other-app")
    with pytest.raises(LeaseError, match=r"no permissions to access") as denied:
        outside.claim("k", ttl=5)
    assert not isinstance(denied.value, StoreUnavailable)
    # a misspelt client option: refused when the store is made, naming the option
    with pytest.raises(LeaseConfigError, match=r"ssl_ca_cert\b"):
        LeaseStore.from_url(t.url(), ssl_ca_cert=t.ca)


def test_settings_check_tls_options_at_worker_start(certs: Path) -> None:
    from celery import Celery

    def cfg(**options: Any) -> Config:
        app = Celery("tls-settings", set_as_current=False)
        app.conf.update(
            lease_store_url="rediss://lease:secret@127.0.0.1:1/0",
            lease_result_url="sqlite:///x.sqlite3",
            lease_store_options=options,
        )
        return Config.from_app(app)

    assert cfg(ssl_ca_certs=str(certs / "ca.crt")).store_options == {
        "ssl_ca_certs": str(certs / "ca.crt")
    }
    with pytest.raises(LeaseConfigError, match=r"lease_store_options\['ssl_ca_certs'\]: no such"):
        cfg(ssl_ca_certs=str(certs / "missing.crt"))
    with pytest.raises(LeaseConfigError, match=r"unexpected keyword argument 'ssl_ca_cert'"):
        cfg(ssl_ca_cert=str(certs / "ca.crt"))
    with pytest.raises(LeaseConfigError, match=r"Invalid SSL Certificate Requirements"):
        cfg(ssl_cert_reqs="sometimes")


# --------------------------------------------------------------------------
# PostgreSQL: sslmode and sslrootcert pass through the URL
# --------------------------------------------------------------------------


@pytest.fixture
def ssl_pg(make_pg_server: Callable[..., PostgresServer], certs: Path) -> Iterator[PostgresServer]:
    # The server reads its key as its own OS user, with 0600 permissions.
    d = Path(tempfile.mkdtemp(prefix="celery-lease-pgssl-"))
    try:
        for name in ("server.crt", "server.key"):
            shutil.copy(certs / name, d / name)
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            for p in (d, d / "server.crt", d / "server.key"):
                os.chown(p, pw.pw_uid, pw.pw_gid)
        os.chmod(d, 0o755)
        os.chmod(d / "server.key", 0o600)
        yield make_pg_server(
            settings={
                "ssl": "on",
                "ssl_cert_file": str(d / "server.crt"),
                "ssl_key_file": str(d / "server.key"),
            }
        )
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_postgres_sslmode_and_sslrootcert_reach_libpq(
    ssl_pg: PostgresServer, pg_server: PostgresServer, certs: Path
) -> None:
    url = ssl_pg.create_database(f"tls_{uuid.uuid4().hex[:6]}")
    verified = f"{url}?sslmode=verify-full&sslrootcert={certs / 'ca.crt'}"
    celery_lease.migrate(verified)
    store = LeaseStore.from_url(verified)
    table = ResultTable(verified, store)
    lease = store.claim("pg-tls", ttl=10)
    assert lease is not None and store.renew(lease)
    assert table.commit(lease, {"ok": True}).token == lease.token
    # the connection is encrypted (the server says so)
    with store.db.single() as conn:  # type: ignore[attr-defined]
        from sqlalchemy import text

        assert conn.execute(
            text("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        ).scalar()
    store.close()

    wrong = f"{url}?sslmode=verify-full&sslrootcert={certs / 'other-ca.crt'}"
    with pytest.raises(StoreUnavailable, match=r"certificate verify failed"):
        LeaseStore.from_url(wrong).claim("pg-tls-2", ttl=10)
    # sslmode=require against a server without TLS: libpq refuses, named
    plain = pg_server.url("postgres") + "?sslmode=require"
    with pytest.raises(StoreUnavailable, match=r"does not support SSL"):
        LeaseStore.from_url(plain).claim("pg-tls-3", ttl=10)
