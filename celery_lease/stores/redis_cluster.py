"""The Redis store on a Redis Cluster: redis-py's ``RedisCluster``, scripts on each key's slot.

URL: ``redis+cluster://[user:pw@]h1:7000,h2:7001`` (``rediss+cluster://`` for
TLS): startup nodes, any one of which tells the client the others. redis-py
itself reads a Cluster from a plain ``redis://`` URL, but here the scheme
chooses the store, and ``redis://`` is one server; ``+cluster`` says which
client the URL is for, as ``postgresql+psycopg`` names its driver.

What changes from one server (:mod:`celery_lease.stores.redis`):

* **One key, one slot.** A key's lease and fence share a hash tag, so every
  single-key operation is one script on the key's master, as on one server.
* **Several keys must share a slot.** A multi-key claim is one script, so all
  or nothing holds only inside one slot: keys that do not share one are
  refused with :class:`LeaseConfigError` before anything is written. Keys that
  begin with the same ``{tag}`` (``{order-42}:payment``, ``{order-42}:refund``)
  share a slot, by Redis's own hash-tag rule.
* **Renewal, list and the sweeper visit every master**, pipelined per node: one
  round trip per master per renewal cycle, whatever the number of leases.
* **Failover**: redis-py follows MOVED/ASK and re-reads the slot map after a
  connection error; a call that still fails raises :class:`StoreUnavailable`.
  A per-node pipeline answered MOVED (the slot moved) sends that call again
  through the cluster client, which follows the redirect.
* The client connects on first use, not when the store is built: a worker
  starts while the cluster is down, and its claims wait (StoreUnavailable).
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis.cluster import REDIS_ALLOWED_KEYS, ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_lease.exceptions import LeaseConfigError, StoreUnavailable
from celery_lease.stores.base import (
    Lease,
    LeaseRecord,
    check_option_names,
    redact_url,
    refuse_key_prefix_option,
)
from celery_lease.stores.redis import (
    RedisLeaseStore,
    _glob_escape,
    _str,
    _tag,
    _untag,
    check_cert_files,
    client_defaults,
)
from celery_lease.stores.redis_scripts import CLAIM, EVICT, INSPECT, MARK, RELEASE, RENEW
from celery_lease.stores.redis_transport import server_reply
from celery_lease.stores.redis_wait import wait_policy
from celery_lease.urls import parse_cluster_url

__all__ = ["ClusterLeaseStore", "ClusterTransport"]

#: RedisCluster's own options (the rest are each node's client options).
_CLUSTER_OPTIONS = frozenset(
    {"cluster_error_retry_attempts", "require_full_coverage", "reinitialize_steps",
     "dynamic_startup_nodes", "address_remap"}
)  # fmt: skip
#: Options that would send reads to replicas: leases are read where they are written.
_REFUSED = ("read_from_replicas", "load_balancing_strategy")
#: Error replies after which a call is sent again through the cluster client.
_REDIRECTS = frozenset({"MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "READONLY"})

Call = tuple[Script, builtins.list[str], builtins.list[Any]]


class ClusterTransport:
    """Scripts on a RedisCluster: one at a time through the client, or pipelined per node."""

    direct = False

    def __init__(self, store: ClusterLeaseStore) -> None:
        self.store = store

    def run(self, script: Script, keys: builtins.list[str], args: builtins.list[Any]) -> Any:
        try:
            return script(keys=keys, args=args, client=self.store.client)
        except RedisClusterException as e:  # no reachable node, a slot not served
            raise RedisConnectionError(f"Redis Cluster: {e}") from e

    def run_waited(
        self,
        script: Script,
        keys: builtins.list[str],
        args: builtins.list[Any],
        replicas: int,
        timeout_ms: int,
    ) -> tuple[Any, int]:
        replies, acked = self.run_on_nodes([(script, keys, args)], (replicas, timeout_ms))
        return replies[0], acked

    def run_on_nodes(
        self, calls: Sequence[Call], wait: tuple[int, int] | None = None
    ) -> tuple[builtins.list[Any], int]:
        """Every call on the master of its first key, one pipeline per node
        (``WAIT`` last in each): the replies in order, and the fewest replicas any
        node's WAIT counted (0 without ``wait``)."""
        cluster = self.store.client
        # Grouped by the node's name ("host:port"): ClusterNode is not hashable
        # in redis-py 5.
        nodes: dict[str, ClusterNode] = {}
        by_node: dict[str, builtins.list[int]] = {}
        replies: builtins.list[Any] = [None] * len(calls)
        acked: int | None = None
        try:
            for i, (_, keys, _) in enumerate(calls):
                node = cluster.get_node_from_key(keys[0])  # type: ignore[no-untyped-call]
                nodes.setdefault(node.name, node)
                by_node.setdefault(node.name, []).append(i)
            for name, indexes in by_node.items():
                node = nodes[name]
                got, node_acked = self._on_node(cluster, node, [calls[i] for i in indexes], wait)
                for i, reply in zip(indexes, got):
                    replies[i] = reply
                acked = node_acked if acked is None else min(acked, node_acked)
        except RedisClusterException as e:  # no reachable node, a slot not served
            raise RedisConnectionError(f"Redis Cluster: {e}") from e
        return replies, acked or 0

    def _on_node(
        self,
        cluster: RedisCluster,
        node: ClusterNode,
        calls: Sequence[Call],
        wait: tuple[int, int] | None,
    ) -> tuple[builtins.list[Any], int]:
        client = cluster.get_redis_connection(node)
        try:
            out = _pipelined(client, calls, wait)
            missing = [i for i, r in enumerate(out[: len(calls)]) if isinstance(r, NoScriptError)]
            if missing:  # a promoted replica or a restarted node: its script cache is empty
                for script in {id(calls[i][0]): calls[i][0] for i in missing}.values():
                    client.script_load(script.script)
                again = _pipelined(client, [calls[i] for i in missing], wait)
                for j, i in enumerate(missing):
                    out[i] = again[j]
                if wait is not None:
                    out[-1] = again[-1]
        except (RedisConnectionError, RedisTimeoutError):
            # The node is gone: each call through the cluster client, which
            # re-reads the slot map and finds the promoted replica.
            rerun = [self.run(*call) for call in calls]
            return rerun, self._wait_on(calls[0][1][0], wait) if wait is not None else 0
        replies: builtins.list[Any] = []
        redirected = False
        for call, reply in zip(calls, out):
            if isinstance(reply, ResponseError):
                if server_reply(reply)[0] not in _REDIRECTS:
                    raise reply
                # The slot moved: the cluster client follows the redirect.
                reply, redirected = self.run(*call), True
            replies.append(reply)
        if wait is None:
            return replies, 0
        if redirected:  # the writes landed on another node: count its replicas
            return replies, self._wait_on(calls[0][1][0], wait)
        return replies, 0 if isinstance(out[-1], Exception) else int(out[-1])

    def _wait_on(self, key: str, wait: tuple[int, int]) -> int:
        cluster = self.store.client
        node = cluster.get_node_from_key(key)  # type: ignore[no-untyped-call]
        return int(cluster.get_redis_connection(node).execute_command("WAIT", *wait))  # type: ignore[no-untyped-call]

    def close(self) -> None:
        """Nothing kept: the cluster client owns its connections."""


