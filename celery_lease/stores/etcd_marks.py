"""Internal markers in the etcd store (a part of :class:`EtcdLeaseStore`).

A marker (a deferral chain's ``celery-lease/defer/...``) is not a lease: no
token, so no fence key. It is one key, ``/{prefix}/mark/<name>``, whose value
is the owner id, attached to an etcd lease of the marker's TTL: etcd deletes
it when that runs out, and nothing of it is left behind. (Made as a claim, as
the default :meth:`LeaseStore.mark` does, every deferral left a fence key
that is never deleted.)
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from celery_lease.stores.etcd_wire import b64, cmp_op, ranges

__all__ = ["Markers"]


class Markers:
    """``mark`` and ``marker`` of :class:`~celery_lease.stores.etcd.EtcdLeaseStore`."""

    prefix: str

    if TYPE_CHECKING:  # provided by EtcdLeaseStore

        def _txn(
            self,
            compare: builtins.list[dict[str, Any]],
            success: builtins.list[dict[str, Any]],
            failure: builtins.list[dict[str, Any]],
        ) -> dict[str, Any]: ...
        def _grant(self, ttl: float) -> tuple[int, int]: ...
        def _revoke(self, lease_id: int) -> bool: ...

    def mark_name(self, name: str) -> bytes:
        return b"/" + self.prefix.encode() + b"/mark/" + name.encode()

    def mark(self, name: str, owner_id: str, *, ttl: float, replace: Sequence[str] = ()) -> bool:
        """Set the marker unless another owner's is there; this owner's own (or
        one of ``replace``'s) is moved to a fresh etcd lease of ``ttl``, compared
        by its revision. Two round trips: the grant, then one transaction (two
        when extending or replacing)."""
        key = self.mark_name(name)
        lease_id, _ = self._grant(ttl)
        put = {"request_put": {"key": b64(key), "value": b64(owner_id), "lease": str(lease_id)}}
        done = False
        try:
            reply = self._txn(
                [cmp_op(key, "CREATE", 0)], [put], [{"request_range": {"key": b64(key)}}]
            )
            if reply.get("succeeded"):
                done = True
                return True
            kv = ranges(reply)[0]
            if kv is None or kv.value.decode(errors="replace") not in (owner_id, *replace):
                return False  # another copy's marker (or it expired just now: the next try wins)
            reply = self._txn([cmp_op(key, "MOD", kv.mod_revision)], [put], [])
            done = bool(reply.get("succeeded"))
            if done and kv.lease:
                self._revoke(kv.lease)  # no key is attached to it any more
            return done
        finally:
            if not done:
                self._revoke(lease_id)

    def marker(self, name: str) -> str | None:
        """The owner of the live marker ``name``, or None (etcd deleted it on expiry)."""
        kv = ranges(self._txn([], [{"request_range": {"key": b64(self.mark_name(name))}}], []))[0]
        return kv.value.decode(errors="replace") if kv is not None else None
