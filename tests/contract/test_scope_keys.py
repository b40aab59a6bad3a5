"""No two (tenant, key) pairs meet in the store, and no planted password is printed.

Property test (hypothesis) over tenant and key strings with ``/``, ``:``,
digits, unicode, long keys and keys in the shortened shape: the store key of
a derived key (:func:`user_key` then :func:`scoped`) is injective, never
reaches a reserved namespace, and keeps ordinary keys as they were. The
redaction tests plant a password in URLs of servers that refuse connections
(real sockets) and grep every message, ``repr`` and CLI line for it.
"""

from __future__ import annotations

import hashlib
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_lease import LeaseConfigError, LeaseError, LeaseStore, StoreUnavailable
from celery_lease.keys import INTERNAL_PREFIX, scoped, shorten, user_key
from celery_lease.redaction import redact
from celery_lease.results import ResultTable

SECRET = "PLANTED-s3cret"

_pieces = st.sampled_from(["/", ":", "t/", "~", "0", "9", "é", "😀", "a", "}", "{"])
_text = st.lists(st.one_of(_pieces, st.text(max_size=4)), max_size=12).map("".join)


def _forged_shape(draw_base: str) -> str:
    return shorten("x" * 250 + draw_base)


keys_st = st.one_of(
    _text.filter(bool),
    st.text(min_size=190, max_size=260),
    _text.map(_forged_shape),
    _text.map(
        lambda s: (s or "k") + "~" + hashlib.sha256(s.encode("utf-8", "surrogatepass")).hexdigest()
    ),
)
tenants_st = st.one_of(
    st.none(), _text.filter(bool), st.text(min_size=150, max_size=220).filter(bool)
)


def _store_key(key: str, tenant: str | None) -> str | None:
    try:
        return scoped(user_key(key), tenant)
    except LeaseConfigError:
        return None  # refused (reserved prefix, unstorable tenant): never stored


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(keys_st, tenants_st), min_size=2, max_size=6, unique=True))
def test_store_keys_of_distinct_tenant_key_pairs_never_collide(
    pairs: list[tuple[str, str | None]],
) -> None:
    seen: dict[str, tuple[str, str | None]] = {}
    for key, tenant in pairs:
        stored = _store_key(key, tenant)
        if stored is None:
            continue
        assert stored == shorten(stored), "stores map it to itself"
        assert not stored.startswith(INTERNAL_PREFIX)
        assert tenant is not None or not stored.startswith("t/")
        other = seen.setdefault(stored, (key, tenant))
        assert other == (key, tenant), f"{other} and {(key, tenant)} both store as {stored!r}"


def test_ordinary_keys_keep_their_form_and_reserved_ones_are_refused() -> None:
    for key in ("payment-security-42", "a:b/c", "é😀", "x" * 200, "task:" + "0" * 64):
        assert user_key(key) == key
    long_key = "y" * 500
    assert user_key(long_key) == shorten(long_key), "long keys: the form stored before"
    forged = shorten(long_key)
    assert user_key(forged) != forged and user_key(forged) != user_key(long_key)
    for reserved in ("t/4:acme/k", INTERNAL_PREFIX + "defer/123"):
        with pytest.raises(LeaseConfigError, match="reserved"):
            scoped(user_key(reserved), None)


def _refused_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _assert_clean(*outputs: object) -> None:
    for out in outputs:
        assert SECRET not in str(out), out
        assert SECRET not in repr(out), out


def test_a_planted_password_is_in_no_message_of_a_store_that_is_down() -> None:
    port = _refused_port()
    url = f"redis://user:{SECRET}@127.0.0.1:{port}/0?password={SECRET}"
    store = LeaseStore.from_url(url, socket_connect_timeout=1.0)
    _assert_clean(store)
    with pytest.raises(StoreUnavailable) as info:
        store.claim("k", ttl=5)
    _assert_clean(info.value, info.value.args)
    pg = f"postgresql+psycopg://user:{SECRET}@127.0.0.1:{port}/db?password={SECRET}&connect_timeout=2"
    with pytest.raises(LeaseError) as pg_info:
        ResultTable(pg).accepted("k")
    _assert_clean(pg_info.value, pg_info.value.args)


@pytest.mark.parametrize(
    "url",
    [
        f"mysql://user:{SECRET}@127.0.0.1/db",
        f"user:{SECRET}@127.0.0.1/db",
        f"redis://:{SECRET}@127.0.0.1:1/0?password={SECRET}",
    ],
)
def test_a_planted_password_is_in_no_config_error(url: str) -> None:
    from celery import Celery

    from celery_lease.config import Config

    for setting in ("lease_store_url", "lease_result_url"):
        app = Celery("redaction", set_as_current=False)
        app.conf.update({"lease_store_url": "sqlite:///x.sqlite3", setting: url})
        try:
            Config.from_app(app)
        except LeaseError as e:
            _assert_clean(e, e.args)
    with pytest.raises(LeaseError) as info:
        ResultTable(url)
    _assert_clean(info.value, info.value.args)


def test_redact_masks_every_form() -> None:
    for text in (
        f"redis://:{SECRET}@h:1/0",
        f"postgresql://u:{SECRET}@h/db?sslmode=require&password={SECRET}",
        f"options {{'password': '{SECRET}', 'ssl_keyfile': '/k'}}",
        f"token={SECRET}; passwd={SECRET}",
    ):
        assert SECRET not in redact(text)
    assert redact("payment-security-42") == "payment-security-42"


@pytest.mark.parametrize("key", ["}x", "}", "}}{a}", "plain", "{tagged}rest", "t/acme/}x"])
def test_a_keys_lease_and_fence_share_a_cluster_slot(
    key: str, redis_url: str, make_redis_server: object
) -> None:
    """What Redis Cluster would compute (CLUSTER KEYSLOT on a real cluster-mode
    server) for the names a real claim wrote: one slot for the lease and the
    fence, so the claim script's two keys may run on one node. A key starting
    with ``}`` used to give an empty hash tag and two slots."""
    import redis as redis_py

    node = make_redis_server(appendonly=False, extra_args=("--cluster-enabled", "yes"))  # type: ignore[operator]
    cluster = redis_py.Redis.from_url(node.url(0))
    store = LeaseStore.from_url(redis_url)
    try:
        lease = store.claim(key, ttl=30.0, owner_id="o")
        assert lease is not None
        plain = redis_py.Redis.from_url(redis_url)
        written = sorted(n.decode() for n in plain.keys("*"))
        plain.close()
        lease_name, fence_name = store.lease_name(key), store.fence_name(key)  # type: ignore[attr-defined]
        assert sorted([lease_name, fence_name]) == written, written
        slots = {n: cluster.execute_command("CLUSTER", "KEYSLOT", n) for n in written}
        assert len(set(slots.values())) == 1, slots
    finally:
        store.close()
        cluster.close()
