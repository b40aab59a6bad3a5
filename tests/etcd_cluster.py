"""Private etcd clusters for the tests: three members on free loopback ports.

Each member has its own data directory under the test session's temp dir,
its own log, and is started with ``tests.servers.spawn`` (own process group,
parent-death signal), so nothing outlives pytest. Readiness is polled against
a deadline: every member answers ``/health`` with ``{"health": "true"}`` (a
leader is elected and the member serves requests). Heartbeat 50 ms and
election timeout 500 ms: a new leader within about a second of losing one,
and etcd's minimum lease TTL is 1 s.

* :class:`EtcdCluster` -- start, ``leader()``, ``kill()`` / ``start()`` of one
  member (a restart keeps its data directory and ports), ``cleanup()``;
* :func:`shared_cluster` -- the session's one cluster for the suites that do
  not hurt it (the contract suite, the timelines), reference-counted so that
  several test modules share it and the last one's teardown removes it;
* fixtures, imported by the test modules that use them (conftest.py belongs
  to the server infrastructure): ``etcd_cluster`` (session, shared),
  ``etcd_url`` (a clean key space: every ``/celery-lease/`` key deleted) and
  ``make_etcd_cluster`` (function: private clusters a test may kill members of).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import LOOPBACK, free_port, log_tail, signal_group, spawn, wait_for

__all__ = [
    "EtcdCluster",
    "EtcdMember",
    "etcd_cluster",
    "etcd_url",
    "make_etcd_cluster",
    "shared_cluster",
]

START_TIMEOUT = 30.0


def etcd_binary() -> str:
    found = shutil.which("etcd") or (
        "/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None
    )
    if found is None:
        raise FileNotFoundError(
            "'etcd' not found; install etcd-server (scripts/test does, as root)"
        )
    return found


def _request(
    base: str,
    path: str,
    body: dict[str, Any] | None = None,
    timeout: float = 1.0,
    context: ssl.SSLContext | None = None,
) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method="POST" if data else "GET")
    with urllib.request.urlopen(req, timeout=timeout, context=context) as reply:
        return json.loads(reply.read())


def tls_context(tls: Path) -> ssl.SSLContext:
    """A client context trusting ``tls/ca.crt`` and presenting ``tls/client.crt``."""
    context = ssl.create_default_context(cafile=str(tls / "ca.crt"))
    context.load_cert_chain(str(tls / "client.crt"), str(tls / "client.key"))
    return context


class EtcdMember:
    def __init__(
        self,
        name: str,
        base: Path,
        client_port: int,
        peer_port: int,
        tls: Path | None = None,
        args: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.client_port = client_port
        self.peer_port = peer_port
        self.data_dir = base / name
        self.log_path = base / f"{name}.log"
        self.tls = tls
        self.args = args
        self._context = tls_context(tls) if tls is not None else None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{LOOPBACK}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{LOOPBACK}:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    def spawn(self, initial_cluster: str, token: str) -> None:
        argv = [
            etcd_binary(),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster,
            "--initial-cluster-token", token,
            "--initial-cluster-state", "new",
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--logger", "zap",
            "--log-outputs", "stderr",
            *self.args,
        ]  # fmt: skip
        if self.tls is not None:  # clients must present a certificate signed by ca.crt
            argv += [
                "--cert-file", str(self.tls / "server.crt"),
                "--key-file", str(self.tls / "server.key"),
                "--client-cert-auth",
                "--trusted-ca-file", str(self.tls / "ca.crt"),
            ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        with open(self.log_path, "ab") as log:
            self.proc = spawn(argv, log=log, env=env, cwd=str(self.data_dir.parent))

    def healthy(self) -> bool:
        try:
            reply = _request(self.client_url, "/health", context=self._context)
            return bool(reply.get("health") == "true")
        except (OSError, ValueError):
            return False

    def status(self) -> dict[str, Any] | None:
        """``/v3/maintenance/status`` of this member (its id, the leader's id, raft term)."""
        try:
            reply: dict[str, Any] = _request(
                self.client_url, "/v3/maintenance/status", {}, context=self._context
            )
        except (OSError, ValueError):
            return None
        return reply

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        if self.proc is None:
            return
        signal_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def __repr__(self) -> str:
        return f"<EtcdMember {self.name} client={self.client_port} pid={self.pid}>"


class EtcdCluster:
    """``size`` etcd members on loopback, each with its own data directory and log."""

    def __init__(
        self, tmpdir: Path, size: int = 3, *, tls: Path | None = None, args: tuple[str, ...] = ()
    ) -> None:
        etcd_binary()  # FileNotFoundError before anything is created
        tmpdir.mkdir(parents=True, exist_ok=True)
        self.base = Path(tempfile.mkdtemp(prefix="etcd-", dir=tmpdir))
        self.token = self.base.name
        self.tls = tls
        self.members = [
            EtcdMember(f"n{i + 1}", self.base, free_port(), free_port(), tls, args)
            for i in range(size)
        ]
        self.initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    @property
    def url(self) -> str:
        """``etcd://host:port,host:port,...`` naming every member (``etcds://`` with TLS)."""
        scheme = "etcds" if self.tls is not None else "etcd"
        return f"{scheme}://" + ",".join(f"{LOOPBACK}:{m.client_port}" for m in self.members)

    def start(self, timeout: float = START_TIMEOUT) -> None:
        for m in self.members:
            if not m.running:
                m.data_dir.mkdir(exist_ok=True)
                m.spawn(self.initial_cluster, self.token)
        self.wait_healthy(timeout)

    def start_member(self, member: EtcdMember, timeout: float = START_TIMEOUT) -> None:
        """Start one stopped member again (same ports, same data directory)."""
        member.spawn(self.initial_cluster, self.token)
        wait_for(member.healthy, timeout, f"{member.name} healthy", abort=self._exited)

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        try:
            wait_for(
                lambda: all(m.healthy() for m in self.members if m.running),
                timeout,
                "every etcd member healthy (/health)",
                abort=self._exited,
            )
        except Exception as exc:  # noqa: BLE001 - re-raised with the members' logs
            logs = "\n".join(log_tail(m.log_path, lines=25) for m in self.members)
            raise RuntimeError(f"{exc}\n{logs}") from None

    def _exited(self) -> str | None:
        for m in self.members:
            if (
                m.proc is not None
                and m.proc.poll() is not None
                and m.proc.returncode not in (-signal.SIGKILL,)
            ):
                return f"{m.name} exited with code {m.proc.returncode}"
        return None

    def leader(self) -> EtcdMember | None:
        """The member every live member agrees leads (None during an election)."""
        ids: dict[str, EtcdMember] = {}
        leaders: set[str] = set()
        for m in self.members:
            if not m.running:
                continue
            status = m.status()
            if status is None:
                return None
            ids[str(status["header"]["member_id"])] = m
            leaders.add(str(status.get("leader", "0")))
        if len(leaders) != 1:
            return None
        return ids.get(leaders.pop())

    def call(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` to ``/v3/<path>`` of a running member: raw etcd, for assertions."""
        for m in self.members:
            if m.running:
                return _request(m.client_url, "/v3/" + path, body, timeout=10.0, context=m._context)
        raise RuntimeError("no etcd member is running")

    def clear(self, prefix: str = "/celery-lease/") -> None:
        """Delete every key under ``prefix`` (a clean key space for the next test)."""
        key = prefix.encode()
        end = key[:-1] + bytes([key[-1] + 1])
        self.call(
            "kv/deleterange",
            {"key": base64.b64encode(key).decode(), "range_end": base64.b64encode(end).decode()},
        )

    def ensure_running(self) -> None:
        dead = [m for m in self.members if not m.running]
        for m in dead:
            m.spawn(self.initial_cluster, self.token)
        self.wait_healthy()

    def cleanup(self) -> None:
        for m in self.members:
            m.kill()
        shutil.rmtree(self.base, ignore_errors=True)

    def logs(self) -> str:
        return "\n".join(log_tail(m.log_path, lines=40) for m in self.members)


# --------------------------------------------------------------------------
# the session's shared cluster, and the fixtures
# --------------------------------------------------------------------------

# -- reading what etcd holds, past the store ----------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def raw_get(cluster: EtcdCluster, name: str) -> dict[str, Any] | None:
    """The etcd key ``name`` as etcd holds it (value decoded), or None."""
    reply = cluster.call("kv/range", {"key": b64(name.encode())})
    kvs = reply.get("kvs", [])
    if not kvs:
        return None
    kv = dict(kvs[0])
    kv["value"] = base64.b64decode(kv.get("value", ""))
    return kv


def lease_ttl(cluster: EtcdCluster, lease_id: int | str) -> tuple[int, int]:
    """(remaining TTL, granted TTL) of an etcd lease; (-1, 0) once it is gone."""
    reply = cluster.call("kv/lease/timetolive", {"ID": str(lease_id)})
    return int(reply.get("TTL", 0)), int(reply.get("grantedTTL", 0))


def etcd_leases(cluster: EtcdCluster) -> set[str]:
    return {str(item["ID"]) for item in cluster.call("lease/leases", {}).get("leases", [])}


_shared: EtcdCluster | None = None
_shared_users = 0
_shared_lock = threading.Lock()


def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> EtcdCluster:
    """The session's one healthy cluster (started on first use, counted per user)."""
    global _shared, _shared_users
    with _shared_lock:
        if _shared is None:
            cluster = EtcdCluster(tmp_path_factory.getbasetemp() / "etcd")
            try:
                cluster.start()
            except BaseException:
                cluster.cleanup()
                raise
            _shared = cluster
        _shared_users += 1
        return _shared


def release_shared() -> None:
    global _shared, _shared_users
    with _shared_lock:
        _shared_users -= 1
        if _shared_users <= 0 and _shared is not None:
            _shared.cleanup()
            _shared = None


def _missing(exc: FileNotFoundError) -> None:
    message = f"{exc} (scripts/test installs etcd-server when run as root)"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """The session's shared 3-member cluster (tests must not kill its members)."""
    try:
        cluster = shared_cluster(tmp_path_factory)
    except FileNotFoundError as exc:
        _missing(exc)
        raise
    try:
        yield cluster
    finally:
        release_shared()


@pytest.fixture
def etcd_url(etcd_cluster: EtcdCluster) -> str:
    """``etcd://`` URL of the shared cluster, its ``/celery-lease/`` keys deleted first."""
    etcd_cluster.ensure_running()
    etcd_cluster.clear()
    return etcd_cluster.url


@pytest.fixture
def make_etcd_cluster(tmp_path: Path) -> Iterator[Callable[..., EtcdCluster]]:
    """Factory of private, started clusters the test may hurt; all removed afterwards."""
    made: list[EtcdCluster] = []

    def make(size: int = 3, *, tls: Path | None = None, args: tuple[str, ...] = ()) -> EtcdCluster:
        """``args``: extra etcd flags for every member (e.g. ``("--max-txn-ops", "12")``)."""
        try:
            cluster = EtcdCluster(tmp_path, size, tls=tls, args=args)
        except FileNotFoundError as exc:
            _missing(exc)
            raise
        made.append(cluster)
        cluster.start()
        return cluster

    yield make
    for cluster in made:
        cluster.cleanup()
