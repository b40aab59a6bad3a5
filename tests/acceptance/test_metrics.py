"""Metrics scraped over HTTP from a running prefork worker (prometheus multiprocess mode)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

import celery_lease
from celery_lease import LeaseStore
from tests.apps.leaseapp import build
from tests.servers import free_port, wait_for
from tests.workers import Worker, read_log, signal_when_active

pytest.importorskip("prometheus_client")


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = samples.get(name, 0.0) + float(value)
    return samples


def metric(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def test_counters_move_for_grant_deferral_loss_and_fence(
    fresh_redis: Callable[[], str], pg_url: str, tmp_path: Path
) -> None:
    celery_lease.migrate(pg_url)
    port = free_port()
    log = tmp_path / "exec.log"
    env = {
        "CL_BROKER": fresh_redis(),
        "CL_BACKEND": fresh_redis(),
        "CL_STORE": fresh_redis(),
        "CL_RESULTS": pg_url,
        "CL_TTL": "2",
        "CL_LOG": str(log),
        "CL_SETTINGS": json.dumps({"lease_metrics_port": port}),
    }
    worker = Worker("metrics", env, tmp_path, concurrency=2).start()
    try:
        _, tasks = build(env)
        wait_for(lambda: _up(port), 20, "the metrics endpoint")
        store = LeaseStore.from_url(env["CL_STORE"])

        # A granted claim.
        tasks.work.delay(f"m-{uuid.uuid4().hex}", 0.1).get(timeout=30)

        # A deferral: a second submission while the first holds the key.
        busy = f"m-{uuid.uuid4().hex}"
        first = tasks.work.delay(busy, 2.0)
        wait_for(lambda: _started(log, first.id), 30, "the first body to start")
        second = tasks.work.delay(busy, 0.1)
        first.get(timeout=30)
        second.get(timeout=30)

        # A lost lease and a fenced commit: stop the child running T4 past its TTL,
        # let T5 (same key) commit on the other child, then resume T4.
        key = f"m-{uuid.uuid4().hex}"
        t4 = tasks.work.delay(key, 3.0)
        start = wait_for(lambda: _started(log, t4.id), 30, "T4 to start")
        child = int(start["pid"])
        assert child in worker.children()
        os.kill(child, signal.SIGSTOP)
        try:
            wait_for(lambda: _proc_state(child) == "T", 10, "T4's child to stop")
            token = int(start["token"])
            wait_for(
                lambda: (lambda r: r is None or not r.live or r.token != token)(store.inspect(key)),
                30,
                "T4's lease to lapse",
            )
            t5 = tasks.work.delay(key, 0.1)
            assert t5.get(timeout=30)["token"] > token
        finally:
            os.kill(child, signal.SIGCONT)
        with pytest.raises(celery_lease.StaleFencingToken):
            t4.get(timeout=30)

        samples = wait_for(
            lambda: (lambda s: s if metric(s, "celery_lease_stale_commits_total") >= 1 else None)(
                scrape(port)
            ),
            20,
            "the fenced commit to be counted",
        )
        print({k: v for k, v in samples.items() if k.startswith("celery_lease")})
        assert samples['celery_lease_claims_total{outcome="granted"}'] >= 4
        assert samples['celery_lease_claims_total{outcome="deferred"}'] >= 1
        assert metric(samples, "celery_lease_leases_lost_total") >= 1
        assert metric(samples, "celery_lease_stale_commits_total") >= 1
        assert metric(samples, "celery_lease_renewals_total") >= 1
        assert metric(samples, "celery_lease_claim_seconds_count") >= 4
    finally:
        worker.kill()


def _up(port: int) -> bool:
    try:
        scrape(port)
    except OSError:
        return False
    return True


def _started(log: Path, task_id: str) -> dict[str, object] | None:
    for row in read_log(log):
        if row["event"] == "start" and row["task_id"] == task_id:
            return row
    return None


def _proc_state(pid: int) -> str:
    data = Path(f"/proc/{pid}/stat").read_text()
    return data[data.rfind(")") + 2 :].split()[0]


def test_a_sigkilled_childs_held_leases_leave_the_live_gauge(
    fresh_redis: Callable[[], str], tmp_path: Path
) -> None:
    """Two children each hold a lease; one is SIGKILLed (no shutdown signal runs
    in it): the next scrape sums the survivor's lease alone."""
    port = free_port()
    log = tmp_path / "exec.log"
    (tmp_path / "mp").mkdir()
    env = {
        "CL_BROKER": fresh_redis(),
        "CL_BACKEND": fresh_redis(),
        "CL_STORE": fresh_redis(),
        "CL_RESULTS": f"sqlite:///{tmp_path}/results.sqlite3",
        "CL_TTL": "30",
        "CL_LOG": str(log),
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "mp"),
        # The killed child's task is failed, not redelivered (a redelivery would
        # hold a lease again on the replacement child and blur the sum).
        "CL_SETTINGS": json.dumps(
            {"lease_metrics_port": port, "task_reject_on_worker_lost": False}
        ),
    }
    worker = Worker("metrics-dead", env, tmp_path, concurrency=2).start()
    try:
        _, tasks = build(env)
        wait_for(lambda: _up(port), 20, "the metrics endpoint")
        a = tasks.work.delay(f"md-{uuid.uuid4().hex}", 120.0)
        b = tasks.work.delay(f"md-{uuid.uuid4().hex}", 120.0)
        start_a = wait_for(lambda: _started(log, a.id), 30, "A to start")
        start_b = wait_for(lambda: _started(log, b.id), 30, "B to start")
        assert start_a["pid"] != start_b["pid"]
        wait_for(
            lambda: metric(scrape(port), "celery_lease_held_leases") == 2,
            20,
            "both children's leases in the gauge",
        )
        victim = int(start_a["pid"])
        os.kill(victim, signal.SIGKILL)
        # Proof of the fault: the child is gone (reaped by the pool) and replaced.
        wait_for(
            lambda: victim not in worker.children() and len(worker.children()) == 2,
            30,
            "the killed child to be reaped and replaced",
        )
        held = metric(scrape(port), "celery_lease_held_leases")
        assert held == 1, f"the dead child {victim}'s lease is still summed: {held}"
        assert not list((tmp_path / "mp").glob(f"gauge_live*_{victim}.db"))
    finally:
        worker.kill()


