"""Store and database URLs: their scheme, redaction for logs, and start-time parsing.

The checks parse a URL the way its client will (redis-py, SQLAlchemy), so a
malformed ``lease_store_url`` or ``lease_result_url`` fails at worker start
with the setting's name, not at the first claim. Stores call them from their
:meth:`~celery_lease.stores.base.LeaseStore.check_url`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from celery_lease.exceptions import LeaseConfigError

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

__all__ = [
    "RedisNodes",
    "check_redis_url",
    "check_sql_url",
    "parse_cluster_url",
    "parse_sentinel_url",
    "parse_sql_url",
    "redact_url",
    "scheme_of",
]


#: What may stand before ``://`` (RFC 3986's scheme).
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")


def scheme_of(url: str) -> str:
    """The lower-case scheme of ``url`` (``"postgresql+psycopg"``, ``"etcds"``), or
    ``""`` when what stands before the first ``://`` is no scheme: a URL whose own
    scheme is missing, before a second URL (``:pw@h1;sentinel://...``), would
    otherwise give its password as the "scheme", for an error to quote."""
    head, sep, _ = url.partition("://")
    return head.lower() if sep and _SCHEME.fullmatch(head) else ""


def redact_url(url: str) -> str:
    """``url`` with its password and password-like query parameters masked
    (:func:`celery_lease.redaction.redact_url`), for logs, errors and CLI output."""
    from celery_lease.redaction import redact_url as redact

    return redact(url)


#: Why a URL was refused when its password is what the parser choked on.
_USERINFO_FAULT = "its user info does not parse (percent-encode @ : / ? # ; in a password)"


def _reason(
    parse: Callable[[str], object], url: str, errors: tuple[type[Exception], ...] = (ValueError,)
) -> str:
    """Why ``parse`` refused ``url``, told from the redacted URL.

    A parser quotes the part it choked on, and with a ``#``, ``/`` or ``;`` in
    a password that part is the password's (urllib reads ``:pw#x@h`` as the
    port ``pw``). So the redacted URL is parsed again, and its reason shown
    only if all it quotes is in the redacted URL. Errors re-raised from a
    parser's are raised ``from None``: a traceback prints the parser's message.
    """
    shown = redact_url(url)
    try:
        parse(shown)
    except errors as again:
        reason = str(again)
        if all(quoted in shown for quoted in re.findall(r"'([^']*)'", reason)):
            return reason
    return _USERINFO_FAULT


def _db_path(name: str, url: str, shown: str) -> None:
    """Refuse a Redis URL (or one part of a list, shown as ``shown``) whose path
    is not a database number, quoting the path only if the redacted URL has it
    too: a ``/`` in a password starts the path."""
    path = urlsplit(url).path.strip("/")
    if path and not path.isdigit():
        shown_path = urlsplit(redact_url(url)).path.strip("/")
        if shown_path == path:
            raise LeaseConfigError(
                f"{name}: the path of {shown} must be a Redis database number "
                f"(redis://host:6379/1), got {path!r}"
            )
        raise LeaseConfigError(f"{name}: {shown}: {_USERINFO_FAULT}")


def check_redis_url(name: str, url: str) -> None:
    """Refuse a ``redis://``, ``rediss://`` or ``unix://`` URL redis-py cannot use."""
    from redis.connection import parse_url

    shown = redact_url(url)
    try:
        parsed = parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError:
        raise LeaseConfigError(f"{name}: cannot parse {shown}: {_reason(parse_url, url)}") from None
    if scheme_of(url) == "unix":
        if not parsed.get("path"):
            raise LeaseConfigError(f"{name}: {shown} names no socket path (unix:///path)")
        return
    _db_path(name, url, shown)


