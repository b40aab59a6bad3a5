"""The wire side of the etcd store: members, the JSON encoding, the transaction limit.

- :func:`parse_endpoints`: the members an ``etcd://`` URL names.
- :class:`Members`: one etcd3gw client per member, and *per process*: a
  forked child builds its own on first use, so no keep-alive socket of the
  parent is shared (two processes writing requests on one connection read
  each other's replies).
- :class:`KV` and the builders of compares and operations (etcd's v3 JSON
  gateway: bytes as base64, int64s as strings).
- :func:`chunks`: requests split to stay within etcd's ``--max-txn-ops``
  (the most compares, and the most success or failure operations, one
  transaction may carry; 128 by default).
"""

from __future__ import annotations

import base64
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from celery_lease.exceptions import LeaseConfigError
from celery_lease.stores.base import META_FIELDS, redact_url

__all__ = [
    "DEFAULT_MAX_TXN_OPS",
    "DEFAULT_PORT",
    "KV",
    "Members",
    "b64",
    "chunks",
    "cmp_op",
    "key_range",
    "lease_value",
    "parse_endpoints",
    "prefix_end",
    "ranges",
    "str_or_none",
    "tls_options",
]

DEFAULT_PORT = 2379
#: etcd's own default for ``--max-txn-ops``.
DEFAULT_MAX_TXN_OPS = 128

T = TypeVar("T")
_OPTION_ALIASES = {
    "ssl_ca_certs": "ca_cert",
    "ssl_certfile": "cert_cert",
    "ssl_keyfile": "cert_key",
}
_FILE_OPTIONS = ("ca_cert", "cert_cert", "cert_key")
_OTHER_OPTIONS = ("timeout", "max_txn_ops", "key_prefix")


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


def tls_options(url: str, protocol: str, options: Mapping[str, Any]) -> dict[str, str]:
    """The TLS files among a store's ``options`` (every other name is a config error)."""
    tls: dict[str, str] = {}
    for name, value in options.items():
        canonical = _OPTION_ALIASES.get(name, name)
        if canonical not in _FILE_OPTIONS:
            raise LeaseConfigError(
                f"unknown etcd store option {name!r} (lease_store_options); known: "
                f"{', '.join((*_FILE_OPTIONS, *_OPTION_ALIASES, *_OTHER_OPTIONS))}"
            )
        if value is None:
            continue
        if not isinstance(value, str) or not os.path.exists(value):
            raise LeaseConfigError(f"etcd store option {name!r}: no such file {value!r}")
        tls[canonical] = value
    if tls and protocol != "https":
        raise LeaseConfigError(f"{redact_url(url)}: TLS options {sorted(tls)} need an etcds:// URL")
    if ("cert_cert" in tls) != ("cert_key" in tls):
        raise LeaseConfigError("a client certificate needs both cert_cert and cert_key")
    return tls


@dataclass(frozen=True)
class KV:
    """One key as a range read returned it."""

    create_revision: int
    mod_revision: int
    value: bytes
    lease: int

    @classmethod
    def parse(cls, kv: Mapping[str, Any]) -> KV:
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


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def lease_value(owner_id: str, acquired: float, meta: Mapping[str, str]) -> bytes:
    """The lease key's value. ``owner`` comes first: release compares the value's prefix."""
    record: dict[str, Any] = {"owner": owner_id, "acquired": acquired}
    record.update((f, meta[f]) for f in META_FIELDS if f in meta)
    return json.dumps(record, separators=(",", ":")).encode()


def cmp_op(key: bytes, target: str, value: Any, result: str = "EQUAL") -> dict[str, Any]:
    field = {
        "CREATE": "create_revision",
        "MOD": "mod_revision",
        "VALUE": "value",
        "LEASE": "lease",
    }[target]
    operand = b64(value) if target == "VALUE" else str(value)
    return {"key": b64(key), "result": result, "target": target, field: operand}


def key_range(start: bytes, end: bytes) -> dict[str, str]:
    return {"key": b64(start), "range_end": b64(end)}


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with ``prefix``."""
    data = bytearray(prefix)
    while data and data[-1] == 0xFF:
        data.pop()
    if not data:
        return b"\x00"  # every key
    data[-1] += 1
    return bytes(data)


def ranges(reply: Mapping[str, Any]) -> list[KV | None]:
    """The first kv of each range response of a transaction (None where absent)."""
    out: list[KV | None] = []
    for response in reply.get("responses", []):
        kvs = response.get("response_range", {}).get("kvs", [])
        out.append(KV.parse(kvs[0]) if kvs else None)
    return out


def str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """``items`` in consecutive slices of at most ``size`` (at least one slice)."""
    for start in range(0, max(len(items), 1), size):
        yield items[start : start + size]


#: Member clients a forked child inherited: never closed there (closing would
#: end the parent's connections), only kept from the collector.
_ORPHANS: list[Any] = []


class Members:
    """The etcd3gw clients of one store, built again in a forked child.

    ``current`` is the member requests go to; :meth:`skip` moves on after a
    transport error. The pid check costs one ``os.getpid()`` per request, like
    the Redis store's: cheaper than a round trip by three orders of magnitude.
    """

    def __init__(self, build: Callable[[], list[Any]]) -> None:
        self._build = build
        self._clients = build()
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.current = 0

    def clients(self) -> list[Any]:
        if self._pid != os.getpid():
            # A lock held by another thread at fork would never be released here.
            self._lock = threading.Lock()
            _ORPHANS.append(self._clients)
            self._clients = self._build()
            self._pid = os.getpid()
        return self._clients

    def skip(self, index: int) -> None:
        """After a transport error on member ``index``: the next request goes to the next one."""
        with self._lock:
            if self.current == index:
                self.current = (index + 1) % len(self._clients)

    def close(self) -> None:
        if self._pid == os.getpid():  # a child never closes the parent's sockets
            for client in self._clients:
                client.session.close()
