"""cProfile readings: where a task's time goes, by package and by function."""

from __future__ import annotations

import contextlib
import cProfile
import pstats
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.report import Table

_CATEGORIES = (
    ("celery_lease", "celery-lease (own code)"),
    ("sqlalchemy", "SQLAlchemy"),
    ("psycopg", "psycopg"),
    ("redis", "redis-py"),
    ("kombu", "kombu (broker)"),
    ("celery", "Celery"),
    ("billiard", "billiard"),
    ("alembic", "alembic"),
    ("prometheus_client", "prometheus-client"),
    ("sqlite3", "sqlite3"),
)


def _category(filename: str, funcname: str) -> str:
    if filename == "~":
        lowered = funcname.lower()
        if "sqlite3" in lowered:
            return "sqlite3 C calls (SQLite work, fsync at COMMIT)"
        if "sleep" in lowered:
            return "time.sleep"
        if any(
            w in lowered
            for w in ("recv", "send", "select", "poll", "connect", "sendall", "read", "write")
        ):
            return "sockets / poll / file I/O (waiting on servers)"
        return "builtins"
    parts = Path(filename).parts
    for marker, label in _CATEGORIES:
        if marker in parts or any(p.startswith(marker) for p in parts[-3:]):
            return label
    if "benchmarks" in parts:
        return "benchmark harness"
    return "stdlib / other"


def profile_summary(stats: pstats.Stats, per: int, unit: str = "task", top: int = 8) -> str:
    """A markdown summary of self time by package, and the heaviest functions."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values()) or 1e-9
    by_cat: dict[str, float] = {}
    for (filename, _line, func), (_cc, _nc, tt, _ct, _callers) in raw.items():
        cat = _category(filename, func)
        by_cat[cat] = by_cat.get(cat, 0.0) + tt
    lines = [
        f"Self time by package (cProfile; {per} {unit}s; µs per {unit}, share of profiled time):",
        "",
        f"| package | µs per {unit} | share |",
        "|---|---:|---:|",
    ]
    for cat, tt in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        if tt / total < 0.01:
            continue
        lines.append(f"| {cat} | {tt / per * 1e6:,.0f} | {tt / total:.0%} |")
    lines += [
        "",
        f"Heaviest functions by cumulative time (µs per {unit}, calls per {unit}):",
        "",
        f"| function | cumulative µs per {unit} | calls per {unit} |",
        "|---|---:|---:|",
    ]
    ranked = sorted(raw.items(), key=lambda kv: -kv[1][3])
    shown = 0
    for (filename, line, func), (_cc, nc, _tt, ct, _callers) in ranked:
        if not any(m in filename for m in ("celery_lease", "sqlalchemy", "psycopg", "redis")):
            continue
        where = _short_path(filename)
        lines.append(f"| `{where}:{line}({func})` | {ct / per * 1e6:,.0f} | {nc / per:.1f} |")
        shown += 1
        if shown >= top:
            break
    return "\n".join(lines)


def _short_path(filename: str) -> str:
    parts = Path(filename).parts
    for i, p in enumerate(parts):
        if p in ("celery_lease", "sqlalchemy", "psycopg", "redis", "kombu", "celery"):
            return "/".join(parts[i:])
    return Path(filename).name


@contextlib.contextmanager
def profiled() -> Iterator[cProfile.Profile]:
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield prof
    finally:
        prof.disable()


def profile_compare(profiles: dict[str, tuple[pstats.Stats, int]], unit: str = "task") -> str:
    """Self time by package, µs per ``unit``, one column per profiled contender."""
    cats: dict[str, dict[str, float]] = {}
    totals: dict[str, float] = {}
    for name, (stats, per) in profiles.items():
        raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
        for (filename, _line, func), (_cc, _nc, tt, _ct, _callers) in raw.items():
            cat = _category(filename, func)
            cats.setdefault(cat, {})
            cats[cat][name] = cats[cat].get(name, 0.0) + tt / per
        totals[name] = sum(v[2] for v in raw.values()) / per
    names = list(profiles)
    table = Table(["package (self time)", *[f"{n}: µs per {unit}" for n in names]])
    for cat, per_name in sorted(cats.items(), key=lambda kv: -max(kv[1].values())):
        if max(per_name.values()) < 0.01 * max(totals.values()):
            continue
        table.add(cat, *[f"{per_name.get(n, 0.0) * 1e6:,.0f}" for n in names])
    table.add("**total profiled**", *[f"**{totals[n] * 1e6:,.0f}**" for n in names])
    return table.markdown()


def top_functions(
    stats: pstats.Stats, per: int, marker: str, unit: str = "task", top: int = 10
) -> str:
    """The heaviest functions (cumulative) whose file path contains ``marker``."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    table = Table([f"function ({marker})", f"cumulative µs per {unit}", f"calls per {unit}"])
    ranked = sorted(raw.items(), key=lambda kv: -kv[1][3])
    for (filename, line, func), (_cc, nc, _tt, ct, _callers) in ranked:
        if marker not in filename:
            continue
        table.add(
            f"`{_short_path(filename)}:{line}({func})`", f"{ct / per * 1e6:,.0f}", f"{nc / per:.1f}"
        )
        if len(table.rows) >= top:
            break
    return table.markdown()


def by_package(stats: pstats.Stats, per: int) -> dict[str, float]:
    """Self time per package, seconds per unit."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for (filename, _line, func), (_cc, _nc, tt, _ct, _callers) in raw.items():
        cat = _category(filename, func)
        out[cat] = out.get(cat, 0.0) + tt / per
    return out


def cumulative(stats: pstats.Stats, per: int, path_part: str, func: str) -> float | None:
    """Cumulative seconds per unit of ``func`` in files whose path contains ``path_part``;
    None if no such function ran under the profile (a renamed or moved one reads as
    missing, never as 0)."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    found = [v[3] for (f, _l, fn), v in raw.items() if fn == func and path_part in f]
    return sum(found) / per if found else None
