"""Work around a libfaketime 0.9.10 bug in workers started under ``faketime``.

With ``FAKETIME_DONT_FAKE_MONOTONIC=1``, libfaketime 0.9.10 answers
``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, ...)`` with ``EINVAL``; and
CPython 3.11+ implements ``time.sleep`` with exactly that call, so every
``time.sleep`` in a skewed worker (Celery's, kombu's, celery-lease's, the
task body's) raised ``OSError(22)``. The chaos suite prepends this directory
to ``PYTHONPATH`` of skewed workers only: ``time.sleep`` falls back to
``select()`` (a relative timeout, which libfaketime leaves alone) on that
error. The clocks themselves stay as libfaketime makes them: wall clock
skewed, ``CLOCK_MONOTONIC`` true.
"""

from __future__ import annotations

import errno
import select
import time

_sleep = time.sleep


def _sleep_despite_libfaketime(seconds: float) -> None:
    try:
        _sleep(seconds)
    except OSError as e:
        if e.errno != errno.EINVAL or seconds < 0:
            raise
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            select.select([], [], [], left)


time.sleep = _sleep_despite_libfaketime