def test_a_worker_start_drops_the_files_dead_processes_left(
    fresh_redis: Callable[[], str], tmp_path: Path
) -> None:
    """A multiprocess directory reused across runs: a dead pid's counter and
    live gauge files are gone once the worker is up, nothing of them scraped."""
    import subprocess
    import sys

    port = free_port()
    mpdir = tmp_path / "mp"
    mpdir.mkdir()
    # A real process counts into the directory, then exits: its pid is dead.
    code = (
        "from celery_lease import metrics\n"
        "metrics.held_leases.set(7)\n"
        "metrics.claims.labels('granted').inc(1000)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mpdir)},
        cwd=str(Path(__file__).resolve().parents[2]),
        check=True,
        capture_output=True,
    )
    assert done.returncode == 0
    left = sorted(p.name for p in mpdir.iterdir())
    assert any(n.startswith("gauge_livesum_") for n in left), left
    assert any(n.startswith("counter_") for n in left), left
    env = {
        "CL_BROKER": fresh_redis(),
        "CL_BACKEND": fresh_redis(),
        "CL_STORE": fresh_redis(),
        "CL_RESULTS": f"sqlite:///{tmp_path}/results.sqlite3",
        "PROMETHEUS_MULTIPROC_DIR": str(mpdir),
        "CL_SETTINGS": json.dumps({"lease_metrics_port": port}),
    }
    worker = Worker("metrics-reuse", env, tmp_path, concurrency=1).start()
    try:
        wait_for(lambda: _up(port), 20, "the metrics endpoint")
        samples = scrape(port)
        assert metric(samples, "celery_lease_held_leases") == 0
        assert samples.get('celery_lease_claims_total{outcome="granted"}', 0) < 1000
        assert not set(left) & {p.name for p in mpdir.iterdir()}
    finally:
        worker.kill()


