"""A lease client run as a separate process by the contention and clock-skew tests.

Run as a script (``python tests/lease_client.py COMMAND ...``), optionally
under ``faketime``; it only imports celery_lease and redis, never the test
package. Every answer is one JSON object per line on stdout.

Commands:

``time``
    ``{"time": time.time(), "monotonic": time.monotonic()}``.
``claim URL KEY --ttl T --owner O``
    Claims KEY and prints the lease (or null), the local and store clocks.
``hold URL KEY --ttl T --owner O``
    Holds KEY with ``store.hold()``; prints ``{"event": "holding", ...}``, then
    answers ``status`` lines on stdin with the lease's local view, and on
    ``exit`` (or EOF) leaves the block and prints ``{"event": "released"}``.
``contend URL KEY --ttl T --counter-url R --counter-key C --duration D ...``
    Prints ``ready``, waits for ``go`` on stdin, then for D seconds claims KEY
    in a loop; inside each grant it INCRs the separate Redis counter C (and
    DECRs it on leaving), works a random time shorter than the TTL and
    releases (or, sometimes, abandons the lease to expire). Prints one JSON
    line per grant: token, monotonic times (CLOCK_MONOTONIC is system-wide on
    Linux, so times of different processes compare), the counter value seen.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

from celery_lease import LeaseStore, StoreUnavailable
from celery_lease.stores.base import Lease


def emit(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def lease_json(lease: Lease | None) -> dict[str, Any] | None:
    if lease is None:
        return None
    return {
        "key": lease.key,
        "owner_id": lease.owner_id,
        "token": lease.token,
        "expires_at": lease.expires_at,
        "acquired_at": lease.acquired_at,
        "ttl": lease.ttl,
    }


def cmd_time(args: argparse.Namespace) -> None:
    emit({"time": time.time(), "monotonic": time.monotonic(), "pid": os.getpid()})


def cmd_claim(args: argparse.Namespace) -> None:
    store = LeaseStore.from_url(args.url)
    local_before = time.time()
    store_before = store.time()
    lease = store.claim(args.key, owner_id=args.owner, ttl=args.ttl)
    store_after = store.time()
    record = store.inspect(args.key)
    emit(
        {
            "lease": lease_json(lease),
            "local_time": local_before,
            "store_before": store_before,
            "store_after": store_after,
            "record_remaining": record.remaining if record else None,
            "record_owner": record.owner_id if record else None,
        }
    )


def cmd_hold(args: argparse.Namespace) -> None:
    store = LeaseStore.from_url(args.url)
    with store.hold(args.key, ttl=args.ttl, owner_id=args.owner) as held:
        emit(
            {
                "event": "holding",
                "token": held.token,
                "expires_at": held.expires_at,
                "acquired_at": held.lease.acquired_at,
                "local_time": time.time(),
            }
        )
        for line in sys.stdin:
            if line.strip() != "status":
                break
            store_before = store.time()
            status = {
                "event": "status",
                "held": held.held,
                "renewals": held.renewals,
                "expires_at": held.expires_at,
                "local_time": time.time(),
            }
            # The snapshot above was taken between these two store readings.
            emit({**status, "store_before": store_before, "store_after": store.time()})
    emit({"event": "released", "held": held.held, "renewals": held.renewals})


def cmd_contend(args: argparse.Namespace) -> None:
    import redis

    store = LeaseStore.from_url(args.url)
    counter = redis.Redis.from_url(args.counter_url)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    generation = 0
    owner = f"contender-{args.index}:{os.getpid()}:{generation}"
    store.time()  # connect before the start line
    counter.ping()
    emit("ready")
    if sys.stdin.readline().strip() != "go":
        return
    stop = time.monotonic() + args.duration
    attempts = errors = 0
    while time.monotonic() < stop:
        attempts += 1
        t0 = time.monotonic()
        try:
            lease = store.claim(args.key, owner_id=owner, ttl=args.ttl)
        except StoreUnavailable:
            errors += 1
            time.sleep(0.01)
            continue
        if lease is None:
            time.sleep(rng.uniform(0.002, 0.02))
            continue
        enter = time.monotonic()
        inside = int(counter.incr(args.counter_key))
        time.sleep(rng.uniform(args.work_min, args.work_max))
        counter.decr(args.counter_key)
        leave = time.monotonic()
        abandon = rng.random() < args.abandon
        released = None if abandon else store.release(lease)
        done = time.monotonic()
        if abandon:
            # As if this process died holding the lease: come back as a new
            # owner (the store lets an owner re-claim its own live lease).
            generation += 1
            owner = f"contender-{args.index}:{os.getpid()}:{generation}"
        emit(
            {
                "owner": lease.owner_id,
                "token": lease.token,
                "t0": t0,
                "enter": enter,
                "leave": leave,
                "inside": inside,
                "abandoned": abandon,
                "released": released,
                "released_by": None if abandon else done,
                "acquired_at": lease.acquired_at,
                "expires_at": lease.expires_at,
            }
        )
        time.sleep(rng.uniform(0.0, 0.01))
    emit({"summary": True, "owner": owner, "attempts": attempts, "errors": errors})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lease_client")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("time")
    for name in ("claim", "hold", "contend"):
        p = sub.add_parser(name)
        p.add_argument("url")
        p.add_argument("key")
        p.add_argument("--ttl", type=float, required=True)
        p.add_argument("--owner", default=None)
        if name == "contend":
            p.add_argument("--counter-url", required=True)
            p.add_argument("--counter-key", required=True)
            p.add_argument("--duration", type=float, required=True)
            p.add_argument("--work-min", type=float, default=0.02)
            p.add_argument("--work-max", type=float, default=0.12)
            p.add_argument("--abandon", type=float, default=0.1)
            p.add_argument("--index", type=int, default=0)
    args = parser.parse_args(argv)
    {"time": cmd_time, "claim": cmd_claim, "hold": cmd_hold, "contend": cmd_contend}[args.command](
        args
    )


if __name__ == "__main__":
    main()
