"""The grant logs the failover contenders write (tests/etcd_contender.py,
tests/ha_contender.py: one JSON line per grant, with the key, the token and
when the contender entered and left its work), and the check that reads them:
no two grants of one key worked at once.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["overlaps", "read_logs"]


def read_logs(paths: list[Path]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in paths:
        if path.exists():
            rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def overlaps(grants: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Pairs of grants of one key whose [enter, leave] intervals intersect."""
    found = []
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for g in grants:
        by_key[g["key"]].append(g)
    for rows in by_key.values():
        rows.sort(key=lambda g: g["enter"])
        busy_until: dict[str, Any] | None = None
        for g in rows:
            if busy_until is not None and g["enter"] < busy_until["leave"]:
                found.append((busy_until, g))
            if busy_until is None or g["leave"] > busy_until["leave"]:
                busy_until = g
    return found
