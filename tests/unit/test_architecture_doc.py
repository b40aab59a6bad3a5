"""ARCHITECTURE.md names every module of the package, so the map matches the tree.

A module is named by its file name (``etcd_marks.py``) or by a pattern the
map uses (``metrics*.py``).
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_lease"


def unnamed_modules(text: str) -> list[str]:
    names = set(re.findall(r"[\w*]+\.py", text))
    return [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "__init__.py" and not any(fnmatch.fnmatch(path.name, n) for n in names)
    ]


def test_architecture_names_every_module() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    assert unnamed_modules(text) == []