@pytest.mark.parametrize(
    ("made", "stop"),
    [(True, signal.SIGTERM), (True, signal.SIGQUIT), (False, signal.SIGTERM)],
    ids=["made-warm", "made-cold", "given-warm"],
)
def test_a_worker_leaves_nothing_in_its_temporary_directory_when_it_stops(
    fresh_redis: Callable[[], str], tmp_path: Path, made: bool, stop: signal.Signals
) -> None:
    """A stopped worker (warm: SIGTERM, cold: SIGQUIT) leaves its ``TMPDIR`` as
    it found it: the multiprocess directory it made for its samples is gone
    with it (a restart makes a fresh one); one the user gave it is kept, with
    the samples, as a directory other workers may share."""
    port = free_port()
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    given = tmp_path / "mp"
    env = {
        "CL_BROKER": fresh_redis(),
        "CL_BACKEND": fresh_redis(),
        "CL_STORE": fresh_redis(),
        "CL_RESULTS": f"sqlite:///{tmp_path}/results.sqlite3",
        "CL_SETTINGS": json.dumps({"lease_metrics_port": port}),
        "TMPDIR": str(tmpdir),
        **({} if made else {"PROMETHEUS_MULTIPROC_DIR": str(given)}),
    }
    worker = Worker("metrics-tmp", env, tmp_path, concurrency=2).start()
    try:
        _, tasks = build(env)
        wait_for(lambda: _up(port), 20, "the metrics endpoint")
        tasks.work.delay(f"m-{uuid.uuid4().hex}", 0.0).get(timeout=30)
        samples_dir = next(tmpdir.glob("celery-lease-*"), None) if made else given
        assert samples_dir is not None and samples_dir.parent == (tmpdir if made else tmp_path)
        assert any(samples_dir.glob("counter_*.db")), "the samples are written there"
        assert signal_when_active(tasks.work.app, worker, [], stop) == 0, "it stopped by itself"
    finally:
        worker.kill()
    assert sorted(p.name for p in tmpdir.iterdir()) == []
    if not made:
        assert any(given.glob("counter_*.db")), "the user's directory is theirs"


def own_address() -> str:
    """A non-loopback IPv4 address of this machine (``ip -4 addr``), else 127.0.0.2.

    Only the machine's own addresses (or loopback) are ever bound or scraped.
    """
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=False
    ).stdout
    for addr in re.findall(r"\binet (\d+\.\d+\.\d+\.\d+)/", out):
        if not addr.startswith("127."):
            return addr
    return "127.0.0.2"


def test_the_metrics_server_listens_on_lease_metrics_addr(
    fresh_redis: Callable[[], str], tmp_path: Path
) -> None:
    addr = own_address()
    port = free_port()
    env = {
        "CL_BROKER": fresh_redis(),
        "CL_BACKEND": fresh_redis(),
        "CL_STORE": f"sqlite:///{tmp_path / 'lease.sqlite3'}",
        "CL_RESULTS": f"sqlite:///{tmp_path / 'lease.sqlite3'}",
        "CL_SETTINGS": json.dumps({"lease_metrics_port": port, "lease_metrics_addr": addr}),
    }
    worker = Worker("metricsaddr", env, tmp_path).start()
    try:
        _, tasks = build(env)
        tasks.work.delay(f"m-{uuid.uuid4().hex}", 0.0).get(timeout=30)
        samples = wait_for(
            lambda: (lambda s: s if s and metric(s, "celery_lease_claims_total") >= 1 else None)(
                _scrape_or_none(addr, port)
            ),
            20,
            f"the metrics endpoint on {addr}:{port} to count the claim",
        )
        assert samples['celery_lease_claims_total{outcome="granted"}'] >= 1
        # Bound to that address only: loopback has nothing on the port.
        with pytest.raises(OSError):
            scrape(port, "127.0.0.1")
    finally:
        worker.kill()


def _scrape_or_none(host: str, port: int) -> dict[str, float] | None:
    try:
        return scrape(port, host)
    except OSError:
        return None
