"""Results are JSON only and size-limited; a bad value fails before anything is written.

A value that cannot be stored raises before the commit touches the table or
the lease: the row count stays the same and the lease is still held by its
owner (so the task can fail cleanly, or return something storable, while it
still owns the key).
"""

from __future__ import annotations

import datetime as dt
import decimal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_lease import Lease, LeaseStore, ResultNotSerializable, ResultTooLarge
from celery_lease.results import MODES, ResultTable, encode_result
from celery_lease.sql import database
from tests.results_helpers import PAIRINGS, Pairing, make_pairing, new_key, result_rows

LONG_TTL = 30.0
MAX_BYTES = 256

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=PAIRINGS)
def pairing(request: pytest.FixtureRequest) -> Iterator[Pairing]:
    p = make_pairing(request, request.param, max_bytes=MAX_BYTES)
    assert p.table.max_bytes == MAX_BYTES
    yield p
    p.close()


def claim(p: Pairing, key: str) -> Lease:
    lease = p.store.claim(key, ttl=LONG_TTL, owner_id="owner-A")
    assert lease is not None
    p.table.register(lease)
    return lease


def assert_untouched(p: Pairing, lease: Lease, rows_before: list[Any]) -> None:
    assert result_rows(p.result_url, lease.key) == rows_before, "the table changed"
    record = p.store.inspect(lease.key)
    assert record is not None and record.live, f"the lease was released: {record}"
    assert (record.owner_id, record.token) == (lease.owner_id, lease.token)
    assert p.store.claim(lease.key, ttl=LONG_TTL, owner_id="someone-else") is None
    assert p.store.renew(lease) is True


NOT_JSON = [
    pytest.param(dt.datetime(2026, 11, 29, 12, 0), "datetime", id="datetime"),
    pytest.param({"when": dt.date(2026, 1, 1)}, "date", id="nested-date"),
    pytest.param({1, 2, 3}, "set", id="set"),
    pytest.param(b"bytes", "bytes", id="bytes"),
    pytest.param(decimal.Decimal("1.10"), "Decimal", id="decimal"),
    pytest.param(uuid.UUID(int=7), "UUID", id="uuid"),
    pytest.param({"score": float("nan")}, "float", id="nan"),
    pytest.param([float("inf")], "float", id="inf"),
    pytest.param({("tuple", "key"): 1}, "tuple", id="tuple-key"),
    pytest.param("lone surrogate \ud800", "surrogate", id="surrogate"),
    pytest.param({"log": "a\x00b"}, "NUL", id="nul-char"),  # PostgreSQL jsonb refuses it
]


@pytest.mark.parametrize(("value", "type_name"), NOT_JSON)
def test_encode_names_the_task_and_the_type(value: Any, type_name: str) -> None:
    with pytest.raises(ResultNotSerializable) as err:
        encode_result(value, task_name="proj.tasks.build_suite")
    message = str(err.value)
    assert "proj.tasks.build_suite" in message
    assert type_name in message, message
    assert isinstance(err.value, TypeError)  # a TypeError, as json.dumps would raise


@pytest.mark.parametrize(("value", "type_name"), [NOT_JSON[i] for i in (0, 1, 2, 6, 9, 10)])
def test_unserializable_result_writes_nothing_and_keeps_the_lease(
    pairing: Pairing, value: Any, type_name: str
) -> None:
    key = new_key("not-json")
    lease = claim(pairing, key)
    for mode in MODES:
        with pytest.raises(ResultNotSerializable) as err:
            pairing.table.commit(lease, value, mode=mode, task_name="proj.tasks.build_suite")
        assert "proj.tasks.build_suite" in str(err.value) and type_name in str(err.value)
        assert_untouched(pairing, lease, [])
    # Still the owner: a storable value is accepted afterwards.
    accepted = pairing.table.commit(lease, {"ok": True})
    assert accepted.token == lease.token and accepted.value == {"ok": True}


