"""celery-lease benchmarks: cost per lease operation and per task, next to the peers.

Run them all with ``python -m benchmarks [--quick] [--only NAME] [--out BENCHMARKS.md]``.
Every benchmark interleaves its contenders (A, B, A, B, ...) and reports
medians and ratios to a baseline measured in the same run, because the
machine is shared. Nothing here asserts anything about speed.
"""
