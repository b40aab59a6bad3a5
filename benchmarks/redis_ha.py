"""8. Redis Sentinel and Cluster: lease primitives, and the cost of ``wait_replicas``."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks.env import Env, log
from benchmarks.report import Section, Table
from benchmarks.stats import fmt_rate, fmt_ratio, fmt_us, interleave, median

NAME = "redis_ha"
TITLE = "8. Redis Sentinel and Cluster: claim + release pairs per second"

TTL = 30.0
OWNER = "bench-owner:1:0123456789abcdef"
Pair = Callable[[str], None]


def _store_pair(store: Any) -> Pair:
    def pair(key: str) -> None:
        lease = store.claim(key, owner_id=OWNER, ttl=TTL)
        assert lease is not None and store.release(lease)

    return pair


def _raw_pair(client: Any) -> Pair:
    """The floor: ``SET NX PX`` + ``DEL``, no owner check, no token."""

    def pair(key: str) -> None:
        assert client.set(key, OWNER, nx=True, px=int(TTL * 1000))
        client.delete(key)

    return pair


def _measure(pairs: dict[str, Pair], n: int, rounds: int) -> dict[str, list[float]]:
    counter = itertools.count()

    def one(name: str, _round: int) -> float:
        tag = f"{name}-{next(counter)}-{uuid.uuid4().hex[:6]}"
        keys = [f"bench-{tag}-{i}" for i in range(n)]
        pair = pairs[name]
        t0 = time.perf_counter()
        for key in keys:
            pair(key)
        return (time.perf_counter() - t0) / n

    for pair in pairs.values():  # warm up: connections, script caches, slot maps
        for i in range(50):
            pair(f"warm-{uuid.uuid4().hex}-{i}")
    return interleave(list(pairs), rounds, one)


def _contenders(kind: str, deployment: Any) -> dict[str, Pair]:
    from celery_lease import LeaseStore
    from tests.redis_ha import SENTINEL_MASTER

    if kind == "Sentinel":
        from redis.sentinel import Sentinel

        url, options = deployment.url(0), {"master_name": SENTINEL_MASTER}
        raw = Sentinel(deployment.sentinel_addresses).master_for(SENTINEL_MASTER)
    else:
        url, options, raw = deployment.url(), {}, deployment.client()
    return {
        f"raw SET NX PX + DEL ({kind})": _raw_pair(raw),
        f"celery-lease ({kind})": _store_pair(LeaseStore.from_url(url, **options)),
        f"celery-lease ({kind}, wait_replicas=1)": _store_pair(
            LeaseStore.from_url(url, **options, wait_replicas=1, wait_timeout_ms=1000)
        ),
    }


def run(env: Env) -> Section:
    from tests.redis_ha import ClusterDeployment, SentinelDeployment

    n = 300 if env.quick else 2000
    rounds = 3 if env.quick else 7
    section = Section(
        NAME,
        TITLE,
        intro=(
            "The primitives of section 1 on Redis as run past one server, deployments "
            "started on loopback for the run (tests/redis_ha.py): Sentinel (1 master, 2 "
            "replicas, 3 sentinels; the store's client from `Sentinel(...).master_for(...)`) "
            "and Cluster (3 masters, 3 replicas; `RedisCluster`). One process, one "
            f"connection per node, {n} distinct keys per round, claim then release, "
            f"{rounds} interleaved rounds. The baseline is raw `SET NX PX` + `DEL` through "
            "the same redis-py client kind on the same deployment (no owner check, no "
            "token). `wait_replicas=1` adds `WAIT 1 1000` in the same round trip as each "
            "claim (a release does not wait). *Ratio* is baseline time ÷ celery-lease time "
            "in the same round."
        ),
    )
    table = Table(
        ["deployment", "contender", "pairs/s", "µs per pair", "ratio to raw"], align="llrrr"
    )
    for kind, cls in (("Sentinel", SentinelDeployment), ("Cluster", ClusterDeployment)):
        log(f"{NAME}: starting a {kind} deployment")
        deployment = cls(env.tmpdir).start()
        try:
            pairs = _contenders(kind, deployment)
            samples = _measure(pairs, n, rounds)
        finally:
            deployment.stop()
        base = next(iter(samples))
        ratio: dict[str, str] = {}
        for name, xs in samples.items():
            ratio[name] = fmt_ratio(median([b / x for x, b in zip(xs, samples[base]) if x]))
            table.add(kind, name, fmt_rate(1 / median(xs)), fmt_us(median(xs)), ratio[name])
        section.summary.append(
            f"Primitives, Redis {kind}: celery-lease {ratio[f'celery-lease ({kind})']} the "
            f"claim+release pairs/s of raw SET NX PX + DEL on the same deployment; with "
            f"`wait_replicas=1` {ratio[f'celery-lease ({kind}, wait_replicas=1)']}"
        )
    section.add(table.markdown())
    return section
