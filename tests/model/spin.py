"""Build and run the Promela model (``model/``) with spin and pan; parse what pan says.

One :func:`check` is one verification: ``spin -a`` generates pan's C source
from ``model/<config>.pml`` with the given ``-D`` macros, gcc compiles it,
pan searches, and a trail (if pan wrote one) is replayed with ``spin -t`` to
the trace's events (the model's ``printf("@ ...")`` lines). Every command
runs under ``nice -n 19``: the checks share the machine with timing-sensitive
runs. Usable by hand too::

    python -m tests.model.spin redis            # the default check of one configuration
    python -m tests.model.spin redis -DMUT_A    # a mutation
"""

from __future__ import annotations

import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "model"
CONFIGS = ("redis", "etcd", "colocated")

#: pan refuses to grow past this (MB) instead of taking the machine's memory
#: (the checks share it with timing-sensitive runs).
MEMLIM_MB = 2048
NICE = ("nice", "-n", "19")


@dataclass
class Result:
    config: str
    defines: tuple[str, ...]
    output: str
    trail: list[str] = field(default_factory=list)
    cpu_seconds: float = 0.0

    def _number(self, pattern: str) -> float | None:
        m = re.search(pattern, self.output)
        return float(m.group(1)) if m else None

    @property
    def errors(self) -> int:
        n = self._number(r"errors: (\d+)")
        if n is None:
            raise AssertionError(f"pan printed no error count:\n{self.output}")
        return int(n)

    @property
    def stored(self) -> int:
        return int(self._number(r"([\d.e+]+) states, stored") or 0)

    @property
    def matched(self) -> int:
        return int(self._number(r"([\d.e+]+) states, matched") or 0)

    @property
    def depth(self) -> int:
        return int(self._number(r"depth reached (\d+)") or 0)

    @property
    def memory_mb(self) -> float:
        return self._number(r"([\d.]+)\s+total actual memory usage") or 0.0

    @property
    def exhaustive(self) -> bool:
        """The whole state space was explored: no error stopped it, no depth or
        memory limit cut it short."""
        cut = ("max search depth too small", "Search not completed", "out of memory", "MEMLIM")
        return self.errors == 0 and not any(c in self.output for c in cut)

    @property
    def violated(self) -> str | None:
        """The property pan reports violated (model/props.pml names), or what else stopped it."""
        reports = "\n".join(re.findall(r"^pan:\d+: .*$", self.output, flags=re.M))
        m = re.search(r"assertion violated\s+!\(viol_(\w+)\)", reports)
        if m:
            return m.group(1)
        for kind, name in (
            ("acceptance cycle", "settles"),
            ("invalid end state", "invalid end state"),
        ):
            if kind in reports:
                return name
        return "model assertion" if "assertion violated" in reports else None

    def figures(self) -> str:
        return (
            f"{self.config} {' '.join(self.defines)}: {self.stored:,} states stored, "
            f"{self.matched:,} matched, depth {self.depth}, {self.memory_mb:,.0f} MB, "
            f"{self.cpu_seconds:.1f} s CPU (generate, compile, search)"
        )


def tools() -> list[str]:
    """The tools a check needs that are missing."""
    return [t for t in ("spin", "gcc") if shutil.which(t) is None]


def _run(cmd: list[str], cwd: Path, timeout: float) -> str:
    out = subprocess.run(
        [*NICE, *cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    text = out.stdout + out.stderr
    if out.returncode != 0 and cmd[0] != "./pan":
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{text}")
    return text


def check(
    config: str,
    defines: tuple[str, ...] | list[str] = (),
    *,
    liveness: bool = False,
    bfs: bool = False,
    collapse: bool = False,
    optimize: str = "-Og",
    timeout: float = 900.0,
) -> Result:
    """Verify ``model/<config>.pml`` with ``-D`` ``defines``: safety (assertions,
    invalid end states), or with ``liveness`` the ``settles`` claim under weak
    fairness; ``bfs`` finds the shortest counterexample; ``collapse`` stores
    states compressed (pan -DCOLLAPSE: about half the memory, a little slower)."""
    defines = tuple(defines) + (("LIVENESS",) if liveness else ())
    flags = [f"-D{d}" for d in defines]
    started = time.process_time()
    children = _children_cpu()
    with tempfile.TemporaryDirectory(prefix=f"model-{config}-") as tmp:
        work = Path(tmp)
        for pml in MODEL.glob("*.pml"):
            shutil.copy(pml, work / pml.name)
        _run(["spin", *flags, "-a", f"{config}.pml"], work, timeout)
        cc = ["gcc", optimize, "-DNOBOUNDCHECK", f"-DMEMLIM={MEMLIM_MB}", "-o", "pan", "pan.c"]
        if not liveness:
            cc.insert(2, "-DSAFETY")
        if bfs:
            cc.insert(2, "-DBFS")
        if collapse:
            cc.insert(2, "-DCOLLAPSE")
        _run(cc, work, timeout)
        search = ["./pan", "-m2000000"] + (["-a", "-f"] if liveness else [])
        output = _run(search, work, timeout)
        result = Result(config, defines, output)
        if (work / f"{config}.pml.trail").exists():
            replay = _run(["spin", *flags, "-t", f"{config}.pml"], work, timeout)
            result.trail = [
                line.strip()[2:] for line in replay.splitlines() if line.strip().startswith("@ ")
            ]
    result.cpu_seconds = time.process_time() - started + _children_cpu() - children
    return result


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str]) -> int:
    config, defines = argv[0], [a.removeprefix("-D") for a in argv[1:]]
    result = check(config, defines)
    print(result.output)
    print("\n".join(result.trail))
    print(result.figures())
    return 0 if result.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
