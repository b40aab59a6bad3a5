"""Renewal and release in the etcd store (a part of :class:`EtcdLeaseStore`).

**Renewal** is the etcd lease's keep-alive, sent *before* the ownership read:
an evict that lands before the read is seen (the renewal answers lost), one
that lands after it came after the renewal. The etcd lease id comes from the
claim (remembered per owner and token); a grant this store object did not
make costs one read first. For N leases: N keep-alives and one read
transaction per ``max_txn_ops // 2`` keys. A renewal to a different TTL moves
the keys to a new etcd lease (a put with ``ignore_value``), which keeps the
token: the token lives in the fence key.

**Release** deletes the lease keys only if each still names this owner (a
byte-range compare on the value's ``{"owner":...,`` prefix) and its fence key
still has this token as ``mod_revision``, then revokes the etcd lease. Three
compares per key: a lease of more than ``max_txn_ops // 3`` keys is released
in several transactions, each all or nothing. Each also puts
``/{prefix}/released/<key>`` naming the owner and token, so a release
repeated after a lost reply finds its own work done and answers True; a key
that expired or was taken has no such marker, and the answer stays False.
"""

from __future__ import annotations

import builtins
import json
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery_lease.exceptions import LeaseConfigError, StoreUnavailable
from celery_lease.stores.base import Lease, redact_url
from celery_lease.stores.etcd_client import EtcdRequests
from celery_lease.stores.etcd_wire import KV, b64, chunks, cmp_op, ranges

__all__ = ["RenewAndRelease"]


