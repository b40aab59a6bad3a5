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
5) and ``key_prefix``. Requests go to one member; a member that refuses the
connection is skipped at once, and after any other transport error the next
request goes to the next member.

Layout, per key (the key as given, UTF-8, no hashing)::

    /{prefix}/lease/<key>   value: JSON {"owner", "acquired", task_id, task_name,
                            root_id, tenant}; attached to the claim's etcd lease
    /{prefix}/fence/<key>   empty; put by every claim and evict, never deleted:
                            its mod_revision is the newest token issued

Operations, each built on etcd's own primitives:

- **claim**: grant a fresh etcd lease of the TTL, then one transaction: if
  every lease key is absent (``create_revision == 0``), put each lease key
  attached to that etcd lease and put each fence key; all or nothing. The
  token is the transaction's revision: the ``mod_revision`` of the keys it
  put. One etcd lease per claim. A refused claim revokes its unused etcd
  lease. A live key held by the *same* owner id is granted again (a claim
  retried after a lost reply), with a new token, in one transaction.
- **renew**: the etcd lease's keep-alive. ``renew_many`` reads the lease and
  fence keys of every lease in one transaction (owner and token checked),
  then sends one keep-alive per etcd lease: 1 + N requests for N leases.
  A renewal to a different TTL moves the keys to a new etcd lease (a put with
  ``ignore_value``), which keeps the token: the token lives in the fence key.
- **release**: one transaction deleting the lease keys only if each still
  names this owner (a byte-range compare on the value's ``{"owner":...,``
  prefix) and its fence key still has this token as ``mod_revision``; then
  the etcd lease is revoked.
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
(deferral ETAs) inherit this machine's clock. ``inspect()`` derives expiry from
the lease's remaining TTL, which etcd reports in whole seconds (rounded down):
its ``expires_at`` is an upper estimate within :attr:`expiry_resolution` of the
truth, and ``renewed_at`` is derived from it.
"""

from __future__ import annotations

import base64
import builtins
import json
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from celery_lease.exceptions import LeaseConfigError, LeaseError, StoreUnavailable
from celery_lease.stores.base import META_FIELDS, Lease, LeaseRecord, LeaseStore, redact_url

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

__all__ = ["EtcdLeaseStore", "parse_endpoints"]

DEFAULT_PORT = 2379
DEFAULT_TIMEOUT = 5.0
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
_OPTION_ALIASES = {
    "ssl_ca_certs": "ca_cert",
    "ssl_certfile": "cert_cert",
    "ssl_keyfile": "cert_key",
}
_FILE_OPTIONS = ("ca_cert", "cert_cert", "cert_key")


def parse_endpoints(url: str) -> tuple[str, list[tuple[str, int]]]:
    """``(protocol, [(host, port), ...])`` of an ``etcd://`` / ``etcds://`` URL.

    Raises :class:`LeaseConfigError` for anything else: user info (etcd
    authentication is not supported; use TLS client certificates), a path, a
    query, an empty host or a port outside 1-65535.
    """
    shown = redact_url(url)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("etcd", "etcds"):
        raise LeaseConfigError(f"an etcd store URL is etcd://host:port[,host:port...], got {shown}")
    protocol = "https" if scheme.lower() == "etcds" else "http"
    netloc, _, path = rest.partition("/")
    if "?" in netloc or "#" in netloc or path.strip("/") or "?" in path:
        raise LeaseConfigError(
            f"{shown}: an etcd URL names members only (etcd://host:port[,host:port...]); "
            "set the key prefix with lease_key_prefix"
        )
    if "@" in netloc:
        raise LeaseConfigError(
            f"{shown}: etcd user/password authentication is not supported; "
            "use etcds:// with client certificates (cert_cert, cert_key)"
        )
    endpoints: list[tuple[str, int]] = []
    for part in netloc.split(","):
        part = part.strip()
        if part.startswith("["):  # [v6]:port
            host, _, tail = part[1:].partition("]")
            port_text = tail[1:] if tail.startswith(":") else ""
            if tail and not tail.startswith(":"):
                raise LeaseConfigError(f"{shown}: cannot parse member {part!r}")
        else:
            host, _, port_text = part.partition(":")
        if not host:
            raise LeaseConfigError(f"{shown}: a member without a host ({part!r})")
        try:
            port = int(port_text) if port_text else DEFAULT_PORT
        except ValueError:
            raise LeaseConfigError(f"{shown}: port {port_text!r} is not a number") from None
        if not 0 < port < 65536:
            raise LeaseConfigError(f"{shown}: port {port} is not a TCP port (1-65535)")
        endpoints.append((host, port))
    return protocol, endpoints


@dataclass(frozen=True)
class _KV:
    """One key as a range read returned it."""

    create_revision: int
    mod_revision: int
    value: bytes
    lease: int

    @classmethod
    def parse(cls, kv: Mapping[str, Any]) -> _KV:
        return cls(
            int(kv.get("create_revision", 0)),
            int(kv.get("mod_revision", 0)),
            base64.b64decode(kv.get("value", "")),
            int(kv.get("lease", 0)),
        )

    def fields(self) -> dict[str, Any]:
        """The lease record's JSON fields ({} if the value is not one of ours)."""
        try:
            data = json.loads(self.value)
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    @property
    def owner(self) -> str | None:
        owner = self.fields().get("owner")
        return owner if isinstance(owner, str) else None


