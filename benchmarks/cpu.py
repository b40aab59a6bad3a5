"""CPU accounting: which processes spent the machine's CPU during a drain."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_cpu() -> tuple[float, float]:
    """(busy, iowait) CPU seconds since boot, all cores (``/proc/stat``)."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...
    busy = sum(fields[:3]) + sum(fields[5:8])
    return busy / _TICK, fields[4] / _TICK


def _group_cpu(groups: dict[str, set[int]]) -> dict[str, float]:
    """CPU seconds (user + system, with reaped children) by named groups of
    processes: a process belongs to a group that names its process group, its
    parent or itself (PostgreSQL's backends each start a session of their own,
    so they are found as the postmaster's children)."""
    out = dict.fromkeys(groups, 0.0)
    owner = {pid: name for name, pids in groups.items() for pid in pids}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                stat = fh.read()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        rest = stat[stat.rfind(")") + 2 :].split()
        for pid in (int(entry.name), int(rest[1]), int(rest[2])):  # itself, parent, group
            name = owner.get(pid)
            if name is not None:
                out[name] += sum(int(x) for x in rest[11:15]) / _TICK  # utime stime cutime cstime
                break
    return out


class CpuSampler:
    """Samples, every ``interval`` s, the CPU time of named process groups and of
    the whole machine; :meth:`between` interpolates the counters at two instants
    (e.g. a drain's first and last completion, whose timestamps the workers write).
    Linux only; elsewhere :meth:`between` returns None."""

    def __init__(self, groups: dict[str, set[int]], interval: float = 0.1) -> None:
        self.groups = {name: set(pgids) for name, pgids in groups.items()}
        self.interval = interval
        #: name -> pid: that one process's own CPU (no children), e.g. a worker's
        #: main process apart from its pool processes
        self.alone: dict[str, int] = {}
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, name: str, pgid: int) -> None:
        with self._lock:
            self.groups.setdefault(name, set()).add(pgid)

    def watch_alone(self, name: str, pid: int) -> None:
        with self._lock:
            self.alone[name] = pid

    def _sample(self) -> None:
        with self._lock:
            groups = {name: set(p) for name, p in self.groups.items()}
            alone = dict(self.alone)
        t = time.time()
        values = _group_cpu(groups)
        for name, pid in alone.items():
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/stat") as fh:
                    rest = fh.read().rsplit(")", 1)[1].split()
                values[name] = (int(rest[11]) + int(rest[12])) / _TICK  # utime stime
        values["machine"], values["iowait"] = _machine_cpu()
        self.samples.append((t, values))

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval):
                self._sample()
                return

    def start(self) -> CpuSampler:
        if os.path.exists("/proc/stat"):
            self._thread = threading.Thread(target=self._run, name="bench-cpu", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def between(self, t0: float, t1: float) -> dict[str, float] | None:
        """CPU seconds each group (and ``machine``: all processes, ``iowait``) spent
        from ``t0`` to ``t1``, counters interpolated linearly between samples."""
        s = self.samples
        if len(s) < 2 or not (s[0][0] <= t0 < t1 <= s[-1][0]):
            return None
        # a group's first sample may predate its processes: counters only grow
        return {name: self._at(t1, name) - self._at(t0, name) for name in s[-1][1]}

    def _at(self, t: float, name: str) -> float:
        s = self.samples
        for (ta, va), (tb, vb) in itertools.pairwise(s):
            if ta <= t <= tb:
                a, b = va.get(name, 0.0), vb.get(name, 0.0)
                return a + (b - a) * ((t - ta) / (tb - ta) if tb > ta else 0.0)
        raise ValueError(f"{t} outside the samples")
