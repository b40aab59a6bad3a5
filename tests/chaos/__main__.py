"""``python -m tests.chaos``: one fault-injection run from the command line
(the run itself: :mod:`tests.chaos.runner`, whose docstring says what it does).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.chaos.faults import KINDS, REDIS_STORE_KINDS
from tests.chaos.runner import Options, run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=120.0, help="seconds of fault injection")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--tasks", type=int, default=300)
    p.add_argument("--keys", type=int, default=12)
    p.add_argument("--broker", choices=("redis", "amqp"), default="redis")
    p.add_argument(
        "--backend", choices=("redis", "lease"), default="redis",
        help="result backend: Celery's Redis backend, or lease+ the result database",
    )  # fmt: skip
    p.add_argument(
        "--store", choices=("redis", "pg"), default="redis",
        help="lease store: a Redis, or the result database (Redis store faults left out)",
    )  # fmt: skip
    p.add_argument("--ttl", type=float, default=4.0, help="lease TTL (s)")
    p.add_argument("--vt", type=float, default=10.0, help="Redis visibility_timeout (s)")
    p.add_argument("--fault-rate", type=float, default=0.2, help="faults per second")
    p.add_argument("--settle", type=float, default=240.0, help="max seconds to settle")
    p.add_argument("--kinds", default=",".join(KINDS), help="fault kinds, comma-separated")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--quiet", action="store_true")
    p.add_argument(
        "--chords", type=int, default=0, help="chords of 3 exclusive members (--backend lease)"
    )
    a = p.parse_args(argv)
    kinds = tuple(k for k in a.kinds.split(",") if k)
    if a.store == "pg":
        kinds = tuple(k for k in kinds if k not in REDIS_STORE_KINDS)
    if a.chords and a.backend != "lease":
        # Celery's Redis backend loses a chord whose last member dies before the publish.
        p.error("--chords needs --backend lease")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        p.error(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    opts = Options(
        duration=a.duration, seed=a.seed, workers=a.workers, concurrency=a.concurrency,
        tasks=a.tasks, keys=a.keys, broker=a.broker, backend=a.backend, store=a.store,
        ttl=a.ttl, vt=a.vt, fault_rate=a.fault_rate, settle=a.settle, kinds=kinds,
        workdir=a.workdir, quiet=a.quiet, chords=a.chords,
    )  # fmt: skip
    result = run(opts)
    print(result.table)
    print(f"wall time {result.wall:.0f}s; records in {result.workdir}")
    return 0 if result.ok else 1


sys.exit(main())
