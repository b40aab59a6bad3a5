"""The etcd lease store: consensus-backed leases, through etcd's v3 JSON gateway.

For users who cannot trust a single primary: Redis replicates asynchronously
(a failover can lose a granted lease), a PostgreSQL primary is one machine.
Every write here is a Raft proposal committed by a quorum, so a granted lease,
its expiry and its token survive the loss of any minority of members,
including the leader. Needs etcd 3.4 or newer and ``pip install
celery-lease[etcd]`` (the ``etcd3gw`` client).

URLs: ``etcd://host:port[,host:port...]`` (plain HTTP) and
``etcds://host:port[,...]`` (TLS). Options (``lease_store_options`` or
keyword arguments): ``ca_cert`` / ``cert_cert`` / ``cert_key`` (etcd3gw's
names; ``ssl_ca_certs`` / ``ssl_certfile`` / ``ssl_keyfile``, the Redis
store's names, are accepted too), ``timeout`` (seconds per request, default
5), ``max_txn_ops`` (the members' ``--max-txn-ops``, default 128, etcd's
default) and ``key_prefix``. Requests go to one member; a member that refuses the
connection is skipped at once, and after any other transport error the next
request goes to the next member (the requests and their errors:
:mod:`celery_lease.stores.etcd_client`).

Layout, per key (the key as given, UTF-8, no hashing)::

    /{prefix}/lease/<key>   value: JSON {"owner", "acquired", task_id, task_name,
                            root_id, tenant}; attached to the claim's etcd lease
    /{prefix}/fence/<key>   empty; put by every claim and evict, never deleted:
                            its mod_revision is the newest token issued
    /{prefix}/released/<key>  JSON {"owner", "token"} of the grant released last
    /{prefix}/mark/<name>   an internal marker's owner, attached to an etcd lease
                            of its TTL; no fence (see etcd_marks.py)

Operations, each built on etcd's own primitives:

- **claim**: grant a fresh etcd lease of the TTL, then one transaction: if
  every lease key is absent (``create_revision == 0``), put each lease key
  attached to that etcd lease and put each fence key; all or nothing. The
  token is the transaction's revision: the ``mod_revision`` of the keys it
  put. One etcd lease per claim. A refused claim revokes its unused etcd
  lease. A live key held by the *same* owner id is granted again (a claim
  retried after a lost reply), with a new token, in one transaction. Two
  operations per key: a claim of more than ``max_txn_ops // 2`` keys (64 at
  etcd's default) is refused with :class:`LeaseConfigError`, as all or
  nothing cannot span transactions.
- **renew** and **release**: see :mod:`celery_lease.stores.etcd_renew` (the
  keep-alive, then the ownership read; a compare-and-delete that leaves a
  marker, so a repeated release answers True).
- **evict**: one transaction deleting the lease key and putting the fence key,
  so the fence (and every later claim) is past the evicted token; then the
  evicted etcd lease is revoked (freeing the other keys of a multi-key claim).

**Tokens are etcd revisions**: cluster-wide, strictly increasing, kept by the
Raft log across leader changes and restarts, never reused. They are comparable
only within one etcd cluster: a fence row written from Redis tokens (which look
like microsecond timestamps) outranks every etcd token, so do not switch a key
space between stores while results are fenced, and do not point two stores at
one result table.

**Expiry and time.** Expiry is decided by etcd alone: the etcd lease runs out
on the leader's clock (a duration, so no wall clock is involved), and the
leader revokes it, deleting its keys. A key blocks claims exactly while it
exists. etcd lease TTLs are whole seconds with a server minimum (1.5 x the
election timeout, rounded up: 2 s with etcd's defaults), so a TTL is rounded
up (``Lease.ttl`` says what was granted; the local view of a lease uses it).
The leader revokes expired leases from a 500 ms loop, so a key is freed up to
:attr:`expiry_lag` after its ``expires_at``. In that gap etcd refuses to renew the lease while a
release or a fenced commit still succeeds -- safe, as no other grant of the
key can exist until the revocation deletes it.

etcd has no readable clock (its response header carries revisions and the
Raft term, no time), so ``store.time()`` is *this machine's* clock:
``Lease.expires_at`` is the local time before the grant plus the TTL, a lower
bound of the leader's expiry; callers that schedule by ``store.time()``
(deferral ETAs) inherit this machine's clock. A key whose lease ran out but is
not revoked yet is reported held by its owner (``inspect``, ``list``): its
release and fenced commit can still succeed, so it is no free key. ``inspect()`` derives expiry from
the lease's remaining TTL, which etcd reports in whole seconds (rounded down):
its ``expires_at`` is an upper estimate within :attr:`expiry_resolution` of the
truth, and ``renewed_at`` is derived from it.
"""

