"""Fixtures the result-table contract modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_lease.results import MODES
from tests.results_helpers import PAIRINGS, Pairing, make_pairing


@pytest.fixture(params=PAIRINGS)
def pairing(request: pytest.FixtureRequest) -> Iterator[Pairing]:
    """Each pairing of lease store and result database on the session's servers."""
    p = make_pairing(request, request.param)
    yield p
    p.close()


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)
