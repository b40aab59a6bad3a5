"""Readers of one ``lease_*`` setting's value: each takes the setting's name and
the app's value, and returns the value to use or raises :class:`LeaseConfigError`
naming the setting, the value (never a URL's password) and what is accepted.

The table of settings that uses them, and the checks across settings, are in
:mod:`celery_lease.config`.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery_lease.exceptions import LeaseConfigError
from celery_lease.renewal import check_schedule
from celery_lease.stores.base import MAX_TTL
from celery_lease.stores.registry import resolve

if TYPE_CHECKING:
    pass


def check_renew_interval(
    renew: float | None,
    ttl: float,
    name: str,
    clock_drift: float | None = None,
    *,
    ttl_name: str = "lease_ttl",
    drift_name: str = "lease_clock_drift",
) -> None:
    """Refuse a renew interval (None: TTL / 3) that cannot keep a lease of ``ttl``.

    At most half the TTL, and, with ``clock_drift`` (None: the default drift)
    taken off, the first renewal and one retry of it must come before the local
    view of the lease ends (:func:`celery_lease.renewal.check_schedule`).
    ``name`` is the interval's name in the error, ``ttl_name`` and
    ``drift_name`` the others'.
    """
    if renew is not None and renew > ttl / 2:
        raise LeaseConfigError(
            f"{name} ({renew}) must be at most half the TTL ({ttl}) so a renewal can fail "
            "once and still be retried before the lease runs out"
        )
    check_schedule(ttl, renew, clock_drift, names=(ttl_name, name, drift_name))


def check_max_ttl(ttl: float, name: str) -> None:
    """Refuse a TTL over :data:`celery_lease.stores.base.MAX_TTL` (one year)."""
    if ttl > MAX_TTL:
        raise LeaseConfigError(f"{name} must be at most {MAX_TTL:.0f} (one year), got {ttl!r}")


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise LeaseConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return str(value)


def number(name: str, value: Any, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LeaseConfigError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value):
        raise LeaseConfigError(f"{name} must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise LeaseConfigError(f"{name} must be greater than 0, got {value!r}")
    if not positive and value < 0:
        raise LeaseConfigError(f"{name} must not be negative, got {value!r}")
    return float(value)


def count(name: str, value: Any) -> int:
    """A whole number >= 1 (a float like 0.5 must not become 0, which means "off")."""
    n = number(name, value, positive=True)
    if n != int(n):
        raise LeaseConfigError(f"{name} must be a whole number (1, 2, ...), got {value!r}")
    return int(n)


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise LeaseConfigError(f"{name} must be True or False, got {value!r}")
    return value


def string(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise LeaseConfigError(f"{name} must be a non-empty string, got {value!r}")
    return value


def url(name: str, value: Any) -> str:
    store_cls = resolve(value, name)
    # Parsed as its client will, so a malformed URL fails at start, naming ``name``.
    store_cls.check_url(name, value)
    return str(value)  # resolve() accepted it: a str


def optional(parse: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    def parse_unless_none(name: str, value: Any) -> Any:
        return None if value is None else parse(name, value)

    return parse_unless_none


def ttl_seconds(name: str, value: Any) -> float:
    ttl = number(name, value, positive=True)
    check_max_ttl(ttl, name)
    return ttl


def positive(name: str, value: Any) -> float:
    return number(name, value, positive=True)


def seconds_or_timedelta(name: str, value: Any) -> float:
    if hasattr(value, "total_seconds"):
        value = value.total_seconds()
    return number(name, value, positive=True)


def port(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise LeaseConfigError(f"{name} must be a TCP port number, got {value!r}")
    return value


#: A host name as ``getaddrinfo`` takes it (labels of letters, digits and hyphens).
_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?\Z")


def bind_address(name: str, value: Any) -> str:
    """An IPv4/IPv6 address or a host name to bind a server to (no port, no URL)."""
    if isinstance(value, str) and value:
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            if _HOST_NAME.match(value):
                return value
    raise LeaseConfigError(
        f"{name} must be an IP address or host name to listen on (127.0.0.1, 0.0.0.0, ::), "
        f"got {value!r}"
    )


def key_prefix(name: str, value: Any) -> str:
    prefix = string(name, value)
    if "{" in prefix or "}" in prefix:
        # Braces would move the Redis Cluster hash tag off the lease key, so a
        # key's lease and fence counter could land in different slots.
        raise LeaseConfigError(
            f"{name} must not contain '{{' or '}}' (Redis Cluster hash tags), got {prefix!r}"
        )
    return prefix


def options(name: str, value: Any) -> dict[str, Any]:
    given = value or {}
    if not isinstance(given, dict):
        # Named by type, never quoted: options given as pairs hold the password.
        raise LeaseConfigError(
            f"{name} must be a dict of client options, got {type(given).__name__}"
        )
    return dict(given)


def one_of(allowed: tuple[str, ...]) -> Callable[[str, Any], str]:
    def parse_choice(name: str, value: Any) -> str:
        return choice(name, value, allowed)

    return parse_choice