def _pipelined(client: redis.Redis, calls: Sequence[Call], wait: tuple[int, int] | None) -> Any:
    with client.pipeline(transaction=False) as pipe:
        for script, keys, args in calls:
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)  # type: ignore[no-untyped-call]
        if wait is not None:
            pipe.execute_command("WAIT", *wait)  # type: ignore[no-untyped-call]
        return pipe.execute(raise_on_error=False)


class ClusterLeaseStore(RedisLeaseStore):
    """The Redis store on a Redis Cluster (see the module docstring)."""

    @classmethod
    def check_url(cls, name: str, url: str) -> None:
        parse_cluster_url(name, url)

    @classmethod
    def check_options(cls, url: str, options: Mapping[str, Any], key_prefix: str) -> None:
        check_option_names(options)
        refuse_key_prefix_option(options)
        check_cert_files(options)
        cls(url, **cls.options_from_settings(options, key_prefix)).close()

    def __init__(self, url: str, key_prefix: str = "celery-lease", **options: Any) -> None:
        self.url = url
        self.prefix = key_prefix
        self.wait = wait_policy(options)
        for name in _REFUSED:
            if name in options:
                raise LeaseConfigError(
                    f"lease_store_options[{name!r}]: leases are read from the masters only "
                    "(a replica's copy may be behind)"
                )
        # redis-py 5's cluster client drops socket_read_size (6 passes it on).
        client_defaults(options, read_size="socket_read_size" in REDIS_ALLOWED_KEYS)
        nodes = parse_cluster_url("lease_store_url", url)
        if nodes.password is not None:
            options.setdefault("password", nodes.password)
            if nodes.username:
                options.setdefault("username", nodes.username)
        if url.lower().startswith("rediss+"):
            options.setdefault("ssl", True)
        self._startup = [ClusterNode(host, port) for host, port in nodes.addresses]  # type: ignore[no-untyped-call]
        self._options = options
        _check_node_options(url, options)
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()
        # Scripts are bound to a client only for their encoding (the SHA1 of the
        # text); every call names the cluster client explicitly.
        scripts = redis.Redis(**_encoding(options))
        self._claim = scripts.register_script(CLAIM)
        self._renew = scripts.register_script(RENEW)
        self._release = scripts.register_script(RELEASE)
        self._inspect = scripts.register_script(INSPECT)
        self._evict = scripts.register_script(EVICT)
        self._mark = scripts.register_script(MARK)
        self.nodes = ClusterTransport(self)
        self.transport = self.nodes  # type: ignore[assignment]
        self._run = self.nodes.run

    @property
    def client(self) -> RedisCluster:  # type: ignore[override]
        """The cluster client, connected on first use (it reads the slot map then)."""
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    try:
                        self._client = RedisCluster(startup_nodes=self._startup, **self._options)
                    except (RedisClusterException, RedisError) as e:
                        raise StoreUnavailable(
                            f"Redis Cluster {redact_url(self.url)} unavailable: {e}"
                        ) from e
                client = self._client
        return client

    def do_claim(
        self,
        primary: str,
        keys: tuple[str, ...],
        owner_id: str,
        ttl: float,
        meta: dict[str, str],
    ) -> Lease | None:
        if len(keys) > 1:
            slots = {key_slot(self.lease_name(k).encode()) for k in keys}
            if len(slots) > 1:
                raise LeaseConfigError(
                    f"a claim of several keys on a Redis Cluster needs keys in one hash slot "
                    f"(all or nothing is one script on one node); {list(keys)} fall in "
                    f"{len(slots)} slots. Begin them with one hash tag: '{{tag}}:name'."
                )
        return super().do_claim(primary, keys, owner_id, ttl, meta)

    def do_renew_many(
        self, leases: builtins.list[Lease], ttls: builtins.list[float]
    ) -> builtins.list[float | None]:
        by_slot: dict[int, builtins.list[int]] = {}
        for i, lease in enumerate(leases):
            by_slot.setdefault(key_slot(self.lease_name(lease.key).encode()), []).append(i)
        groups = list(by_slot.values())
        calls: builtins.list[Call] = []
        for group in groups:
            names, args = self.renew_call([leases[i] for i in group], [ttls[i] for i in group])
            calls.append((self._renew, names, args))
        wait = self.wait
        with self.errors():
            replies, acked = self.nodes.run_on_nodes(
                calls, None if wait is None else (wait.replicas, wait.timeout_ms)
            )
        if wait is not None and acked < wait.replicas:
            self.unreplicated_renewal(wait, len(leases), acked)
        answers: builtins.list[float | None] = [None] * len(leases)
        for group, reply in zip(groups, replies):
            for i, r in zip(group, reply):
                answers[i] = None if int(r) == 0 else int(r) / 1e6
        return answers

    def do_list(self, prefix: str, expired: bool) -> builtins.list[LeaseRecord]:
        head = f"{self.prefix}:lease:{{"
        keys = [
            _untag(n[len(head) : -1])
            for n in self.scan_names(_glob_escape(head + _tag(prefix)) + "*")
        ]
        keys.sort()
        calls: builtins.list[Call] = [
            (self._inspect, [self.lease_name(k), self.fence_name(k)], []) for k in keys
        ]
        with self.errors():
            replies = self.nodes.run_on_nodes(calls)[0] if calls else []
        records = [self._record(k, r) for k, r in zip(keys, replies)]
        return [r for r in records if r is not None and r.owner_id is not None]

    def scan_names(self, match: str) -> builtins.list[str]:
        """The names matching ``match`` on every master."""
        with self.errors():
            return [_str(n) for n in self.client.scan_iter(match=match, count=1000)]

    def mark(self, name: str, owner_id: str, *, ttl: float, replace: Sequence[str] = ()) -> bool:
        marker = f"{self.prefix}:mark:{name}"
        with self.errors():
            done = self._run(self._mark, [marker], [owner_id, max(1, round(ttl * 1000)), *replace])
        return int(done) == 1

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    @contextmanager
    def errors(self) -> Iterator[None]:
        try:
            yield
        except RedisClusterException as e:
            raise StoreUnavailable(f"Redis Cluster {redact_url(self.url)} unavailable: {e}") from e
        except RedisError as e:
            raise self._translate(e) from e


def _encoding(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: options[k] for k in ("encoding", "encoding_errors") if k in options}


def _check_node_options(url: str, options: Mapping[str, Any]) -> None:
    """Build one node's client and connection (no I/O): an unknown option fails now."""
    node = {k: v for k, v in options.items() if k not in _CLUSTER_OPTIONS}
    try:
        client = redis.Redis(**node)
        pool = client.connection_pool
        pool.connection_class(**pool.connection_kwargs)
    except (ValueError, TypeError, RedisError) as e:
        raise LeaseConfigError(
            f"bad Redis Cluster URL or client options for {redact_url(url)} "
            f"(lease_store_url / lease_store_options): {e}"
        ) from e
