"""Lost replies for every store operation on the Redis and PostgreSQL stores.

The fault: the server applied a request and answered, and the answer never
reached the client. A loopback proxy (tests/lossy_proxy.py) forwards the
request, reads the server's reply, and resets the client's connection instead
of passing the reply on. Every test first proves the fault happened (the
proxy holds the server's success reply, and a store not behind the proxy
sees the operation's effect), then that the caller converges.

Two faults per operation:

- ``one``: one reply lost. Both stores send some requests again on a new
  connection by themselves (Redis: redis-py's retry policy and the store's
  resend of a command whose connection failed; PostgreSQL: a statement on a
  free-list connection found gone is sent again once, a multi-key claim's
  transaction is retried), so the call may answer directly: that answer must
  already be the converged one. Otherwise it raises StoreUnavailable.
- ``every``: every reply to the request lost, however often it is sent: the
  call raises StoreUnavailable (the transient error a caller retries on, not a
  plain LeaseError, and promptly: the connection is reset, no socket timeout
  is waited out).

Then the caller repeats the same call with the same arguments (the proxy
forwarding again), and its answer must have converged. What converging means,
per operation (``direct`` is a store on the same server, not behind the proxy):

- **claim** (one key, several keys) by the same owner: a Lease of that owner
  whose token is the current grant of every key (direct ``inspect``: live,
  that owner, that token), so another owner's claim gets None. A repeated
  claim re-grants its own owner with a newer token; the grant whose reply was
  lost is superseded before anyone saw its token.
- **renew**: True, the lease still that owner's with the same token, at the
  new TTL.
- **renew_many**: an expiry for every lease, none None, each the lease's
  expiry as the store holds it.
- **release** (one key, several keys): True, every key free; the owner's
  renewal and a stranger's release then answer False.
- **release_later** (the release a task sends without waiting for the reply;
  Redis reads the reply at the store's next call): every key free, and the
  next call answers as if nothing happened; the release's handler hears of a
  failure only when every resend lost its reply too (``every``).
- **inspect**, **fence_token**: what a direct read answers.
- **evict with a token**: the lease of that token is gone (the key not live,
  its fence past the token) and nothing else changes: the repeated evict
  answers None, as an evict of a lease that is no longer there does, and a
  lease granted after the lost reply is left alone. (An evict carries no
  requester identity, so no store can tell its own earlier attempt from
  another evictor's; the answer "None" is the same for both.)
- **the fenced commit** with ``release=True`` (Redis leases with PostgreSQL
  results, the release's reply or the commit's reply lost; PostgreSQL leases
  and results in one database): the AcceptedResult of the lease's token, as
  the table holds it, exactly one result row, the lease released; never
  StaleFencingToken, never a second row.

SQLite is not here: it is embedded, every operation a call into a library on a
local file, so no reply crosses a connection that could lose it. The etcd
store has the same class of test in tests/contract/test_etcd_limits.py.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from celery_lease import Lease, LeaseStore, StoreUnavailable
from celery_lease.results import AcceptedResult, ResultTable
from celery_lease.stores import redis as redis_store
from tests.lossy_proxy import Dropped, LossyProxy
from tests.results_helpers import migrated_pg_url, result_rows
from tests.servers import LOOPBACK
from tests.store_fixtures import new_key, store_url

pytestmark = pytest.mark.timeout(120)

A = "worker-a:1:aaaa"
B = "worker-b:2:bbbb"

STORES = ("redis", "postgres")
DROPS = ("one", "every")


def _sha(script: str) -> bytes:
    return hashlib.sha1(script.encode()).hexdigest().encode()


#: A byte string only the request of that operation carries. Redis: the script's
#: SHA in the EVALSHA (the scripts are cached on the server first, see
#: ``_warm_up``), GET for the fence. PostgreSQL: a fragment of the statement's
#: text (psycopg sends it in the Parse message; a statement runs fewer than
#: ``prepare_threshold`` times on the proxied store's connections, so it is
#: never sent by name only) or, for a transaction, its COMMIT: a reply lost
#: before the COMMIT is a transaction the server rolls back, not applied.
MATCH: dict[str, dict[str, bytes]] = {
    "redis": {
        "claim": _sha(redis_store.CLAIM),
        "claim_many": _sha(redis_store.CLAIM),
        "renew": _sha(redis_store.RENEW),
        "renew_many": _sha(redis_store.RENEW),
        "release": _sha(redis_store.RELEASE),
        "release_many": _sha(redis_store.RELEASE),
        # release_later sends the script's text (EVAL), not its SHA
        "release_later": b"if not h[3] then redis.call('HSET', KEYS[i], 'released', '1')",
        "inspect": _sha(redis_store.INSPECT),
        "evict": _sha(redis_store.EVICT),
        "fence_token": b"\r\nGET\r\n",
    },
    "postgres": {
        "claim": b"FROM granted",
        "claim_many": b"COMMIT",
        "renew": b"whole AS",
        "renew_many": b"whole AS",
        "release": b"OR renewed_at = expires_at",
        "release_many": b"OR renewed_at = expires_at",
        "release_later": b"OR renewed_at = expires_at",
        "inspect": b"LEFT JOIN celery_lease_leases",
        "evict": b"COMMIT",
        "fence_token": b"both_tokens",
    },
}


def _behind(proxy: LossyProxy, url: str, port: int) -> str:
    """``url`` with the server's port replaced by the proxy's."""
    assert f":{port}/" in url, url
    return url.replace(f":{port}/", f":{proxy.port}/", 1)


def _port(url: str) -> int:
    return int(url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])


def _warm_up(store: LeaseStore) -> None:
    """Run every operation once, so Redis has every script cached (an EVALSHA
    answered NOSCRIPT would be a lost error reply, not a lost success)."""
    lease = store.claim(new_key("warm"), owner_id=A, ttl=30)
    assert lease is not None
    store.renew_many([lease])
    store.inspect(lease.key)
    store.release(lease)
    store.evict(lease.key, token=lease.token)
    store.fence_token(lease.key)


def _server_succeeded(kind: str, reply: bytes) -> bool:
    """True if the (first chunk of the) reply the proxy kept is a success reply."""
    if kind == "redis":
        return not reply.startswith(b"-")  # RESP: an error reply starts with '-'
    types = []
    i = 0
    while i + 5 <= len(reply):  # PostgreSQL messages: type byte, int32 length (incl. itself)
        types.append(reply[i : i + 1])
        i += 1 + int.from_bytes(reply[i + 1 : i + 5], "big")
    return b"C" in types and b"E" not in types  # CommandComplete, no ErrorResponse


def lose_replies(
    proxy: LossyProxy, kind: str, match: bytes, drops: str, call: Callable[[], Any]
) -> list[Any]:
    """Run ``call`` with its reply lost (``drops``: one, or every one); proves the
    fault happened. Returns the call's answer to check ([] if it raised
    StoreUnavailable); the caller's retry is the test's to make."""
    if drops == "one":
        proxy.drop_next_reply(match)
    else:
        proxy.drop_replies(match)
    start = time.monotonic()
    try:
        first: Any = call()
    except StoreUnavailable as e:
        first = e
    finally:
        proxy.stop_dropping()
    elapsed = time.monotonic() - start
    # The fault happened: the server applied the request and answered it.
    lost: Dropped = proxy.wait_dropped(0)
    assert match in lost.request
    assert all(_server_succeeded(kind, d.reply) for d in proxy.dropped), [
        d.reply[:120] for d in proxy.dropped
    ]
    if drops == "every":
        assert isinstance(first, StoreUnavailable), f"the call answered {first!r}"
    # Prompt: a reset connection is an error at once (redis-py's retry backs off
    # about 5 s in all); not a socket timeout waited out per attempt.
    assert elapsed < 30, f"the call took {elapsed:.1f}s"
    return [] if isinstance(first, StoreUnavailable) else [first]


@dataclass
class Wire:
    kind: str
    direct: LeaseStore  # on the server itself
    store: LeaseStore  # behind the proxy
    proxy: LossyProxy

    def lost(self, op: str, drops: str, call: Callable[[], Any]) -> list[Any]:
        """``call`` with the reply to ``op``'s request lost (see :func:`lose_replies`)."""
        return lose_replies(self.proxy, self.kind, MATCH[self.kind][op], drops, call)


