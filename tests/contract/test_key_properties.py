"""Property tests of key derivation and tenant scoping (no servers).

* :class:`celery_lease.keys.KeySpec` derives the same keys whatever the
  argument style (positional or keyword, keyword order, dict key order, set
  order), and the same keys in other processes under other ``PYTHONHASHSEED``
  values (``tests/apps/keyprobe.py`` run as a subprocess);
* :func:`celery_lease.keys.scoped` is injective: no two (key, tenant) pairs,
  scoped or not, give one store key;
* :func:`celery_lease.keys.shorten` is deterministic, bounded, and keeps
  distinct keys distinct.

Each real store against a model: test_store_model.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_lease import LeaseConfigError
from celery_lease.keys import (
    MAX_KEY_LENGTH,
    KeySpec,
    canonical_json,
    has_unstorable,
    scoped,
    shorten,
)
from tests.apps import keyprobe

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------

#: Text that provokes collisions in a naive encoding: separators, digits, "t/".
tricky_text = st.text(alphabet="ab:/t0123~{}%_*\\'\" é😀\x00\udc00", min_size=0, max_size=12)
names = st.text(alphabet="abcdefgh", min_size=1, max_size=6)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


def _spec(template: str | None) -> KeySpec:
    return KeySpec(keyprobe.TASK, keyprobe.probe, template, bound=True)


def _shuffled_dict(d: dict[str, Any], rnd: Any) -> dict[str, Any]:
    items = list(d.items())
    rnd.shuffle(items)
    return {k: _shuffled(v, rnd) for k, v in items}


def _shuffled(value: Any, rnd: Any) -> Any:
    if isinstance(value, dict):
        return _shuffled_dict(value, rnd)
    if isinstance(value, list):
        return [_shuffled(v, rnd) for v in value]
    return value


# --------------------------------------------------------------------------
# key derivation
# --------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    a=json_values,
    b=json_values,
    c=json_values,
    extra=st.dictionaries(st.sampled_from(["x", "y", "z"]), json_values, max_size=3),
    rnd=st.randoms(),
)
def test_key_ignores_argument_style_and_dict_order(
    a: Any, b: Any, c: Any, extra: dict[str, Any], rnd: Any
) -> None:
    """Positional vs keyword, keyword order, dict key order: one key, for every template."""
    for template in (None, "k-{a}-{b}", "k-{c}|{a}"):
        spec = _spec(template)
        reference = spec.keys((a, b), {"c": c, **extra})
        kwargs = {"a": a, "b": b, "c": c, **extra}
        items = list(kwargs.items())
        rnd.shuffle(items)
        as_kwargs = dict(items)
        assert spec.keys((), as_kwargs) == reference
        assert spec.keys((a,), {k: v for k, v in as_kwargs.items() if k != "a"}) == reference
        # the same values, every dict rebuilt in another key order
        assert (
            spec.keys(
                (_shuffled(a, rnd), _shuffled(b, rnd)), _shuffled_dict({"c": c, **extra}, rnd)
            )
            == reference
        )


@settings(max_examples=100, deadline=None)
@given(a=json_values, b=json_values)
def test_default_key_is_the_task_name_and_the_sha256_of_canonical_json(a: Any, b: Any) -> None:
    """An independent computation of the documented default key (so it cannot drift)."""
    [key] = _spec(None).keys((a, b), {})
    blob = json.dumps(
        {"a": a, "b": b, "c": None, "rest": []},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    assert blob == canonical_json({"a": a, "b": b, "c": None, "rest": []})
    assert key == f"{keyprobe.TASK}:{hashlib.sha256(blob.encode()).hexdigest()}"


def test_a_template_renders_dicts_and_sets_in_a_fixed_order() -> None:
    spec = _spec("k-{a}-{b}")
    one = spec.keys(({"y": 1, "x": [{"q": 1, "p": 2}]}, {"beta", "alpha"}), {})
    two = spec.keys(({"x": [{"p": 2, "q": 1}], "y": 1}, {"alpha", "beta"}), {})
    assert one == two == ["k-{'x': [{'p': 2, 'q': 1}], 'y': 1}-{'alpha', 'beta'}"]
    # attribute and item access in a template still see the real values
    assert _spec("k-{a[x]}").keys(({"x": 5},), {}) == ["k-5"]


def _encode(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        tag = "__set__" if isinstance(value, set) else "__frozenset__"
        return {tag: [_encode(v) for v in value]}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


string_sets = st.sets(st.text(alphabet="abcdefghij", min_size=1, max_size=5), max_size=6)
probe_values = (
    json_values
    | string_sets
    | st.frozensets(st.text(max_size=3), max_size=4)
    | (st.tuples(st.integers(), st.text(max_size=3)))
)
probe_cases = st.fixed_dictionaries(
    {
        "template": st.sampled_from([None, "k-{a}", "k-{a}/{b}", "k-{b}-{c}"]),
        "args": st.lists(probe_values, min_size=1, max_size=3),
        "kwargs": st.dictionaries(st.sampled_from(["c", "x", "yy"]), probe_values, max_size=2),
    }
).filter(lambda case: case["template"] is not None or not _has_set(case))


def _has_set(value: Any) -> bool:
    if isinstance(value, (set, frozenset)):
        return True
    if isinstance(value, dict):
        return any(_has_set(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_set(v) for v in value)
    return False


def _keys_in_subprocess(cases: list[dict[str, Any]], seed: str) -> list[list[str]]:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "tests.apps.keyprobe"],
        input="".join(json.dumps(_encode(c)) + "\n" for c in cases),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines()]


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases=st.lists(probe_cases, min_size=40, max_size=40))
def test_keys_are_the_same_in_other_processes_and_hash_seeds(
    cases: list[dict[str, Any]],
) -> None:
    """Sets of strings iterate in a hash-seed-dependent order: the keys must not."""
    here = [keyprobe.keys_for(json.loads(json.dumps(_encode(c)))) for c in cases]
    for seed in ("0", "4242"):
        assert _keys_in_subprocess(cases, seed) == here, f"PYTHONHASHSEED={seed}"


def test_set_order_really_differs_between_the_seeds_used() -> None:
    """The seed comparison above is meaningful: the set's raw order does change."""
    code = "print(list({'alpha','beta','gamma','delta','eps','zeta'}))"
    orders = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("0", "4242")
    }
    assert len(orders) == 2, orders


