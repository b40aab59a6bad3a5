"""A lease contender run as a separate process by tests/contract/test_etcd_failover.py.

Run as a script: ``python tests/etcd_contender.py URL LOG --keys k1,k2 --ttl T
--duration D --index I``. Imports only celery_lease. Prints ``ready``, waits
for ``go`` on stdin, then for D seconds claims a random key in a loop and,
like a correct lease holder, works only inside its local view of the lease
(monotonic time of the claim's request + the granted TTL - a margin): inside
it, it sleeps a random 10-60 ms and releases (or, sometimes, abandons the
lease to expire). Every grant is appended to LOG, one JSON line written with
``O_APPEND`` and fsync'd before the next claim: key, token, and the
``CLOCK_MONOTONIC`` times it entered and left the critical section (system-wide
on Linux, so lines of different processes compare). Store errors are logged
too, with their time. A summary line ends the log.
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

#: seconds kept off the local view of a lease (as HeldLease's clock-drift margin)
MARGIN = 0.1


def append(path: str, record: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="etcd_contender")
    parser.add_argument("url")
    parser.add_argument("log")
    parser.add_argument("--keys", required=True)
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--duration", type=float, required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--abandon", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args(argv)

    keys = args.keys.split(",")
    store = LeaseStore.from_url(args.url, timeout=args.timeout)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    generation = 0
    store.inspect(keys[0])  # connect before the start line
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    if sys.stdin.readline().strip() != "go":
        return
    stop = time.monotonic() + args.duration
    attempts = refused = errors = late = 0
    while time.monotonic() < stop:
        owner = f"contender-{args.index}:{os.getpid()}:{generation}"
        key = rng.choice(keys)
        attempts += 1
        sent = time.monotonic()
        try:
            lease = store.claim(key, owner_id=owner, ttl=args.ttl)
        except StoreUnavailable as e:
            errors += 1
            append(args.log, {"error": str(e)[:200], "op": "claim", "t": time.monotonic()})
            time.sleep(0.02)
            continue
        if lease is None:
            refused += 1
            time.sleep(rng.uniform(0.002, 0.02))
            continue
        valid_until = sent + lease.ttl - MARGIN
        work = rng.uniform(0.01, 0.06)
        enter = time.monotonic()
        if enter + work >= valid_until:
            # The grant came back too late to be used (a claim held up by an
            # election): a correct holder does not start work it cannot finish.
            late += 1
            append(args.log, {"late": True, "key": key, "token": lease.token, "t": enter})
            continue
        time.sleep(work)
        leave = time.monotonic()
        abandon = rng.random() < args.abandon
        released: bool | None = None
        if not abandon:
            try:
                released = store.release(lease)
            except StoreUnavailable as e:
                append(args.log, {"error": str(e)[:200], "op": "release", "t": time.monotonic()})
        else:
            generation += 1  # as if this process died holding the lease
        append(
            args.log,
            {
                "key": key,
                "token": lease.token,
                "owner": owner,
                "sent": sent,
                "enter": enter,
                "leave": leave,
                "valid_until": valid_until,
                "abandoned": abandon,
                "released": released,
            },
        )
        time.sleep(rng.uniform(0.0, 0.005))
    append(
        args.log,
        {
            "summary": True,
            "index": args.index,
            "attempts": attempts,
            "refused": refused,
            "errors": errors,
            "late": late,
        },
    )


if __name__ == "__main__":
    main()