class RenewAndRelease(EtcdRequests):
    """``do_renew_many`` and ``do_release`` of :class:`~celery_lease.stores.etcd.EtcdLeaseStore`."""

    url: str
    max_txn_ops: int
    _known: dict[tuple[str, int], int]

    if TYPE_CHECKING:  # provided by EtcdLeaseStore

        def lease_name(self, key: str) -> bytes: ...
        def fence_name(self, key: str) -> bytes: ...
        def released_name(self, key: str) -> bytes: ...
        def _remember(self, lease: Lease, lease_id: int) -> None: ...
        def _read(self, keys: Sequence[str]) -> dict[str, tuple[KV | None, KV | None]]: ...

    def do_renew_many(
        self, leases: builtins.list[Lease], ttls: builtins.list[float]
    ) -> builtins.list[float | None]:
        # The keep-alive goes first and the ownership read after it: an evict
        # that lands before the read is seen; one after it came after the
        # renewal. The etcd lease id comes from the claim (remembered), else
        # from one read first. A TTL other than the etcd lease's moves the keys.
        out: builtins.list[float | None] = [None] * len(leases)
        ids = {i: self._known.get((lease.owner_id, lease.token)) for i, lease in enumerate(leases)}
        unknown = [i for i, lease_id in ids.items() if lease_id is None]
        if unknown:
            kvs = self._read([k for i in unknown for k in leases[i].keys])
            for i in unknown:
                ids[i] = self._owned(leases[i], kvs)
        todo = [i for i, lease_id in ids.items() if lease_id is not None]
        for _ in range(3):
            if not todo:
                return out
            sent: dict[int, float] = {}
            left: dict[int, int | None] = {}
            for i in todo:
                sent[i] = time.time()
                left[i] = self._keepalive(ids[i])  # type: ignore[arg-type]
            kvs = self._read([k for i in todo for k in leases[i].keys])
            moved: builtins.list[int] = []
            for i in todo:
                lease, lease_id = leases[i], self._owned(leases[i], kvs)
                if lease_id is None or (lease_id == ids[i] and left[i] is None):
                    self._known.pop((lease.owner_id, lease.token), None)  # lost
                elif lease_id != ids[i]:  # moved to another etcd lease meanwhile
                    ids[i] = lease_id
                    moved.append(i)
                elif left[i] != self._effective_ttl(ttls[i]):
                    out[i] = self._move(lease, lease_id, ttls[i])
                else:
                    out[i] = sent[i] + left[i]  # type: ignore[operator]
                    self._remember(lease, lease_id)
            todo = moved
        if todo:
            raise StoreUnavailable(
                f"etcd {redact_url(self.url)}: the keys of {leases[todo[0]].key!r} kept moving "
                "to other etcd leases during the renewal (another store object renewing it "
                "to a different TTL?)"
            )
        return out

    def _owned(self, lease: Lease, kvs: Mapping[str, tuple[KV | None, KV | None]]) -> int | None:
        """The etcd lease holding every key of ``lease`` for its owner and token, or None."""
        found: set[int] = set()
        for key in lease.keys:
            kv, fence = kvs[key]
            if kv is None or fence is None or fence.mod_revision != lease.token:
                return None
            if kv.owner != lease.owner_id or kv.lease == 0:
                return None
            found.add(kv.lease)
        return found.pop() if len(found) == 1 else None

    def _move(self, lease: Lease, old_id: int, ttl: float) -> float | None:
        """Renew to a different TTL: attach the keys to a new etcd lease (token kept)."""
        if 2 * len(lease.keys) > self.max_txn_ops:  # a lease claimed under a larger limit
            raise LeaseConfigError(
                f"renewing {len(lease.keys)} keys to another TTL needs {2 * len(lease.keys)} "
                f"compares in one etcd transaction, over max_txn_ops={self.max_txn_ops}"
            )
        sent = time.time()
        new_id, granted = self._grant(ttl)
        # The fence pins the token; the key being on ``old_id`` (ours, read just
        # before) pins the owner: 2 compares per key, so a claim that fit fits.
        compare = [cmp_op(self.fence_name(k), "MOD", lease.token) for k in lease.keys]
        compare += [cmp_op(self.lease_name(k), "LEASE", old_id) for k in lease.keys]
        success = [
            {
                "request_put": {
                    "key": b64(self.lease_name(k)),
                    "ignore_value": True,
                    "lease": str(new_id),
                }
            }
            for k in lease.keys
        ]
        moved: bool | None = None
        try:
            moved = bool(self._txn(compare, success, []).get("succeeded"))
        finally:
            self._revoke(old_id if moved else new_id)  # on an error (raised on): the new one
        if moved:
            self._remember(lease, new_id)
        return sent + granted if moved else None

    def do_release(self, lease: Lease) -> bool:
        # Split to stay within max_txn_ops (3 compares per key). Each part is
        # all or nothing and leaves a marker naming the owner and token, so a
        # part already applied (a retry after a lost reply) answers True; an
        # expired or stolen key has no such marker and answers False.
        marker = b64(_release_marker(lease))
        etcd_ids: set[int] = set()
        for part in chunks(lease.keys, self.max_txn_ops // 3):
            compare = [c for k in part for c in self._owner_checks(lease, k)]
            success = [
                {"request_delete_range": {"key": b64(self.lease_name(k)), "prev_kv": True}}
                for k in part
            ] + [
                {"request_put": {"key": b64(self.released_name(k)), "value": marker}} for k in part
            ]
            failure = [
                {"request_range": {"key": b64(name)}}
                for k in part
                for name in (self.lease_name(k), self.fence_name(k), self.released_name(k))
            ]
            reply = self._txn(compare, success, failure)
            if not reply.get("succeeded"):
                if not self._released_before(lease, reply):
                    return False
                continue
            for response in reply.get("responses", []):
                for kv in response.get("response_delete_range", {}).get("prev_kvs", []):
                    etcd_ids.add(int(kv.get("lease", 0)))
        known = self._known.pop((lease.owner_id, lease.token), 0)
        for lease_id in (etcd_ids or {known}) - {0}:
            self._revoke(lease_id)
        return True

    def _released_before(self, lease: Lease, reply: Mapping[str, Any]) -> bool:
        """True if the failure reads of a release part show it released by ``lease`` itself."""
        found = ranges(reply)
        marker = _release_marker(lease)
        for i in range(0, len(found), 3):
            kv, fence, released = found[i : i + 3]
            if kv is not None or fence is None or fence.mod_revision != lease.token:
                return False
            if released is None or released.value != marker:
                return False
        return True

    def _owner_checks(self, lease: Lease, key: str) -> builtins.list[dict[str, Any]]:
        """Compares true while ``key`` is held by ``lease``'s owner under its token."""
        head = b'{"owner":' + json.dumps(lease.owner_id).encode() + b","
        return [
            cmp_op(self.lease_name(key), "VALUE", head, "GREATER"),
            cmp_op(self.lease_name(key), "VALUE", head[:-1] + b"-", "LESS"),  # "," + 1
            cmp_op(self.fence_name(key), "MOD", lease.token),
        ]


def _release_marker(lease: Lease) -> bytes:
    """The value a release leaves at ``/{prefix}/released/<key>``: who released which grant."""
    return json.dumps(
        {"owner": lease.owner_id, "token": lease.token}, separators=(",", ":")
    ).encode()
