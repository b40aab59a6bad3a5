"""Key derivation as a separate process sees it (tests/contract/test_key_properties.py).

``python -m tests.apps.keyprobe`` reads JSON cases on stdin and prints the
keys :class:`celery_lease.keys.KeySpec` derives for each, one JSON list per
line. The test runs it under several ``PYTHONHASHSEED`` values and compares
with the keys computed in the test process. Imports only ``celery_lease.keys``.

A case is ``{"template": str | None, "args": [...], "kwargs": {...}}``; values
``{"__set__": [...]}`` / ``{"__frozenset__": [...]}`` become sets (whose
iteration order depends on the hash seed), ``{"__tuple__": [...]}`` tuples.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from celery_lease.keys import KeySpec

TASK = "proj.probe"


def probe(self: Any, a: Any, b: Any = 0, *rest: Any, c: Any = None, **extra: Any) -> None:
    """The task signature every case is bound against."""


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__set__"}:
            return {decode(v) for v in value["__set__"]}
        if set(value) == {"__frozenset__"}:
            return frozenset(decode(v) for v in value["__frozenset__"])
        if set(value) == {"__tuple__"}:
            return tuple(decode(v) for v in value["__tuple__"])
        return {k: decode(v) for k, v in value.items()}
    return value


def keys_for(case: dict[str, Any]) -> list[str]:
    spec = KeySpec(TASK, probe, case["template"], bound=True)
    return spec.keys(decode(case["args"]), decode(case["kwargs"]))


def main() -> None:
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(keys_for(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
