"""The failover tests' overlap detector (tests/grant_log.py) finds an overlap
when there is one: the check their verdict rests on can fail."""

from __future__ import annotations

from tests.grant_log import overlaps


def test_the_detector_catches_an_overlap() -> None:
    ok = [
        {"key": "k", "token": 1, "enter": 0.0, "leave": 1.0},
        {"key": "k", "token": 2, "enter": 1.5, "leave": 2.0},
        {"key": "j", "token": 3, "enter": 0.5, "leave": 1.6},
    ]
    assert overlaps(ok) == []
    bad = [*ok, {"key": "k", "token": 4, "enter": 0.2, "leave": 0.3}]
    assert [(a["token"], b["token"]) for a, b in overlaps(bad)] == [(1, 4)]
