"""A census of what a worker process holds of celery-lease's: live objects of its
types, when ``tracemalloc`` is tracing the bytes still allocated from its files,
the top-level packages the process has imported, the size of glibc's heap, and
the objects of its types that only the cycle collector could free (reference
cycles: freed late, and in a long-running worker the heap grows meanwhile).

Run inside a pool process (the ``leaseapp.census`` task) and compared between two
points of a long drain: anything kept per task (a cache keyed by task id or key, a
list that is appended to, an object graph that outlives its task) shows as a count
or a size that grows with the number of tasks run in between.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import tracemalloc
from collections import Counter
from typing import Any

#: the package's own files, as tracemalloc names them
_OURS = f"*{os.sep}celery_lease{os.sep}*"


def take(hold_cycles: bool = False) -> dict[str, Any]:
    """The census. ``hold_cycles``: then switch the automatic cycle collector off
    until the next census, so that it finds every reference cycle made in
    between (with it on, most are freed young and only a few are ever seen)."""
    cycles = _cycles()
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
    if tracemalloc.is_tracing() and os.environ.get("CL_CENSUS_ALL") == "1":
        everything = tracemalloc.take_snapshot().statistics("lineno")
        traced["*"] = {f"{s.traceback[0].filename}:{s.traceback[0].lineno}": s.size
                       for s in everything[:400]}  # fmt: skip
    heap = _heap()
    packages = sorted({name.partition(".")[0] for name in list(sys.modules)})
    if hold_cycles:
        gc.disable()
    else:
        gc.enable()
    return {
        "pid": os.getpid(),
        "types": dict(types),
        "traced": traced,
        "packages": packages,
        "heap": heap,
        "cycles": cycles,
    }


def _cycles() -> dict[str, int]:
    """celery-lease's objects in unreachable reference cycles, by type: what a
    collection now frees (``DEBUG_SAVEALL`` keeps them in ``gc.garbage`` to count)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found: Counter[str] = Counter()
        for obj in gc.garbage:
            module = getattr(type(obj), "__module__", None)
            if isinstance(module, str) and module.startswith("celery_lease"):
                found[f"{module}.{type(obj).__qualname__}"] += 1
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return dict(found)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost",
    )]  # fmt: skip


def _heap() -> dict[str, int]:
    """glibc's main heap: bytes taken from the system (``arena``) and in use
    (``uordblks``); memory freed but kept shows as the first growing alone."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc before 2.33
        return {}
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return {"arena": int(info.arena), "in_use": int(info.uordblks), "rss_kb": _rss_kb()}


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def growth(before: dict[str, Any], after: dict[str, Any], part: str) -> dict[str, int]:
    """What grew from ``before`` to ``after`` in ``part`` ("types" or "traced")."""
    a, b = before[part], after[part]
    return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if b.get(k, 0) > a.get(k, 0)}
