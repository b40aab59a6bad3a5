"""Fail if git tracks an SQLite database file (a local run's leftover, not source).

Outside a git checkout (an unpacked sdist) there is nothing to check.
"""

from __future__ import annotations

import os
import subprocess
import sys

HEADER = b"SQLite format 3\x00"


def main() -> int:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    found = []
    for name in filter(None, out.decode().split("\0")):
        if os.path.isfile(name):
            with open(name, "rb") as fh:
                if fh.read(len(HEADER)) == HEADER:
                    found.append(name)
    for name in found:
        print(f"an SQLite database is tracked: {name!r} (git rm it)", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
