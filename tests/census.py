"""A census of what a worker process holds of celery-lease's: live objects of its
types, when ``tracemalloc`` is tracing the bytes still allocated from its files,
and the top-level packages the process has imported.

Run inside a pool process (the ``leaseapp.census`` task) and compared between two
points of a long drain: anything kept per task (a cache keyed by task id or key, a
list that is appended to, an object graph that outlives its task) shows as a count
or a size that grows with the number of tasks run in between.
"""

from __future__ import annotations

import gc
import os
import sys
import tracemalloc
from collections import Counter
from typing import Any

#: the package's own files, as tracemalloc names them
_OURS = f"*{os.sep}celery_lease{os.sep}*"


def take() -> dict[str, Any]:
    gc.collect()
    types: Counter[str] = Counter()
    for obj in gc.get_objects():
        cls = type(obj)
        module = getattr(cls, "__module__", None)
        if not isinstance(module, str):  # some C types' __module__ is a descriptor
            continue
        if module == "celery_lease" or module.startswith("celery_lease."):
            types[f"{module}.{cls.__qualname__}"] += 1
    traced: dict[str, int] = {}
    if tracemalloc.is_tracing():
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, _OURS)])
        for stat in snapshot.statistics("lineno"):
            frame = stat.traceback[0]
            module = frame.filename.rsplit(f"{os.sep}celery_lease{os.sep}", 1)[-1]
            traced[f"{module}:{frame.lineno}"] = stat.size
    packages = sorted({name.partition(".")[0] for name in list(sys.modules)})
    return {"pid": os.getpid(), "types": dict(types), "traced": traced, "packages": packages}


def growth(before: dict[str, Any], after: dict[str, Any], part: str) -> dict[str, int]:
    """What grew from ``before`` to ``after`` in ``part`` ("types" or "traced")."""
    a, b = before[part], after[part]
    return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if b.get(k, 0) > a.get(k, 0)}
