"""Faults that hit while a late release's reply is still unread, under each retry policy.

The Redis store sends a task's release without waiting for its reply
(``release_later``): the reply stays on the kept connection and is read by the
store's next call, before that call's own reply. That next call is where a
fault lands here, through a loopback proxy (tests/lossy_proxy.py) in front of
a real Redis:

- ``late-delayed``: the release is held back past the socket timeout, so the
  read of its reply times out (a latency spike, a stalled server);
- ``reply-delayed``: the release is answered, the call's own request is held
  back past the socket timeout;
- ``late-lost`` / ``reply-lost``: the server answers, the proxy resets the
  connection instead of forwarding that reply.

And under each retry policy a user may give in ``lease_store_options``:
redis-py's default for a URL (no retries), ``retry_on_timeout=True`` (one
retry) and an explicit ``Retry(ExponentialBackoff(), 3)``. A retry sends the
release again (it may not have run) and reads its reply, then sends the call's
command: from then on the next reply is the command's own, never the
release's. What must hold:

- the call answers what a direct read of the server shows, as promptly as one
  retry allows; or, with no retry to make after a timeout, it raises
  StoreUnavailable (the transient error a caller retries on);
- the release is done on the server, and its handler hears of a failure only
  when the release's own attempt failed with no retry left (``late-delayed``
  with no retries), and then once.

The lost-reply faults without a late reply, and for every store, are in
test_lost_replies.py.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from celery_lease import LeaseError, LeaseStore, StoreUnavailable
from celery_lease.stores import redis as redis_store
from tests.lossy_proxy import LossyProxy
from tests.servers import LOOPBACK
from tests.store_fixtures import new_key, wait_for

pytestmark = pytest.mark.timeout(60)

A = "worker-a:1:aaaa"
#: Short, so that a delayed request costs the test little; a held request is
#: held until the call is over, far past it.
SOCKET_TIMEOUT = 0.5

#: lease_store_options beyond the socket timeout, by name.
POLICIES: dict[str, Callable[[], dict[str, Any]]] = {
    "no-retry": dict,
    "retry_on_timeout": lambda: {"retry_on_timeout": True},
    "retry-3": lambda: {"retry": Retry(ExponentialBackoff(), 3)},
}
FAULTS = ("late-delayed", "reply-delayed", "late-lost", "reply-lost")
OPS = ("claim", "renew_many", "release", "inspect")

#: The late release goes as EVAL with the script's text; the calls' scripts as
#: EVALSHA (cached on the server first), so each request has bytes of its own.
LATE_MATCH = b"if not h[3] then redis.call('HSET', KEYS[i], 'released', '1')"
SCRIPT_OF = {
    "claim": redis_store.CLAIM,
    "renew_many": redis_store.RENEW,
    "release": redis_store.RELEASE,
    "inspect": redis_store.INSPECT,
}


def _sha(script: str) -> bytes:
    return hashlib.sha1(script.encode()).hexdigest().encode()


@dataclass
class Wire:
    direct: LeaseStore  # on the server itself
    store: LeaseStore  # behind the proxy, with the policy's options
    proxy: LossyProxy


@pytest.fixture(params=list(POLICIES))
def wire(request: pytest.FixtureRequest) -> Iterator[Wire]:
    url: str = request.getfixturevalue("redis_url")
    host_port = url.split("://", 1)[1].split("/", 1)[0]
    port = int(host_port.rsplit(":", 1)[1])
    with LossyProxy(LOOPBACK, port) as proxy:
        direct = LeaseStore.from_url(url)
        options = POLICIES[request.param]()
        store = LeaseStore.from_url(
            url.replace(f":{port}/", f":{proxy.port}/", 1),
            socket_timeout=SOCKET_TIMEOUT,
            **options,
        )
        # Every script cached (an EVALSHA answered NOSCRIPT is another fault)
        # and a connection kept, as in a running worker.
        warm = store.claim(new_key("warm"), owner_id=A, ttl=30)
        assert warm is not None
        store.renew_many([warm])
        store.inspect(warm.key)
        store.release(warm)
        try:
            yield Wire(direct, store, proxy)
        finally:
            proxy.resume()  # a request still held goes on, so its thread ends
            store.close()
            direct.close()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_with_a_late_reply_pending(
    wire: Wire, fault: str, op: str, request: pytest.FixtureRequest
) -> None:
    policy = request.node.callspec.params["wire"]
    retries = policy != "no-retry"
    late_lease = wire.direct.claim(new_key("late"), owner_id=A, ttl=30)
    key = new_key(op)
    lease = wire.direct.claim(key, owner_id=A, ttl=30) if op != "claim" else None
    failures: list[LeaseError] = []

    call: Callable[[], Any] = {
        "claim": lambda: wire.store.claim(key, owner_id=A, ttl=30),
        "renew_many": lambda: wire.store.renew_many([lease], ttl=60),
        "release": lambda: wire.store.release(lease),
        "inspect": lambda: wire.store.inspect(key),
    }[op]
    match = LATE_MATCH if fault.startswith("late") else _sha(SCRIPT_OF[op])
    if fault.endswith("delayed"):
        wire.proxy.hold_next_request(match)
    else:
        wire.proxy.drop_next_reply(match)
    assert late_lease is not None
    wire.store.release_later(late_lease, failures.append)
    if fault.startswith("reply"):  # the release done: its reply is on the way
        wait_for(lambda: not _live(wire.direct, late_lease.key), 10, "the late release")
    start = time.monotonic()
    try:
        answer: Any = call()
    except StoreUnavailable as e:
        answer = e
    elapsed = time.monotonic() - start
    # The fault happened.
    if fault.endswith("delayed"):
        wire.proxy.wait_held(0)
    else:
        assert match in wire.proxy.wait_dropped(0).request

    if fault.endswith("delayed") and not retries:
        # A timeout, and no retry to make: the call fails as unavailable, and
        # the release's handler hears of it if the release's own reply was the
        # one waited out.
        assert isinstance(answer, StoreUnavailable), answer
        assert len(failures) == (1 if fault == "late-delayed" else 0), failures
        assert all(isinstance(f, StoreUnavailable) for f in failures), failures
        return
    assert not isinstance(answer, StoreUnavailable), (
        f"{policy}: the call failed after {elapsed:.2f}s, the server answering again: {answer!r}"
    )
    # One timeout waited out at most, and redis-py's backoff (ExponentialBackoff
    # caps at 0.512 s); a reply misread would cost a timeout per attempt.
    assert elapsed < 2 * SOCKET_TIMEOUT + 0.6, f"{policy}: {elapsed:.2f}s"
    assert failures == [], "the release, sent again, found its own work done"
    assert not _live(wire.direct, late_lease.key), "the late release is done"
    # The call's answer is the server's, read before a held request goes on.
    if op == "claim":
        record = wire.direct.inspect(key)
        assert answer is not None and record is not None and record.live
        assert (record.owner_id, record.token) == (A, answer.token), (record, answer)
    elif op == "renew_many":
        record = wire.direct.inspect(key)
        assert record is not None and record.live and record.ttl == 60.0, record
        assert answer == [pytest.approx(record.expires_at, abs=1e-3)], (answer, record)
    elif op == "release":
        assert answer is True
        assert not _live(wire.direct, key)
    else:
        expected = wire.direct.inspect(key)
        assert answer is not None and expected is not None
        assert (answer.owner_id, answer.token, answer.expires_at) == (
            expected.owner_id,
            expected.token,
            expected.expires_at,
        )


def _live(store: LeaseStore, key: str) -> bool:
    record = store.inspect(key)
    return record is not None and record.live
