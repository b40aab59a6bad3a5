"""Default lease keys of arguments Celery's JSON serializer carries beyond JSON.

A default key is the task name and the SHA-256 of the canonical JSON of the
bound arguments. Celery (kombu) also sends UUID, datetime, date, time, Decimal
and bytes arguments, in a ``{"__type__", "__value__"}`` envelope it decodes
back on receipt. Pinned here:

* literal keys, for plain JSON arguments (the keys of the releases before this
  one: they must never change) and for each extra type (its documented form);
* the key a client derives from its arguments equals the key derived from the
  same arguments after Celery's own JSON serializer sent them (what a worker
  computes from the decoded message), for generated argument values;
* a type neither JSON nor Celery's serializer carries is still refused, naming
  the way out (``lease_key``).
"""

from __future__ import annotations

import datetime
import decimal
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kombu.serialization import dumps, loads

from celery_lease import LeaseConfigError
from celery_lease.keys import KeySpec, canonical_json


def _task(a: Any, b: Any = None, *rest: Any, **kw: Any) -> None:
    """The signature the pinned keys are derived over."""


SPEC = KeySpec("proj.charge", _task, None, bound=False)

UTC = datetime.timezone.utc

#: (args, kwargs) -> the key; a changed entry breaks every deployed lease and result.
PINNED: list[tuple[tuple[Any, ...], dict[str, Any], str]] = [
    # plain JSON: the same keys as every release before the extra types
    ((1,), {}, "70eddfffd3c71bc02b00098cc3eac229739dbb06b2b4855586b367573261d2ce"),
    (
        ("x", {"z": [1, 2.5, None, True], "a": "é"}),
        {},
        "5e3d7990ebb30dfd7186f9a07974ae6f19da6f758d92e6f9fa5ac196a8edfb56",
    ),
    ((1, 2, 3), {"k": "v"}, "3486796ea53d7f5ade8b913d61b1c5649b8fd6647ab050c9c0a9b1a4c3213832"),
    # the types Celery's JSON serializer adds
    (
        (uuid.UUID("12345678-1234-5678-1234-567812345678"),),
        {},
        "a3460ff7512272c15c3307551482fb98f68a24a2f973cb254aeb3c61eb7a8c16",
    ),
    (
        (datetime.datetime(2024, 2, 29, 23, 59, 58, 123456, tzinfo=UTC),),
        {},
        "e9bced52584a96592839e4a257f96902733d6e034842e908543f4f2e8d98a1c4",
    ),
    (
        (datetime.datetime(2024, 2, 29, 12, 0),),
        {},
        "3f6c5fce72bc65d2f466de4595779dfbca9c2f8f86553dac37f948c3c6398d01",
    ),
    (
        (datetime.date(2024, 2, 29), decimal.Decimal("10.50")),
        {},
        "d5d6599409b1b30a6ac0e5c359a4c71d66b0b741b8ca10fe65e3a2f36a1b0552",
    ),
    (
        (datetime.time(8, 30),),
        {"k": b"raw", "z": b"\xff"},
        "c7bef7886aa98fb6a3ad8a6d31d91fe77cc1167b8f9bc3c8be0a203d0ea26df8",
    ),
]


@pytest.mark.parametrize(("args", "kwargs", "digest"), PINNED)
def test_default_keys_are_pinned(
    args: tuple[Any, ...], kwargs: dict[str, Any], digest: str
) -> None:
    assert SPEC.keys(args, kwargs) == [f"proj.charge:{digest}"]


def test_the_canonical_form_of_each_type_is_the_documented_one() -> None:
    """The README's table, literally."""
    value = {
        "u": uuid.UUID("12345678-1234-5678-1234-567812345678"),
        "dt": datetime.datetime(
            2024, 2, 29, 12, 0, tzinfo=datetime.timezone(datetime.timedelta(hours=1))
        ),
        "d": datetime.date(2024, 2, 29),
        "t": datetime.time(8, 30, 0, 5),
        "m": decimal.Decimal("1.50"),
        "b": b"raw",
        "x": b"\xff\x00",
    }
    assert canonical_json(value) == (
        '{"b":{"__type__":"bytes","__value__":"raw"},'
        '"d":{"__type__":"date","__value__":"2024-02-29"},'
        '"dt":{"__type__":"datetime","__value__":"2024-02-29T12:00:00+01:00"},'
        '"m":{"__type__":"decimal","__value__":"1.50"},'
        '"t":{"__type__":"time","__value__":"08:30:00.000005"},'
        '"u":{"__type__":"uuid","__value__":{"hex":"12345678123456781234567812345678"}},'
        '"x":{"__type__":"base64","__value__":"/wA="}}'
    )


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63),
    st.text(max_size=8),
    st.uuids(),
    st.datetimes(timezones=st.none() | st.timezones()),
    st.dates(),
    st.times(),
    st.decimals(allow_nan=False, allow_infinity=False),
    st.binary(max_size=8),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(a=values, b=values)
def test_the_key_survives_celerys_json_serializer(a: Any, b: Any) -> None:
    """The client's key equals the key of the arguments as the worker decodes them."""
    content_type, encoding, body = dumps(((a, b), {}), serializer="json")
    args, kwargs = loads(body, content_type, encoding)
    assert SPEC.keys(args, kwargs) == SPEC.keys((a, b), {})


def test_other_types_are_still_refused_naming_lease_key() -> None:
    with pytest.raises(LeaseConfigError, match="give the task a lease_key"):
        SPEC.keys((object(),), {})
    with pytest.raises(LeaseConfigError, match="not JSON serializable"):
        SPEC.keys(({1, 2},), {})