from __future__ import annotations

import base64
import builtins
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from celery_lease.exceptions import LeaseConfigError, StoreUnavailable
from celery_lease.stores.base import (
    Lease,
    LeaseRecord,
    LeaseStore,
    redact_url,
    refuse_key_prefix_option,
)
from celery_lease.stores.etcd_client import Etcd3Client
from celery_lease.stores.etcd_marks import Markers
from celery_lease.stores.etcd_renew import RenewAndRelease
from celery_lease.stores.etcd_wire import (
    DEFAULT_MAX_TXN_OPS,
    KV,
    Members,
    b64,
    chunks,
    cmp_op,
    key_range,
    lease_value,
    parse_endpoints,
    prefix_end,
    ranges,
    str_or_none,
    tls_options,
)

__all__ = ["EtcdLeaseStore", "parse_endpoints"]

DEFAULT_TIMEOUT = 5.0
#: Grants whose etcd lease id this store object remembers (for renewals that
#: send the keep-alive first, and for revoking after a repeated release).
_MAX_KNOWN = 10_000


class EtcdLeaseStore(Markers, RenewAndRelease, LeaseStore):
    """Leases in etcd (see the module docstring for the layout and guarantees)."""

    takes_key_prefix = True
    server_clock = False  # etcd's leader keeps expiry, but answers no clock

    #: seconds after a lease's ``expires_at`` by which etcd has freed its keys
    #: (the leader's 500 ms revocation loop, a Raft commit, the grant's latency)
    expiry_lag = 1.5
    #: ``inspect()``/``list()`` expiry estimates are at most this far above the
    #: store's expiry (etcd reports a lease's remaining TTL in whole seconds)
    expiry_resolution = 1.1

    @classmethod
    def check_options(cls, url: str, options: Mapping[str, Any], key_prefix: str) -> None:
        """Build the store (no I/O) even without options, so a malformed URL or
        a missing certificate file fails at worker start."""
        refuse_key_prefix_option(options)
        cls(url, **cls.options_from_settings(options, key_prefix)).close()

    def __init__(
        self,
        url: str,
        key_prefix: str = "celery-lease",
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_txn_ops: int = DEFAULT_MAX_TXN_OPS,
        **options: Any,
    ) -> None:
        self.url = url
        if Etcd3Client is None:  # pragma: no cover - exercised only without the extra
            raise LeaseConfigError(
                "the etcd lease store needs the etcd3gw client: pip install 'celery-lease[etcd]'"
            )
        protocol, endpoints = parse_endpoints(url)
        prefix_bytes = _check_settings(key_prefix, timeout, max_txn_ops)
        tls = tls_options(url, protocol, options)
        self.prefix = key_prefix
        self.timeout = float(timeout)
        self.endpoints = endpoints
        #: The most compares / success / failure operations one transaction may
        #: carry (etcd's ``--max-txn-ops``): claims of more than half as many
        #: keys are refused; reads, renewals and releases are split to fit.
        self.max_txn_ops = max_txn_ops
        self._members = Members(
            lambda: [
                Etcd3Client(
                    host=host,
                    port=port,
                    protocol=protocol,
                    ca_cert=tls.get("ca_cert"),
                    cert_cert=tls.get("cert_cert"),
                    cert_key=tls.get("cert_key"),
                    timeout=self.timeout,
                    api_path="/v3/",
                )
                for host, port in endpoints
            ]
        )
        # Passed with every request: a session's own ``verify`` loses to a
        # REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE in the environment (requests #3829),
        # which would silently trust the system CAs instead of ``ca_cert``.
        self._verify: dict[str, Any] = {"verify": tls["ca_cert"]} if "ca_cert" in tls else {}
        self._min_ttl = 1  # raised when etcd grants more than asked (its minimum TTL)
        self._lease_base = b"/" + prefix_bytes + b"/lease/"
        self._fence_base = b"/" + prefix_bytes + b"/fence/"
        self._released_base = b"/" + prefix_bytes + b"/released/"
        #: (owner_id, token) -> the etcd lease holding that grant's keys.
        self._known: dict[tuple[str, int], int] = {}

    # -- key names ---------------------------------------------------------

    def lease_name(self, key: str) -> bytes:
        return self._lease_base + key.encode()

    def fence_name(self, key: str) -> bytes:
        return self._fence_base + key.encode()

    def released_name(self, key: str) -> bytes:
        return self._released_base + key.encode()

    def _remember(self, lease: Lease, lease_id: int) -> None:
        known = self._known
        known[(lease.owner_id, lease.token)] = lease_id
        if len(known) > _MAX_KNOWN:  # forget the oldest: it costs one read, if ever renewed
            try:
                known.pop(next(iter(known)), None)
            except (RuntimeError, StopIteration):  # another thread changed it meanwhile
                pass

    # -- claim -------------------------------------------------------------

    def do_claim(
        self,
        primary: str,
        keys: tuple[str, ...],
        owner_id: str,
        ttl: float,
        meta: dict[str, str],
    ) -> Lease | None:
        if 2 * len(keys) > self.max_txn_ops:
            # All or nothing needs one transaction, which puts a lease key and a
            # fence key per key: beyond the limit etcd would refuse it.
            raise LeaseConfigError(
                f"a claim of {len(keys)} keys needs {2 * len(keys)} operations in one etcd "
                f"transaction, over max_txn_ops={self.max_txn_ops} (etcd's --max-txn-ops): "
                f"claim at most {self.max_txn_ops // 2} keys at once, or raise --max-txn-ops "
                "on every etcd member and max_txn_ops in lease_store_options together"
            )
        acquired = time.time()
        lease_id, granted = self._grant(ttl)
        value = b64(lease_value(owner_id, acquired, meta))
        # Keys this very owner holds (a claim retried after a lost reply) are
        # granted again, with a new token, if unchanged since read: {key: mod_revision}.
        own: dict[str, int] = {}
        superseded: set[int] = set()
        claimed: Lease | None = None
        try:
            for _ in range(3):
                reply = self._txn(*self._claim_ops(keys, own, value, lease_id))
                if reply.get("succeeded"):
                    for old in superseded - {lease_id}:
                        self._revoke(old)
                    token = int(reply["header"]["revision"])
                    claimed = Lease(
                        primary, keys, owner_id, token, acquired + granted, acquired,
                        float(granted), meta,
                    )  # fmt: skip
                    self._remember(claimed, lease_id)
                    return claimed
                held = {k: kv for k, kv in zip(keys, ranges(reply)) if kv is not None}
                if any(kv.owner != owner_id for kv in held.values()):
                    break
                own = {k: kv.mod_revision for k, kv in held.items()}
                superseded = {kv.lease for kv in held.values() if kv.lease}
        finally:
            if claimed is None:
                # Not granted, or an error after an ambiguous grant (raised on):
                # the etcd lease must not block the retry.
                self._revoke(lease_id)
        return None

    def _claim_ops(
        self, keys: tuple[str, ...], own: Mapping[str, int], value: str, lease_id: int
    ) -> tuple[builtins.list[dict[str, Any]], ...]:
        """A claim's transaction: ``(compare, success, failure)``. Every lease key
        absent, or (``own``) unchanged since read; then put each lease key on the
        etcd lease and each fence key; else read the lease keys."""
        compare = [
            cmp_op(self.lease_name(k), "MOD", own[k])
            if k in own
            else cmp_op(self.lease_name(k), "CREATE", 0)
            for k in keys
        ]
        success = [
            {
                "request_put": {
                    "key": b64(self.lease_name(k)),
                    "value": value,
                    "lease": str(lease_id),
                }
            }
            for k in keys
        ] + [{"request_put": {"key": b64(self.fence_name(k))}} for k in keys]
        failure = [{"request_range": {"key": b64(self.lease_name(k))}} for k in keys]
        return compare, success, failure

    # -- reading -----------------------------------------------------------

    def do_inspect(self, key: str) -> LeaseRecord | None:
        kv, fence = self._read([key])[key]
        if kv is None:
            if fence is None:
                return None
            return LeaseRecord(key, None, fence.mod_revision, 0.0, None, None, None, time.time())
        left, granted = self._time_to_live(kv.lease)
        return self._record(key, kv, fence, left, granted, time.time())

    def _record(
        self, key: str, kv: KV, fence: KV | None, left: int, granted: int, now: float
    ) -> LeaseRecord:
        fields = kv.fields()
        # The fence key's mod_revision is the token of the grant (a TTL change
        # re-puts the lease key, so its own mod_revision may be newer).
        token = fence.mod_revision if fence is not None else kv.mod_revision
        if granted <= 0:  # the lease is gone (revoked since the key was read)
            expires, renewed, ttl = now, None, None
        elif left < 0:
            # Ran out, not revoked yet: the key still blocks claims and its
            # owner's release and fenced commit still succeed, so it is held
            # until the leader revokes it (at most about expiry_lag from now).
            expires, renewed, ttl = now + self.expiry_lag, None, float(granted)
        else:
            expires = now + min(left + 1, granted)
            renewed, ttl = expires - granted, float(granted)
        acquired = fields.get("acquired")
        return LeaseRecord(
            key=key,
            owner_id=kv.owner if granted > 0 else None,
            token=token,
            expires_at=expires,
            acquired_at=float(acquired) if isinstance(acquired, (int, float)) else None,
            renewed_at=renewed,
            ttl=ttl,
            now=now,
            task_id=str_or_none(fields.get("task_id")),
            task_name=str_or_none(fields.get("task_name")),
            root_id=str_or_none(fields.get("root_id")),
            tenant=str_or_none(fields.get("tenant")),
        )

    def do_list(self, prefix: str, expired: bool) -> builtins.list[LeaseRecord]:
        # etcd deletes expired leases itself: there are no expired records to list.
        lease_from, fence_from = self.lease_name(prefix), self.fence_name(prefix)
        reply = self._txn(
            [],
            [
                {"request_range": key_range(lease_from, prefix_end(lease_from))},
                {"request_range": key_range(fence_from, prefix_end(fence_from))},
            ],
            [],
        )
        leases, fences = (
            r.get("response_range", {}).get("kvs", []) for r in reply.get("responses", [])
        )
        fence_by_key = {
            base64.b64decode(f["key"])[len(self._fence_base) :]: KV.parse(f) for f in fences
        }
        ttls: dict[int, tuple[int, int]] = {}
        records: builtins.list[LeaseRecord] = []
        for item in leases:
            raw = base64.b64decode(item["key"])[len(self._lease_base) :]
            kv = KV.parse(item)
            if kv.lease not in ttls:
                ttls[kv.lease] = self._time_to_live(kv.lease)
            left, granted = ttls[kv.lease]
            record = self._record(
                raw.decode(errors="replace"), kv, fence_by_key.get(raw), left, granted, time.time()
            )
            if record.owner_id is not None:
                records.append(record)
        return records

    def do_evict(self, key: str, token: int | None = None) -> LeaseRecord | None:
        for _ in range(10):
            kv, fence = self._read([key])[key]
            if token is not None and (kv is None or fence is None or fence.mod_revision != token):
                return None  # not that token's lease (any more): nothing changes
            before = self.do_inspect(key) if kv is not None else None
            compare = [
                cmp_op(self.lease_name(key), "MOD", kv.mod_revision)
                if kv is not None
                else cmp_op(self.lease_name(key), "CREATE", 0)
            ]
            if token is not None:
                compare.append(cmp_op(self.fence_name(key), "MOD", token))
            success: builtins.list[dict[str, Any]] = [
                {"request_put": {"key": b64(self.fence_name(key))}}
            ]
            if kv is not None:
                success.append({"request_delete_range": {"key": b64(self.lease_name(key))}})
            if self._txn(compare, success, []).get("succeeded"):
                if kv is not None and kv.lease:
                    self._revoke(kv.lease)
                return before if before is not None and before.live else None
        raise StoreUnavailable(f"etcd {redact_url(self.url)}: evict of {key!r} kept racing claims")

    def do_fence_token(self, key: str) -> int:
        fence = self._read([key])[key][1]
        return fence.mod_revision if fence is not None else 0

    def do_time(self) -> float:
        """This machine's clock: etcd has none a client can read (see the module docstring)."""
        return time.time()

    def close(self) -> None:
        self._members.close()

    # -- etcd requests -------------------------------------------------------

    def _read(self, keys: Sequence[str]) -> dict[str, tuple[KV | None, KV | None]]:
        """Lease and fence key of every key, each read in one linearizable transaction.

        Up to ``max_txn_ops // 2`` keys per transaction (two reads per key).
        """
        out: dict[str, tuple[KV | None, KV | None]] = {}
        for part in chunks(list(dict.fromkeys(keys)), self.max_txn_ops // 2):
            ops = [
                {"request_range": {"key": b64(name)}}
                for k in part
                for name in (self.lease_name(k), self.fence_name(k))
            ]
            found = ranges(self._txn([], ops, []))
            out.update((k, (found[2 * i], found[2 * i + 1])) for i, k in enumerate(part))
        return out


def _check_settings(key_prefix: Any, timeout: Any, max_txn_ops: Any) -> bytes:
    """Refuse a bad ``key_prefix`` / ``timeout`` / ``max_txn_ops``; the prefix as bytes."""
    try:
        prefix_bytes = key_prefix.encode() if isinstance(key_prefix, str) else b""
    except UnicodeEncodeError:
        prefix_bytes = b""
    if not prefix_bytes or b"\x00" in prefix_bytes:
        raise LeaseConfigError(f"key_prefix must be a non-empty string, got {key_prefix!r}")
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout < math.inf
    ):
        raise LeaseConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if isinstance(max_txn_ops, bool) or not isinstance(max_txn_ops, int) or max_txn_ops < 3:
        raise LeaseConfigError(
            "max_txn_ops must be an integer of at least 3, the etcd servers' "
            f"--max-txn-ops (etcd's default: {DEFAULT_MAX_TXN_OPS}), got {max_txn_ops!r}"
        )
    return prefix_bytes