class EtcdLeaseStore(LeaseStore):
    """Leases in etcd (see the module docstring for the layout and guarantees)."""

    schemes = ("etcd", "etcds")

    #: seconds after a lease's ``expires_at`` by which etcd has freed its keys
    #: (the leader's 500 ms revocation loop, a Raft commit, the grant's latency)
    expiry_lag = 1.5
    #: ``inspect()``/``list()`` expiry estimates are at most this far above the
    #: store's expiry (etcd reports a lease's remaining TTL in whole seconds)
    expiry_resolution = 1.1

    def __init__(
        self,
        url: str,
        key_prefix: str = "celery-lease",
        *,
        timeout: float = DEFAULT_TIMEOUT,
        **options: Any,
    ) -> None:
        self.url = url
        if Etcd3Client is None:  # pragma: no cover - exercised only without the extra
            raise LeaseConfigError(
                "the etcd lease store needs the etcd3gw client: pip install 'celery-lease[etcd]'"
            )
        protocol, endpoints = parse_endpoints(url)
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
        tls: dict[str, str] = {}
        for name, value in options.items():
            canonical = _OPTION_ALIASES.get(name, name)
            if canonical not in _FILE_OPTIONS:
                raise LeaseConfigError(
                    f"unknown etcd store option {name!r} (lease_store_options); known: "
                    f"{', '.join((*_FILE_OPTIONS, *_OPTION_ALIASES, 'timeout', 'key_prefix'))}"
                )
            if value is None:
                continue
            if not isinstance(value, str) or not os.path.exists(value):
                raise LeaseConfigError(f"etcd store option {name!r}: no such file {value!r}")
            tls[canonical] = value
        if tls and protocol != "https":
            raise LeaseConfigError(
                f"{redact_url(url)}: TLS options {sorted(tls)} need an etcds:// URL"
            )
        if ("cert_cert" in tls) != ("cert_key" in tls):
            raise LeaseConfigError("a client certificate needs both cert_cert and cert_key")
        self.prefix = key_prefix
        self.timeout = float(timeout)
        self.endpoints = endpoints
        self._clients = [
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
        # Passed with every request: a session's own ``verify`` loses to a
        # REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE in the environment (requests #3829),
        # which would silently trust the system CAs instead of ``ca_cert``.
        self._verify: dict[str, Any] = {"verify": tls["ca_cert"]} if "ca_cert" in tls else {}
        self._current = 0
        self._min_ttl = 1  # raised when etcd grants more than asked (its minimum TTL)
        self._lock = threading.Lock()
        self._lease_base = b"/" + prefix_bytes + b"/lease/"
        self._fence_base = b"/" + prefix_bytes + b"/fence/"

    # -- key names ---------------------------------------------------------

    def lease_name(self, key: str) -> bytes:
        return self._lease_base + key.encode()

    def fence_name(self, key: str) -> bytes:
        return self._fence_base + key.encode()

    # -- claim -------------------------------------------------------------

    def do_claim(
        self,
        primary: str,
        keys: tuple[str, ...],
        owner_id: str,
        ttl: float,
        meta: dict[str, str],
    ) -> Lease | None:
        acquired = time.time()
        lease_id, granted = self._grant(ttl)
        value = _b64(_value(owner_id, acquired, meta))
        # Keys this very owner holds (a claim retried after a lost reply) are
        # granted again, with a new token, if unchanged since read: {key: mod_revision}.
        own: dict[str, int] = {}
        superseded: set[int] = set()
        claimed: Lease | None = None
        try:
            for _ in range(3):
                compare = [
                    _cmp(self.lease_name(k), "MOD", own[k])
                    if k in own
                    else _cmp(self.lease_name(k), "CREATE", 0)
                    for k in keys
                ]
                success = [
                    {
                        "request_put": {
                            "key": _b64(self.lease_name(k)),
                            "value": value,
                            "lease": str(lease_id),
                        }
                    }
                    for k in keys
                ] + [{"request_put": {"key": _b64(self.fence_name(k))}} for k in keys]
                failure = [{"request_range": {"key": _b64(self.lease_name(k))}} for k in keys]
                reply = self._txn(compare, success, failure)
                if reply.get("succeeded"):
                    for old in superseded - {lease_id}:
                        self._revoke(old)
                    token = int(reply["header"]["revision"])
                    claimed = Lease(
                        primary, keys, owner_id, token, acquired + granted, acquired,
                        float(granted), meta,
                    )  # fmt: skip
                    return claimed
                held = {k: kv for k, kv in zip(keys, _ranges(reply)) if kv is not None}
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

    # -- renew / release -----------------------------------------------------

    def do_renew_many(
        self, leases: builtins.list[Lease], ttls: builtins.list[float]
    ) -> builtins.list[float | None]:
        kvs = self._read([k for lease in leases for k in lease.keys])
        out: builtins.list[float | None] = []
        for lease, ttl in zip(leases, ttls):
            lease_id = self._owned(lease, kvs)
            if lease_id is None:
                out.append(None)
                continue
            sent = time.time()
            left = self._keepalive(lease_id)
            if left is None:
                out.append(None)
            elif left != self._effective_ttl(ttl):
                out.append(self._move(lease, lease_id, ttl))
            else:
                out.append(sent + left)
        return out

    def _owned(self, lease: Lease, kvs: Mapping[str, tuple[_KV | None, _KV | None]]) -> int | None:
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
        sent = time.time()
        new_id, granted = self._grant(ttl)
        compare = [c for k in lease.keys for c in self._owner_checks(lease, k)]
        compare += [_cmp(self.lease_name(k), "LEASE", old_id) for k in lease.keys]
        success = [
            {
                "request_put": {
                    "key": _b64(self.lease_name(k)),
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
        return sent + granted if moved else None

    def do_release(self, lease: Lease) -> bool:
        compare = [c for k in lease.keys for c in self._owner_checks(lease, k)]
        success = [
            {"request_delete_range": {"key": _b64(self.lease_name(k)), "prev_kv": True}}
            for k in lease.keys
        ]
        reply = self._txn(compare, success, [])
        if not reply.get("succeeded"):
            return False
        for response in reply.get("responses", []):
            for kv in response.get("response_delete_range", {}).get("prev_kvs", []):
                lease_id = int(kv.get("lease", 0))
                if lease_id:
                    self._revoke(lease_id)
                    return True
        return True

    def _owner_checks(self, lease: Lease, key: str) -> builtins.list[dict[str, Any]]:
        """Compares true while ``key`` is held by ``lease``'s owner under its token."""
        head = b'{"owner":' + json.dumps(lease.owner_id).encode() + b","
        return [
            _cmp(self.lease_name(key), "VALUE", head, "GREATER"),
            _cmp(self.lease_name(key), "VALUE", head[:-1] + b"-", "LESS"),  # "," + 1
            _cmp(self.fence_name(key), "MOD", lease.token),
        ]

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
        self, key: str, kv: _KV, fence: _KV | None, left: int, granted: int, now: float
    ) -> LeaseRecord:
        fields = kv.fields()
        # The fence key's mod_revision is the token of the grant (a TTL change
        # re-puts the lease key, so its own mod_revision may be newer).
        token = fence.mod_revision if fence is not None else kv.mod_revision
        if left < 0 or granted <= 0:  # the lease is gone: the key is being deleted
            expires, renewed, ttl = now, None, None
        else:
            expires = now + min(left + 1, granted)
            renewed, ttl = expires - granted, float(granted)
        acquired = fields.get("acquired")
        return LeaseRecord(
            key=key,
            owner_id=kv.owner if left >= 0 else None,
            token=token,
            expires_at=expires,
            acquired_at=float(acquired) if isinstance(acquired, (int, float)) else None,
            renewed_at=renewed,
            ttl=ttl,
            now=now,
            task_id=_str_or_none(fields.get("task_id")),
            task_name=_str_or_none(fields.get("task_name")),
            root_id=_str_or_none(fields.get("root_id")),
            tenant=_str_or_none(fields.get("tenant")),
        )

    def do_list(self, prefix: str, expired: bool) -> builtins.list[LeaseRecord]:
        # etcd deletes expired leases itself: there are no expired records to list.
        lease_from, fence_from = self.lease_name(prefix), self.fence_name(prefix)
        reply = self._txn(
            [],
            [
                {"request_range": _range(lease_from, _prefix_end(lease_from))},
                {"request_range": _range(fence_from, _prefix_end(fence_from))},
            ],
            [],
        )
        leases, fences = (
            r.get("response_range", {}).get("kvs", []) for r in reply.get("responses", [])
        )
        fence_by_key = {
            base64.b64decode(f["key"])[len(self._fence_base) :]: _KV.parse(f) for f in fences
        }
        ttls: dict[int, tuple[int, int]] = {}
        records: builtins.list[LeaseRecord] = []
        for item in leases:
            raw = base64.b64decode(item["key"])[len(self._lease_base) :]
            kv = _KV.parse(item)
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
                _cmp(self.lease_name(key), "MOD", kv.mod_revision)
                if kv is not None
                else _cmp(self.lease_name(key), "CREATE", 0)
            ]
            if token is not None:
                compare.append(_cmp(self.fence_name(key), "MOD", token))
            success: builtins.list[dict[str, Any]] = [
                {"request_put": {"key": _b64(self.fence_name(key))}}
            ]
            if kv is not None:
                success.append({"request_delete_range": {"key": _b64(self.lease_name(key))}})
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
        for client in self._clients:
            client.session.close()

    # -- etcd requests -------------------------------------------------------

    def _read(self, keys: Sequence[str]) -> dict[str, tuple[_KV | None, _KV | None]]:
        """Lease and fence key of every key, read in one linearizable transaction."""
        unique = list(dict.fromkeys(keys))
        ops = [
            {"request_range": {"key": _b64(name)}}
            for k in unique
            for name in (self.lease_name(k), self.fence_name(k))
        ]
        found = _ranges(self._txn([], ops, []))
        return {k: (found[2 * i], found[2 * i + 1]) for i, k in enumerate(unique)}

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
        except _NotFound as e:  # a put naming an etcd lease that ran out meanwhile
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
        except _NotFound:
            return False
        except StoreUnavailable:
            return False
        return True

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST to the current member; skip to the next one while members refuse connections."""
        with self.errors():
            n = len(self._clients)
            for attempt in range(n):
                index = self._current
                client = self._clients[index]
                try:
                    reply: dict[str, Any] = client.post(
                        client.get_url(path), json=payload, **self._verify
                    )
                    return reply
                except (ConnectionFailedError, ConnectionTimeoutError) as e:
                    with self._lock:
                        if self._current == index:
                            self._current = (index + 1) % n
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
                raise _NotFound(_detail(e)) from e
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


class _NotFound(LeaseError):
    """etcd answered NOT_FOUND (a lease that is gone)."""


# -- helpers -------------------------------------------------------------------


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _value(owner_id: str, acquired: float, meta: Mapping[str, str]) -> bytes:
    """The lease key's value. ``owner`` comes first: release compares the value's prefix."""
    record: dict[str, Any] = {"owner": owner_id, "acquired": acquired}
    record.update((f, meta[f]) for f in META_FIELDS if f in meta)
    return json.dumps(record, separators=(",", ":")).encode()


def _cmp(key: bytes, target: str, value: Any, result: str = "EQUAL") -> dict[str, Any]:
    field = {
        "CREATE": "create_revision",
        "MOD": "mod_revision",
        "VALUE": "value",
        "LEASE": "lease",
    }[target]
    operand = _b64(value) if target == "VALUE" else str(value)
    return {"key": _b64(key), "result": result, "target": target, field: operand}


def _range(start: bytes, end: bytes) -> dict[str, str]:
    return {"key": _b64(start), "range_end": _b64(end)}


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with ``prefix``."""
    data = bytearray(prefix)
    while data and data[-1] == 0xFF:
        data.pop()
    if not data:
        return b"\x00"  # every key
    data[-1] += 1
    return bytes(data)


def _ranges(reply: Mapping[str, Any]) -> builtins.list[_KV | None]:
    """The first kv of each range response of a transaction (None where absent)."""
    out: builtins.list[_KV | None] = []
    for response in reply.get("responses", []):
        kvs = response.get("response_range", {}).get("kvs", [])
        out.append(_KV.parse(kvs[0]) if kvs else None)
    return out


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


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