@pytest.fixture(params=STORES)
def wire(request: pytest.FixtureRequest) -> Iterator[Wire]:
    kind = request.param
    url = store_url(request, kind)
    port = _port(url)
    with LossyProxy(LOOPBACK, port) as proxy:
        direct = LeaseStore.from_url(url)
        _warm_up(direct)
        store = LeaseStore.from_url(_behind(proxy, url, port))
        # A connection in use already, as in a running worker: a lost reply on it
        # takes the stores' resend-once path for a connection found gone.
        store.time()
        try:
            yield Wire(kind, direct, store, proxy)
        finally:
            store.close()


@pytest.fixture(params=DROPS)
def drops(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class TestLostReplies:
    """Each operation, its reply lost after the server applied it, then retried."""

    @pytest.mark.parametrize("width", [1, 3], ids=["claim", "claim_many"])
    def test_claim(self, wire: Wire, drops: str, width: int) -> None:
        keys = [new_key("claim") for _ in range(width)]
        op = "claim" if width == 1 else "claim_many"

        def call() -> Lease | None:
            return wire.store.claim(keys if width > 1 else keys[0], owner_id=A, ttl=30)

        def converged(lease: Lease | None) -> None:
            assert lease is not None and lease.owner_id == A, lease
            assert sorted(lease.keys) == sorted(keys)
            for k in keys:
                record = wire.direct.inspect(k)
                assert record is not None and record.live, record
                assert (record.owner_id, record.token) == (A, lease.token), (record, lease)

        answers = wire.lost(op, drops, call)
        for k in keys:  # applied: the keys are A's (the lost grant's or a resend's)
            record = wire.direct.inspect(k)
            assert record is not None and record.live and record.owner_id == A, record
        for answer in answers:
            converged(answer)
        converged(call())
        assert wire.direct.claim(keys[-1], owner_id=B, ttl=30) is None

    def test_renew(self, wire: Wire, drops: str) -> None:
        key = new_key("renew")
        lease = wire.direct.claim(key, owner_id=A, ttl=30)
        assert lease is not None

        def converged(answer: bool) -> None:
            assert answer is True
            record = wire.direct.inspect(key)
            assert record is not None and record.live, record
            assert (record.owner_id, record.token, record.ttl) == (A, lease.token, 60.0), record

        answers = wire.lost("renew", drops, lambda: wire.store.renew(lease, ttl=60))
        record = wire.direct.inspect(key)
        assert record is not None and record.ttl == 60.0, "applied: renewed to the new TTL"
        for answer in answers:
            converged(answer)
        converged(wire.store.renew(lease, ttl=60))

    def test_renew_many(self, wire: Wire, drops: str) -> None:
        one = wire.direct.claim(new_key("rm"), owner_id=A, ttl=30)
        wide = wire.direct.claim([new_key("rm"), new_key("rm")], owner_id=A, ttl=30)
        assert one is not None and wide is not None
        leases = [one, wide]

        def converged(answer: list[float | None]) -> None:
            assert len(answer) == 2 and all(a is not None for a in answer), answer
            for lease, expires in zip(leases, answer):
                records = [wire.direct.inspect(k) for k in lease.keys]
                assert all(r is not None and r.live and r.token == lease.token for r in records)
                held = min(r.expires_at for r in records if r is not None)
                assert expires == pytest.approx(held, abs=1e-3), (expires, records)

        answers = wire.lost("renew_many", drops, lambda: wire.store.renew_many(leases, ttl=60))
        for lease in leases:  # applied: every key at the new TTL
            for k in lease.keys:
                record = wire.direct.inspect(k)
                assert record is not None and record.ttl == 60.0, record
        for answer in answers:
            converged(answer)
        converged(wire.store.renew_many(leases, ttl=60))

    @pytest.mark.parametrize("width", [1, 2], ids=["release", "release_many"])
    def test_release(self, wire: Wire, drops: str, width: int) -> None:
        keys = [new_key("rel") for _ in range(width)]
        lease = wire.direct.claim(keys, owner_id=A, ttl=30)
        assert lease is not None

        def converged(answer: bool) -> None:
            assert answer is True, "the owner's release, its first reply lost"
            for k in keys:
                record = wire.direct.inspect(k)
                assert record is not None and not record.live, record

        op = "release" if width == 1 else "release_many"
        answers = wire.lost(op, drops, lambda: wire.store.release(lease))
        for k in keys:  # applied: released
            record = wire.direct.inspect(k)
            assert record is not None and not record.live, record
        for answer in answers:
            converged(answer)
        converged(wire.store.release(lease))
        assert wire.store.renew(lease) is False
        stranger = Lease(lease.key, lease.keys, B, lease.token, 0.0, 0.0, 30.0)
        assert wire.store.release(stranger) is False

    @pytest.mark.parametrize("width", [1, 2], ids=["release_later", "release_later_many"])
    def test_release_later(self, wire: Wire, drops: str, width: int) -> None:
        keys = [new_key("rel-later") for _ in range(width)]
        lease = wire.direct.claim(keys, owner_id=A, ttl=30)
        assert lease is not None
        failures: list[BaseException] = []

        match = MATCH[wire.kind]["release_later"]
        if drops == "one":
            wire.proxy.drop_next_reply(match)
        else:
            wire.proxy.drop_replies(match)
        try:
            wire.store.release_later(lease, failures.append)
            # Redis reads the release's reply here, at the store's next call: the
            # call must answer, whatever became of the release's reply.
            after = wire.store.inspect(keys[0])
        finally:
            wire.proxy.stop_dropping()
        lost: Dropped = wire.proxy.wait_dropped(0)  # the fault happened:
        assert match in lost.request  # the release's reply was lost...
        assert all(_server_succeeded(wire.kind, d.reply) for d in wire.proxy.dropped)
        for k in keys:  # ...after the server applied it
            record = wire.direct.inspect(k)
            assert record is not None and not record.live, record
        assert after is not None and not after.live, after
        if drops == "one":
            assert failures == [], "sent again, the release found its own work done"
        else:
            assert len(failures) == 1 and isinstance(failures[0], StoreUnavailable), failures
        claimed = wire.store.claim(keys, owner_id=B, ttl=30)
        assert claimed is not None and claimed.token > lease.token

    def test_inspect(self, wire: Wire, drops: str) -> None:
        key = new_key("insp")
        lease = wire.direct.claim(key, owner_id=A, ttl=30)
        assert lease is not None

        def converged(record: Any) -> None:
            expected = wire.direct.inspect(key)
            assert record is not None and expected is not None
            fields = ("owner_id", "token", "expires_at", "acquired_at", "ttl")
            assert [getattr(record, f) for f in fields] == [getattr(expected, f) for f in fields]
            assert record.live and record.token == lease.token

        answers = wire.lost("inspect", drops, lambda: wire.store.inspect(key))
        for answer in answers:
            converged(answer)
        converged(wire.store.inspect(key))

    def test_fence_token(self, wire: Wire, drops: str) -> None:
        key = new_key("fence")
        lease = wire.direct.claim(key, owner_id=A, ttl=30)
        assert lease is not None
        answers = wire.lost("fence_token", drops, lambda: wire.store.fence_token(key))
        for answer in [*answers, wire.store.fence_token(key)]:
            assert answer == wire.direct.fence_token(key) == lease.token

    def test_evict_with_token(self, wire: Wire, drops: str) -> None:
        key = new_key("evict")
        lease = wire.direct.claim(key, owner_id=A, ttl=30)
        assert lease is not None

        answers = wire.lost("evict", drops, lambda: wire.store.evict(key, token=lease.token))
        record = wire.direct.inspect(key)
        assert record is not None and not record.live, f"applied: evicted: {record}"
        fence = wire.direct.fence_token(key)
        assert fence > lease.token
        # Nothing else changed: a store's own resend found no lease of that token.
        assert answers in ([], [None]), answers
        assert wire.direct.renew(lease) is False

        taker = wire.direct.claim(key, owner_id=B, ttl=30)
        assert taker is not None and taker.token > fence
        assert wire.store.evict(key, token=lease.token) is None, "the caller's retry"
        record = wire.direct.inspect(key)
        assert record is not None and record.live, record
        assert (record.owner_id, record.token) == (B, taker.token), "the new grant is left alone"
        assert wire.direct.fence_token(key) == taker.token


# --------------------------------------------------------------------------
# the fenced commit
# --------------------------------------------------------------------------

#: (where the leases and results live, whose reply is lost)
COMMITS = ("redis+pg:release", "redis+pg:commit", "pg+pg:commit")


@dataclass
class CommitWire:
    kind: str
    store: LeaseStore  # the table's lease store (behind the proxy for redis+pg:release)
    table: ResultTable  # the table committing (behind the proxy unless redis+pg:release)
    direct: LeaseStore
    direct_table: ResultTable
    result_url: str
    proxy: LossyProxy


@pytest.fixture(params=COMMITS)
def commit_wire(request: pytest.FixtureRequest) -> Iterator[CommitWire]:
    kind = request.param
    pg_url = migrated_pg_url(request)
    pg_port = _port(pg_url)
    if kind == "redis+pg:release":
        redis_url: str = request.getfixturevalue("redis_url")
        port = _port(redis_url)
        with LossyProxy(LOOPBACK, port) as proxy:
            direct = LeaseStore.from_url(redis_url)
            _warm_up(direct)
            store = LeaseStore.from_url(_behind(proxy, redis_url, port))
            store.time()
            table = ResultTable(pg_url, store)
            yield CommitWire(kind, store, table, direct, table, pg_url, proxy)
            store.close()
        return
    with LossyProxy(LOOPBACK, pg_port) as proxy:
        proxied = _behind(proxy, pg_url, pg_port)
        if kind == "redis+pg:commit":
            store = direct = LeaseStore.from_url(request.getfixturevalue("redis_url"))
        else:
            direct = LeaseStore.from_url(pg_url)
            store = LeaseStore.from_url(proxied)
        table = ResultTable(proxied, store)
        assert table.colocated is (kind == "pg+pg:commit")
        table.fence(new_key("warm"))  # a connection in use already
        yield CommitWire(kind, store, table, direct, ResultTable(pg_url), pg_url, proxy)
        table.db.dispose()


@pytest.mark.parametrize("drops", DROPS)
def test_a_fenced_commit_whose_reply_was_lost_converges_to_one_accepted_row(
    commit_wire: CommitWire, drops: str
) -> None:
    w = commit_wire
    key = new_key("commit")
    lease = w.direct.claim(key, owner_id=A, ttl=30, meta={"task_id": "t-1"})
    assert lease is not None
    if w.table.needs_registration:
        w.table.register(lease)
    value = {"answer": 42}

    def call() -> AcceptedResult:
        return w.table.commit(lease, value, release=True)

    def converged(accepted: AcceptedResult) -> None:
        assert isinstance(accepted, AcceptedResult), accepted
        assert accepted == w.direct_table.get(key, lease.token)
        assert (accepted.token, accepted.owner_id, accepted.value) == (lease.token, A, value)
        assert [r[1:] for r in result_rows(w.result_url, key)] == [(lease.token, A)], "one row"
        record = w.direct.inspect(key)
        assert record is not None and not record.live, f"released: {record}"

    if w.kind == "redis+pg:release":
        match = _sha(redis_store.RELEASE)
        kind = "redis"
    else:
        match = b"INSERT INTO celery_lease_results"
        kind = "postgres"
    answers = lose_replies(w.proxy, kind, match, drops, call)
    # Applied: the lease released (and, unless the release's reply was the lost
    # one, which rolls the commit back, the row written).
    record = w.direct.inspect(key)
    assert record is not None and not record.live, record
    rows = result_rows(w.result_url, key)
    if w.kind != "redis+pg:release" or answers:
        assert [r[1:] for r in rows] == [(lease.token, A)], rows
    else:
        assert rows == [], "the release's reply lost: the commit rolled back"
    for answer in answers:
        converged(answer)
    converged(call())
