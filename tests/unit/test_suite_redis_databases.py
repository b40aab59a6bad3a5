"""No test names a database number of the suite's shared Redis server.

Tests take ``fresh_redis()`` / ``redis_url`` (conftest.py): a database from the
rotation, emptied first. A number of a test's own is one the rotation also
hands out; used as a broker without emptying, it holds messages an earlier
test left, which a new worker runs before the test's own. Database 0 (also
``url()``) is no exception: outside the rotation and never emptied, it would
be shared by every test of the session that named it.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
NAMED = re.compile(r"redis_server\.url\(\d*\)")
#: files that empty the databases they name before using them
EMPTIED_FIRST = {"acceptance/test_task_basics.py", "acceptance/test_canvas.py"}


def test_no_test_names_a_database_of_the_shared_redis_server() -> None:
    named = [
        f"{path.relative_to(TESTS)}:{n}"
        for path in sorted(TESTS.rglob("*.py"))
        if str(path.relative_to(TESTS)) not in EMPTIED_FIRST
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if NAMED.search(line)
    ]
    assert named == [], f"use fresh_redis() instead of a database number: {named}"