# --------------------------------------------------------------------------
# tenant scoping and shortening
# --------------------------------------------------------------------------


def _scoped_or_none(key: str, tenant: str | None) -> str | None:
    try:
        return scoped(key, tenant)
    except LeaseConfigError:
        return None  # a refused pair (unscoped "t/..." key, empty tenant, NUL in a tenant)


@settings(max_examples=400, deadline=None)
@given(
    k1=tricky_text.filter(bool),
    t1=st.none() | tricky_text,
    k2=tricky_text.filter(bool),
    t2=st.none() | tricky_text,
)
def test_scoped_is_injective(k1: str, t1: str | None, k2: str, t2: str | None) -> None:
    s1, s2 = _scoped_or_none(k1, t1), _scoped_or_none(k2, t2)
    if s1 is not None and s2 is not None and (k1, t1) != (k2, t2):
        assert s1 != s2, (k1, t1, k2, t2)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (("a:b", "c"), ("a", "b:c")),
        (("b/c", "a"), ("c", "a/b")),
        (("c", "a/b"), ("b/c", "a")),
        (("x", "1:a"), ("a/x", "1")),
        (("t/1:a/x", None), ("x", "a")),  # refused: unscoped keys cannot pose as scoped
        (("k", "acme"), ("k", None)),
        (("k", "acme"), ("k", "ACME")),
    ],
)
def test_scoped_examples_stay_apart(
    one: tuple[str, str | None], other: tuple[str, str | None]
) -> None:
    assert _scoped_or_none(*one) != _scoped_or_none(*other)
    assert _scoped_or_none(*other) is not None


def test_scoped_refuses_what_would_break_the_encoding() -> None:
    with pytest.raises(LeaseConfigError, match=r"reserved for tenant scopes"):
        scoped("t/3:abc/k", None)
    with pytest.raises(LeaseConfigError, match=r"a tenant is a non-empty string"):
        scoped("k", "")
    with pytest.raises(LeaseConfigError, match=r"a tenant is a non-empty string"):
        scoped("k", 7)  # type: ignore[arg-type]
    with pytest.raises(LeaseConfigError, match=r"NUL or a lone surrogate"):
        scoped("k", "a\x00b")


long_text = st.text(min_size=MAX_KEY_LENGTH - 5, max_size=MAX_KEY_LENGTH * 3)


@settings(max_examples=200, deadline=None)
@given(key=st.text(min_size=1, max_size=20) | long_text | tricky_text.filter(bool))
def test_shorten_is_deterministic_bounded_and_storable(key: str) -> None:
    short = shorten(key)
    assert short == shorten(key)
    assert len(short) <= MAX_KEY_LENGTH
    short.encode("utf-8")  # no lone surrogate left
    assert "\x00" not in short
    assert shorten(short) == short  # idempotent: stores apply it again
    if len(key) <= MAX_KEY_LENGTH and not has_unstorable(key):
        assert short == key  # a storable key is kept as given
    else:
        # a readable prefix (NUL and surrogates replaced), then the hash of the whole key
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        head = "".join("\ufffd" if has_unstorable(ch) else ch for ch in key[: MAX_KEY_LENGTH - 66])
        assert short == f"{head}~{digest}"


@settings(max_examples=200, deadline=None)
@given(
    head=st.text(min_size=MAX_KEY_LENGTH, max_size=MAX_KEY_LENGTH + 50), a=st.text(), b=st.text()
)
def test_shorten_keeps_distinct_keys_distinct(head: str, a: str, b: str) -> None:
    """Long keys sharing their whole readable prefix still map apart."""
    if a != b:
        assert shorten(head + a) != shorten(head + b)


def test_ten_thousand_character_keys_from_a_template() -> None:
    spec = _spec("doc-{a}")
    one, two = "x" * 10_000, "x" * 9_999 + "y"
    [k1], [k2] = spec.keys((one,), {}), spec.keys((two,), {})
    assert len(k1) <= MAX_KEY_LENGTH and len(k2) <= MAX_KEY_LENGTH
    assert k1 != k2
    assert k1.startswith("doc-xxx") and spec.keys((one,), {}) == [k1]
