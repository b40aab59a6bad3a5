"""The etcd store's requests to etcd's v3 JSON gateway, and their errors.

One POST per request to the current member (a member refusing the connection
is skipped at once; see :class:`~celery_lease.stores.etcd_wire.Members`), and
etcd3gw's errors translated into celery-lease's: the one place that decides.
"""

from __future__ import annotations

import builtins
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery_lease.exceptions import LeaseError, StoreUnavailable
from celery_lease.stores.base import redact_url
from celery_lease.stores.etcd_wire import Members

try:
    import requests
    from etcd3gw.client import Etcd3Client
    from etcd3gw.exceptions import (
        ConnectionFailedError,
        ConnectionTimeoutError,
        Etcd3Exception,
        InternalServerError,
    )
except ImportError:  # pragma: no cover - exercised only without the extra
    Etcd3Client = None  # type: ignore[assignment,misc]

__all__ = ["Etcd3Client", "EtcdRequests", "NotFound"]

#: The gRPC status codes (etcd's JSON errors carry them) that mean "not now"
#: (StoreUnavailable), with the reason the error names; any other code is
#: LeaseError (NOT_FOUND, a lease that is gone, is handled by the callers).
#: Errors without a code are decided by their class (see ``errors``).
_TRANSIENT_CODES: dict[int, str] = {
    1: "the request was cancelled (a member stopping?)",  # CANCELLED
    4: "the request timed out (a leader election, a slow quorum)",  # DEADLINE_EXCEEDED
    8: "the cluster refuses writes (space quota alarm) or too many requests",  # EXHAUSTED
    10: "the request was aborted",  # ABORTED
    13: "a member's internal error",  # INTERNAL
    14: "no leader, the leader changed, or the member is not ready",  # UNAVAILABLE
}
_NOT_FOUND = 5


class NotFound(LeaseError):
    """etcd answered NOT_FOUND (a lease that is gone)."""


class EtcdRequests:
    """The etcd requests of :class:`~celery_lease.stores.etcd.EtcdLeaseStore` (a part of it)."""

    url: str
    _members: Members
    #: ``requests``' ``verify`` for every request (see EtcdLeaseStore.__init__)
    _verify: dict[str, Any]
    #: raised when etcd grants more than asked (its minimum TTL)
    _min_ttl: int

    def _txn(
        self,
        compare: builtins.list[dict[str, Any]],
        success: builtins.list[dict[str, Any]],
        failure: builtins.list[dict[str, Any]],
    ) -> dict[str, Any]:
        try:
            return self._post(
                "kv/txn", {"compare": compare, "success": success, "failure": failure}
            )
        except NotFound as e:  # a put naming an etcd lease that ran out meanwhile
            raise StoreUnavailable(
                f"etcd {redact_url(self.url)}: the etcd lease ran out before the transaction "
                f"was applied (a slow request or an election): {e}"
            ) from e

    def _effective_ttl(self, ttl: float) -> int:
        return max(math.ceil(ttl - 1e-9), self._min_ttl)

    def _grant(self, ttl: float) -> tuple[int, int]:
        want = self._effective_ttl(ttl)
        reply = self._post("lease/grant", {"TTL": want, "ID": 0})
        granted = int(reply.get("TTL", 0))
        if reply.get("error") or granted <= 0:
            raise LeaseError(f"etcd {redact_url(self.url)} refused a lease grant: {reply}")
        if granted > want:
            self._min_ttl = max(self._min_ttl, granted)
        return int(reply["ID"]), granted

    def _keepalive(self, lease_id: int) -> int | None:
        """Refresh the etcd lease; its TTL, or None once it is gone."""
        reply = self._post("lease/keepalive", {"ID": str(lease_id)})
        left = int(reply.get("result", {}).get("TTL", -1))
        return left if left > 0 else None

    def _time_to_live(self, lease_id: int) -> tuple[int, int]:
        """``(remaining TTL in whole seconds, rounded down; granted TTL)``; (-1, 0) if gone."""
        if not lease_id:
            return -1, 0
        reply = self._post("kv/lease/timetolive", {"ID": str(lease_id)})
        # proto3 JSON leaves zeros out: no "TTL" is 0 s left (rounded down);
        # a lease that is gone has TTL -1 and no grantedTTL.
        return int(reply.get("TTL", 0)), int(reply.get("grantedTTL", 0))

    def _revoke(self, lease_id: int) -> bool:
        """Revoke an etcd lease (cleanup: best effort; it expires by itself otherwise)."""
        try:
            self._post("kv/lease/revoke", {"ID": str(lease_id)})
        except NotFound:
            return False
        except StoreUnavailable:
            return False
        return True

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST to the current member; skip to the next one while members refuse connections."""
        with self.errors():
            clients = self._members.clients()  # this process's own (rebuilt after fork)
            n = len(clients)
            for attempt in range(n):
                index = self._members.current
                client = clients[index]
                try:
                    reply: dict[str, Any] = client.post(
                        client.get_url(path), json=payload, **self._verify
                    )
                    return reply
                except (ConnectionFailedError, ConnectionTimeoutError) as e:
                    self._members.skip(index)
                    if not _never_sent(e) or attempt == n - 1:
                        raise
            raise AssertionError("unreachable")

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Translate etcd3gw errors into celery-lease's (the one place that does)."""
        try:
            yield
        except Etcd3Exception as e:
            code = _code(e)
            if code == _NOT_FOUND:
                raise NotFound(_detail(e)) from e
            where = redact_url(self.url)
            reason = _TRANSIENT_CODES.get(code) if code is not None else None
            if reason is None and isinstance(
                e, (ConnectionFailedError, ConnectionTimeoutError, InternalServerError)
            ):
                # No connection, HTTP 503/504/500 without a gRPC status, a timeout
                reason = "unreachable"
            if reason is not None:
                raise StoreUnavailable(f"etcd {where} unavailable: {reason}: {_detail(e)}") from e
            raise LeaseError(f"etcd {where}: {_detail(e)}") from e
        except ValueError as e:  # a reply that is not JSON: not an etcd gateway
            raise LeaseError(f"etcd {redact_url(self.url)}: unexpected reply: {e}") from e


def _never_sent(exc: BaseException) -> bool:
    """True when the request never reached the member (connection refused or timed out)."""
    cause = exc.__context__
    if isinstance(cause, requests.exceptions.ConnectTimeout):
        return True
    if isinstance(cause, requests.exceptions.ConnectionError):
        reason: Any = cause.args[0] if cause.args else None
        reason = getattr(reason, "reason", reason)
        return type(reason).__name__ in ("NewConnectionError", "ConnectTimeoutError")
    return False


def _detail(exc: Etcd3Exception) -> str:
    text = exc.detail_text or ""
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:300] or type(exc).__name__
    if isinstance(data, dict):
        return str(data.get("message") or data.get("error") or text)[:300]
    return text[:300]


def _code(exc: Etcd3Exception) -> int | None:
    try:
        data = json.loads(exc.detail_text or "")
    except ValueError:
        return None
    code = data.get("code") if isinstance(data, dict) else None
    return code if isinstance(code, int) else None