def test_oversized_result_names_the_limit_and_keeps_the_lease(pairing: Pairing) -> None:
    key = new_key("too-big")
    earlier = claim(pairing, key)
    pairing.table.commit(earlier, "small")
    rows_before = result_rows(pairing.result_url, key)
    lease = claim(pairing, key)
    big = {"blob": "x" * MAX_BYTES}
    for mode in MODES:
        with pytest.raises(ResultTooLarge) as err:
            pairing.table.commit(lease, big, mode=mode, task_name="proj.tasks.render")
        message = str(err.value)
        assert str(MAX_BYTES) in message and "proj.tasks.render" in message, message
        assert isinstance(err.value, ValueError)
        assert_untouched(pairing, lease, rows_before)
    # Exactly at the limit is fine (the limit counts UTF-8 bytes of the JSON).
    at_limit = "é" * ((MAX_BYTES - 2) // 2)
    assert len(encode_result(at_limit).encode()) <= MAX_BYTES
    accepted = pairing.table.commit(lease, at_limit)
    assert accepted.value == at_limit
    with pytest.raises(ResultTooLarge):
        encode_result("é" * (MAX_BYTES // 2), max_bytes=MAX_BYTES)


def test_default_limit_and_unlimited() -> None:
    with pytest.raises(ResultTooLarge, match=str(1024 * 1024)):
        encode_result("x" * (1024 * 1024))
    assert len(encode_result("x" * (1024 * 1024), max_bytes=0)) == 1024 * 1024 + 2


ROUND_TRIP = [
    pytest.param(None, id="none"),
    pytest.param(True, id="bool"),
    pytest.param(0, id="zero"),
    pytest.param(-(2**62), id="big-int"),
    pytest.param(3.25, id="float"),
    # A top-level number is the whole JSON text: SQLite's numeric affinity
    # would store it as an INTEGER or a REAL unless kept as written.
    pytest.param(2.0, id="integral-float"),
    pytest.param(-0.0, id="negative-zero"),
    pytest.param(2**80, id="int-beyond-64-bits"),
    pytest.param(1.5e-300, id="tiny-float"),
    pytest.param("", id="empty-string"),
    pytest.param("héllo wörld ✓ 日本語 🚀", id="unicode"),
    pytest.param('quotes " and \\ backslashes \n newlines \t\x01', id="escapes"),
    pytest.param("\\u0000 is six characters here", id="backslash-u0000"),
    pytest.param([], id="empty-list"),
    pytest.param({}, id="empty-dict"),
    pytest.param(
        {
            "suite": {"api": 42, "tests": [{"name": "auth", "ok": True, "score": 0.5}]},
            "notes": None,
            "ünïcode-kéy": ["a", 1, None, False, {"deep": {"deeper": [[], {}]}}],
        },
        id="nested",
    ),
]


@pytest.mark.parametrize("value", ROUND_TRIP)
def test_json_values_round_trip(pairing: Pairing, value: Any) -> None:
    key = new_key("round-trip")
    lease = claim(pairing, key)
    task_id = new_key("task")
    accepted = pairing.table.commit(lease, value, task_id=task_id)
    for got in (
        accepted,
        pairing.table.accepted(key),
        pairing.table.for_task(task_id),
        pairing.table.get(key, lease.token),
    ):
        assert got is not None
        assert got.value == value and type(got.value) is type(value), got
    assert [t for _, t, _ in result_rows(pairing.result_url, key)] == [lease.token]


@pytest.mark.parametrize("value", [1e16, -2.5e300, 1.2345678901234567e19])
def test_a_float_in_exponent_form_keeps_its_value(pairing: Pairing, value: float) -> None:
    """SQLite keeps the JSON text as written. PostgreSQL's jsonb keeps a
    number's value, not its spelling: a float Python writes in exponent form
    (1e16 and up) reads back as the int its digits name, which converts back
    to the same float (docs/result-backend.md says so)."""
    key = new_key("exponent")
    lease = claim(pairing, key)
    pairing.table.commit(lease, value)
    got = pairing.table.accepted(key)
    assert got is not None
    if database(pairing.result_url).is_sqlite:
        assert got.value == value and type(got.value) is float, got
    else:
        assert type(got.value) is int and float(got.value) == value, got


def test_result_table_on_its_own_database(sqlite_url: str) -> None:
    """A ResultTable built for reading only (no store) reads what was committed."""
    store = LeaseStore.from_url(sqlite_url)
    writer = ResultTable(sqlite_url, store)
    lease = store.claim("reader-key", ttl=LONG_TTL)
    assert lease is not None
    writer.commit(lease, {"x": ["y", None]})
    reader = ResultTable(sqlite_url)
    got = reader.accepted("reader-key")
    assert got is not None and got.value == {"x": ["y", None]}
    store.close()


def _spellings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Other spellings of ``tmp_path / 'lease.sqlite3'``, by name."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "link").symlink_to(tmp_path)
    monkeypatch.chdir(tmp_path)
    return {
        "relative": "sqlite:///lease.sqlite3",
        "dot-segments": f"sqlite:///{tmp_path}/sub/../lease.sqlite3",
        "symbolic-link": f"sqlite:///{tmp_path}/link/lease.sqlite3",
        "driver-named": f"sqlite+pysqlite:///{tmp_path}/lease.sqlite3",
    }


@pytest.mark.parametrize("spelling", ["relative", "dot-segments", "symbolic-link", "driver-named"])
def test_one_sqlite_file_spelt_two_ways_is_one_database(
    spelling: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leases and results in one SQLite file, its URL spelt differently in each
    setting, are leases in the result table's database: the commit is the one
    transaction. As two databases, the commit held the file's write lock while
    it released the lease over another connection to the same file, and waited
    on itself until the busy timeout, on every attempt."""
    canonical = f"sqlite:///{tmp_path / 'lease.sqlite3'}"
    other = _spellings(tmp_path, monkeypatch)[spelling]
    assert database(other) is database(canonical)
    store = LeaseStore.from_url(canonical)
    table = ResultTable(other, store)
    assert table.colocated
    lease = store.claim("spelt-key", ttl=LONG_TTL, owner_id="owner-A")
    assert lease is not None
    table.register(lease)
    accepted = table.commit(lease, {"spelling": spelling})
    assert accepted.token == lease.token
    record = store.inspect("spelt-key")
    assert record is not None and not record.live  # released in the commit
    store.close()
