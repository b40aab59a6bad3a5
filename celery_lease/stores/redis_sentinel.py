"""The Redis store behind Redis Sentinel: the master the sentinels name, followed across failovers.

URL, kombu's form (so a Celery user reuses what the broker URL already says)::

    lease_store_url = "sentinel://h1:26379;sentinel://h2:26379;sentinel://h3:26379/1"
    lease_store_options = {"master_name": "mymaster"}

redis-py's ``Sentinel(...).master_for(master_name)`` gives the client: every
new connection asks the sentinels for the current master, so after a failover
the store talks to the promoted replica. Everything else is the Redis store's
(:mod:`celery_lease.stores.redis`): same scripts, keys and token rule. What
follows a failover:

* a connection to the dead master fails (ConnectionError): the transport
  reconnects once, through the sentinels, and the call is retried by the
  client's Retry policy; while the sentinels still name the dead master (their
  ``down-after-milliseconds``), calls raise :class:`StoreUnavailable`;
* a connection to a demoted master answers READONLY: redis-py's sentinel
  connection turns that into a ConnectionError (reconnect, as above);
* the promoted replica has no cached scripts: NOSCRIPT is answered with EVAL.

Options: ``master_name`` (required), ``sentinel_kwargs`` (the sentinels' own
connection options: password, TLS; default: the socket timeouts of the
master's), ``min_other_sentinels``; the rest are the master's client options,
as for ``redis://`` (``password``, ``ssl``, ``ssl_ca_certs``, ...), and the
replication wait (:mod:`celery_lease.stores.redis_wait`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis
from redis.sentinel import Sentinel

from celery_lease.exceptions import LeaseConfigError
from celery_lease.stores.base import check_option_names, refuse_key_prefix_option
from celery_lease.stores.redis import RedisLeaseStore, check_cert_files
from celery_lease.urls import parse_sentinel_url

__all__ = ["SentinelLeaseStore"]


class SentinelLeaseStore(RedisLeaseStore):
    @classmethod
    def check_url(cls, name: str, url: str) -> None:
        parse_sentinel_url(name, url)

    @classmethod
    def check_options(cls, url: str, options: Mapping[str, Any], key_prefix: str) -> None:
        """``master_name`` is required; certificate files must exist; the clients
        are built (no I/O) so an unknown option fails at worker start."""
        check_option_names(options)
        refuse_key_prefix_option(options)
        _master_name(options)
        check_cert_files(options)
        sentinel_kwargs = options.get("sentinel_kwargs")
        if sentinel_kwargs is not None:
            if not isinstance(sentinel_kwargs, Mapping):
                raise LeaseConfigError(
                    "lease_store_options['sentinel_kwargs'] must be a dict of the "
                    f"sentinels' connection options, got {type(sentinel_kwargs).__name__}"
                )
            check_cert_files(sentinel_kwargs, "sentinel_kwargs")
        cls(url, **cls.options_from_settings(options, key_prefix)).close()

    def make_client(self, url: str, options: dict[str, Any]) -> redis.Redis:
        master_name = _master_name(options)
        del options["master_name"]
        sentinel_kwargs = options.pop("sentinel_kwargs", None)
        min_other = options.pop("min_other_sentinels", 0)
        nodes = parse_sentinel_url("lease_store_url", url)
        if nodes.password is not None:
            options.setdefault("password", nodes.password)
            if nodes.username:
                options.setdefault("username", nodes.username)
        if sentinel_kwargs is None:
            # The master's timeouts; not its read size, which redis-py 5's client
            # constructor (what Sentinel builds for each sentinel) does not take.
            sentinel_kwargs = {
                k: v
                for k, v in options.items()
                if k.startswith("socket_") and k != "socket_read_size"
            }
        # Newer redis-py (8.2 here) types Sentinel, older releases do not: the
        # ignores name unused-ignore so that mypy --strict passes on both.
        self.sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            list(nodes.addresses),
            min_other_sentinels=min_other,
            sentinel_kwargs=dict(sentinel_kwargs),
        )
        for client in self.sentinel.sentinels:  # built, not connected: options are checked
            pool = client.connection_pool
            pool.connection_class(**pool.connection_kwargs)
        master: redis.Redis = self.sentinel.master_for(  # type: ignore[no-untyped-call, unused-ignore]
            master_name, db=nodes.db, **options
        )
        return master

    def close(self) -> None:
        super().close()
        for client in self.sentinel.sentinels:
            client.close()


def _master_name(options: Mapping[str, Any]) -> str:
    name = options.get("master_name")
    if not isinstance(name, str) or not name:
        raise LeaseConfigError(
            "a sentinel:// lease store needs lease_store_options['master_name']: the name "
            f"the sentinels monitor the master under (sentinel monitor <name> ...), got {name!r}"
        )
    return name