def parse_sql_url(name: str, url: str) -> URL:
    """SQLAlchemy's parse of ``url``; a URL it refuses is a LeaseConfigError naming
    ``name`` that quotes no part of the password.

    SQLAlchemy reads a password only up to its first ``@`` (in the query too):
    with an unencoded ``@`` in it, the rest is read as the host and port. A
    port that is not a number is refused with a ValueError quoting it
    (``user:pw@rt:tail@host`` quotes ``'tail@host'``); a host that is a piece
    of the password would be quoted by the driver, failing to resolve it. So
    the host must be the one the URL standard reads (the text after the last
    ``@`` of the authority), or the URL is refused.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        reason = _reason(make_url, url, (ArgumentError, ValueError))
        raise LeaseConfigError(f"{name}: cannot parse {redact_url(url)}: {reason}") from None
    try:
        standard = urlsplit(url).hostname or ""
    except ValueError:  # a "[" or "]" outside an IPv6 host: a password's
        standard = None
    if (parsed.host or "").lower() != standard:
        raise LeaseConfigError(f"{name}: cannot parse {redact_url(url)}: {_USERINFO_FAULT}")
    return parsed


def check_sql_url(name: str, url: str) -> None:
    """Refuse a PostgreSQL or SQLite URL SQLAlchemy cannot parse, or one naming no database."""
    shown = redact_url(url)
    scheme = scheme_of(url)
    parsed = parse_sql_url(name, url)
    port = parsed.port
    if port is not None and not 0 < port < 65536:
        raise LeaseConfigError(f"{name}: port {port} of {shown} is not a TCP port (1-65535)")
    if scheme.startswith("sqlite") and (parsed.database or "") in ("", ":memory:"):
        raise LeaseConfigError(
            f"{name}: {shown} names no file; an SQLite store needs a file shared by all "
            "processes: sqlite:///path (for tests: celery_lease.testing, memory:// leases "
            "and a temporary SQLite file)"
        )
    if scheme.startswith("postgres") and not parsed.database:
        raise LeaseConfigError(
            f"{name}: {shown} names no database (postgresql+psycopg://host/dbname)"
        )


@dataclass(frozen=True)
class RedisNodes:
    """The servers a Sentinel or Cluster URL names, its database and credentials."""

    addresses: tuple[tuple[str, int], ...]
    db: int
    username: str | None
    password: str | None


def parse_sentinel_url(name: str, url: str) -> RedisNodes:
    """kombu's form: ``sentinel://[:pw@]h1:26379;sentinel://h2:26379/1``.

    Each part names one sentinel (port 26379 if none); the database may end any
    part (kombu writes it after the last), and parts that name one must agree.
    A password in a part is the *master's* (as kombu uses it); the sentinels'
    own credentials go in ``lease_store_options['sentinel_kwargs']``.
    """
    parts = [p.strip() for p in url.split(";") if p.strip()]
    shown = redact_url(url)
    if not parts:
        raise LeaseConfigError(f"{name}: {shown} names no sentinel")
    nodes = [_node(name, shown, part, "sentinel", 26379) for part in parts]
    return _combine(name, shown, nodes)


def parse_cluster_url(name: str, url: str) -> RedisNodes:
    """``redis+cluster://[user:pw@]h1:7000,h2:7001[/0]`` (or ``rediss+cluster://``):
    startup nodes, any of which tells the client the rest (port 6379 if none).
    A Redis Cluster serves database 0 only."""
    shown = redact_url(url)
    scheme, rest = url.split("://", 1)
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    prefix = f"{scheme}://{userinfo}{at}"
    nodes = [
        _node(name, shown, f"{prefix}{h}/{path}" if slash else f"{prefix}{h}", scheme, 6379)
        for h in hosts.split(",")
    ]
    parsed = _combine(name, shown, nodes)
    if parsed.db != 0:
        raise LeaseConfigError(f"{name}: {shown}: a Redis Cluster has database 0 only")
    return parsed


def _node(
    name: str, shown: str, part: str, scheme: str, port: int
) -> tuple[str, int, int | None, str | None, str | None]:
    if scheme_of(part) != scheme.lower():
        raise LeaseConfigError(f"{name}: every part of {shown} must start with {scheme}://")
    try:
        split = urlsplit(part)
        node_port = split.port or port
    except ValueError:
        reason = _reason(lambda u: urlsplit(u).port, part)
        raise LeaseConfigError(f"{name}: cannot parse {shown}: {reason}") from None
    if not split.hostname:
        raise LeaseConfigError(f"{name}: {shown} has a part naming no host")
    if split.query or split.fragment:
        raise LeaseConfigError(
            f"{name}: {shown}: client options go in lease_store_options, not the URL's query"
        )
    _db_path(name, part, shown)
    path = split.path.strip("/")
    password = unquote(split.password) if split.password is not None else None
    user = unquote(split.username) if split.username else None
    return split.hostname, node_port, int(path) if path else None, user, password


def _combine(
    name: str, shown: str, nodes: list[tuple[str, int, int | None, str | None, str | None]]
) -> RedisNodes:
    dbs = {db for _, _, db, _, _ in nodes if db is not None}
    if len(dbs) > 1:
        raise LeaseConfigError(f"{name}: {shown} names different databases {sorted(dbs)}")
    user, password = next(((u, p) for _, _, _, u, p in nodes if p is not None), (None, None))
    return RedisNodes(
        tuple((host, port) for host, port, _, _, _ in nodes),
        dbs.pop() if dbs else 0,
        user,
        password,
    )
