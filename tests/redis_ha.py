"""Redis as users run it past one server: Sentinel and Cluster, private instances.

* :class:`SentinelDeployment`: one master, two replicas, three sentinels
  (quorum 2), the layout Redis's own Sentinel docs recommend for a first
  deployment. Failure detection is shortened (``down-after-milliseconds``
  1 s) so that a failover takes seconds, not the default 30 s.
* :class:`ClusterDeployment`: three masters with one replica each
  (``redis-cli --cluster create ... --cluster-replicas 1``),
  ``cluster-node-timeout`` 1 s.

Every node is a :class:`tests.servers.RedisServer` (own port, own directory,
parent-death signal), so a test can SIGKILL, pause or restart any of them.
Readiness is proven, never slept for: the replicas' links are up and the
sentinels see each other and every replica; every cluster node reports
``cluster_state:ok`` with every slot served and every master replicated.
After :meth:`kill_master` the ``wait_failover`` methods return once a former
replica serves as master, as the sentinels (or the cluster) see it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from redis.cluster import RedisCluster

from tests.servers import LOOPBACK, RedisServer, wait_for

__all__ = ["SENTINEL_MASTER", "ClusterDeployment", "SentinelDeployment", "SentinelServer"]

#: The name the deployments' sentinels monitor their master under
#: (the store's ``master_name`` option).
SENTINEL_MASTER = "leases"

#: seconds a replica link, a sentinel's view or the cluster may take to settle
SETTLE = 30.0
#: Any node may become a master: none waits the default 5 s before a replica's sync.
NO_DELAY = ["--repl-diskless-sync-delay", "0"]


def _client(port: int) -> redis.Redis:
    return redis.Redis(host=LOOPBACK, port=port, socket_timeout=2.0, decode_responses=True)


def _role(port: int) -> str | None:
    """``master``, ``slave`` (Redis's word) or ``sentinel``; None when it does not answer."""
    try:
        with _client(port) as c:
            return str(c.execute_command("ROLE")[0])
    except redis.RedisError:
        return None


class SentinelServer(RedisServer):
    """``redis-server sentinel.conf --sentinel`` monitoring one master."""

    name = "sentinel"

    def __init__(
        self,
        tmpdir: str | os.PathLike[str],
        master_name: str,
        master_port: int,
        *,
        quorum: int = 2,
        down_after_ms: int = 1000,
    ) -> None:
        super().__init__(tmpdir, appendonly=False)
        self.master_name = master_name
        self.master_port = master_port
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.conf = self.base / "sentinel.conf"

    def _prepare(self) -> None:
        # Sentinel rewrites its configuration file (the replicas and other
        # sentinels it discovers, the current epoch): it must be writable.
        name = self.master_name
        self.conf.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    f"bind {LOOPBACK}",
                    f"dir {self.data_dir}",
                    f"sentinel monitor {name} {LOOPBACK} {self.master_port} {self.quorum}",
                    f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
                    f"sentinel failover-timeout {name} 10000",
                    f"sentinel parallel-syncs {name} 1",
                    "",
                ]
            )
        )

    def _argv(self) -> list[str]:
        return [self.binary, str(self.conf), "--sentinel", "--logfile", "", "--daemonize", "no"]

    def master_address(self) -> tuple[str, int] | None:
        try:
            with _client(self.port) as c:
                addr = c.sentinel_get_master_addr_by_name(self.master_name)
        except redis.RedisError:
            return None
        return (str(addr[0]), int(addr[1])) if addr else None

    def sees(self) -> tuple[int, int]:
        """(replicas, other sentinels) this sentinel knows of and holds for up."""
        with _client(self.port) as c:
            replicas = c.sentinel_slaves(self.master_name)
            others = c.sentinel_sentinels(self.master_name)

        def up(entries: list[dict[str, Any]]) -> int:
            return sum(
                1
                for e in entries
                if not (e.get("is_sdown") or e.get("is_odown") or e.get("is_disconnected"))
            )

        return up(replicas), up(others)


class SentinelDeployment:
    """One master, ``replicas`` replicas, ``sentinels`` sentinels on loopback."""

    def __init__(
        self,
        tmpdir: str | os.PathLike[str],
        *,
        master_name: str = SENTINEL_MASTER,
        replicas: int = 2,
        sentinels: int = 3,
    ) -> None:
        self.tmpdir = Path(tmpdir)
        self.master_name = master_name
        self.nodes: list[RedisServer] = [RedisServer(tmpdir, appendonly=False, extra_args=NO_DELAY)]
        primary = self.nodes[0].port
        for _ in range(replicas):
            self.nodes.append(
                RedisServer(
                    tmpdir,
                    appendonly=False,
                    extra_args=[*NO_DELAY, "--replicaof", LOOPBACK, str(primary)],
                )
            )
        self.sentinels = [
            SentinelServer(tmpdir, master_name, primary, quorum=sentinels // 2 + 1)
            for _ in range(sentinels)
        ]

    def start(self) -> SentinelDeployment:
        for node in self.nodes:
            node.start()
        for replica in self.nodes[1:]:
            wait_for(
                lambda r=replica: self._link_up(r.port),
                SETTLE,
                f"replica {replica.port} linked to its master",
            )
        for s in self.sentinels:
            s.start()
        want = (len(self.nodes) - 1, len(self.sentinels) - 1)
        for s in self.sentinels:
            wait_for(lambda s=s: s.sees() == want, SETTLE, f"sentinel {s.port} seeing {want}")
        return self

    @staticmethod
    def _link_up(port: int) -> bool:
        with _client(port) as c:
            return c.info("replication").get("master_link_status") == "up"

    # -- what a client is given ---------------------------------------------------

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [(LOOPBACK, s.port) for s in self.sentinels]

    def url(self, db: int = 0) -> str:
        """kombu's form: ``sentinel://h:p;sentinel://h:p;.../db``."""
        return ";".join(f"sentinel://{h}:{p}" for h, p in self.sentinel_addresses) + f"/{db}"

    # -- faults ---------------------------------------------------------------------

    def master(self) -> RedisServer:
        """The node the sentinels name master now."""
        addr = wait_for(lambda: self._agreed_master(), SETTLE, "the sentinels agreeing on a master")
        return next(n for n in self.nodes if n.port == addr[1])

    def _agreed_master(self) -> tuple[str, int] | None:
        views = {s.master_address() for s in self.sentinels if s.running}
        views.discard(None)
        return views.pop() if len(views) == 1 else None

    def kill_master(self) -> RedisServer:
        """SIGKILL the current master (a crash: no clean shutdown); return it."""
        master = self.master()
        master.kill()
        return master

    def wait_failover(self, old: RedisServer, timeout: float = SETTLE) -> RedisServer:
        """Block until every sentinel names a former replica master and it acts as one."""

        def promoted() -> RedisServer | None:
            addr = self._agreed_master()
            if addr is None or addr[1] == old.port:
                return None
            node = next(n for n in self.nodes if n.port == addr[1])
            return node if _role(node.port) == "master" else None

        return wait_for(promoted, timeout, f"a replica promoted after master {old.port} died")

    def stop(self) -> None:
        for server in [*self.sentinels, *self.nodes]:
            server.cleanup()


class ClusterDeployment:
    """``masters`` masters with ``replicas_each`` replicas each, slots spread evenly."""

    def __init__(
        self, tmpdir: str | os.PathLike[str], *, masters: int = 3, replicas_each: int = 1
    ) -> None:
        self.tmpdir = Path(tmpdir)
        self.replicas_each = replicas_each
        self.nodes: list[RedisServer] = []
        for _ in range(masters * (1 + replicas_each)):
            node = RedisServer(tmpdir, appendonly=False)
            node.extra_args = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node.data_dir / "nodes.conf"),
                "--cluster-node-timeout", "1000",
                *NO_DELAY,
                # a cluster holds database 0 only
                "--databases", "1",
            ]  # fmt: skip
            self.nodes.append(node)

    def start(self) -> ClusterDeployment:
        for node in self.nodes:
            node.start()
        cli = self.nodes[0].binary.replace("redis-server", "redis-cli")
        subprocess.run(
            [
                cli, "--cluster", "create",
                *(f"{LOOPBACK}:{n.port}" for n in self.nodes),
                "--cluster-replicas", str(self.replicas_each),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )  # fmt: skip
        wait_for(self._settled, SETTLE, "every cluster node reporting a served, replicated cluster")
        return self

    def _settled(self) -> bool:
        for node in self.nodes:
            try:
                with _client(node.port) as c:
                    info = c.execute_command("CLUSTER", "INFO")
            except redis.RedisError:
                return False
            if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
                return False
        masters = self.masters()
        replicated = {m for m in masters if self._replicas_of(m)}
        return len(masters) * (1 + self.replicas_each) == len(self.nodes) and replicated == set(
            masters
        )

    def _nodes_table(self) -> list[list[str]]:
        """CLUSTER NODES as seen from a live node: one row per node."""
        for node in self.nodes:
            if not node.running:
                continue
            try:
                with _client(node.port) as c:
                    text = c.execute_command("CLUSTER", "NODES")
            except redis.RedisError:
                continue
            return [line.split() for line in str(text).splitlines() if line.strip()]
        return []

    def masters(self) -> list[int]:
        """Ports of the nodes the cluster holds as live masters."""
        return [
            int(row[1].split("@")[0].rsplit(":", 1)[1])
            for row in self._nodes_table()
            if "master" in row[2] and "fail" not in row[2]
        ]

    def _replicas_of(self, port: int) -> list[int]:
        table = self._nodes_table()
        ids = {int(r[1].split("@")[0].rsplit(":", 1)[1]): r[0] for r in table}
        return [
            int(r[1].split("@")[0].rsplit(":", 1)[1])
            for r in table
            if r[3] == ids.get(port) and "fail" not in r[2]
        ]

    # -- what a client is given ---------------------------------------------------

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(LOOPBACK, n.port) for n in self.nodes]

    def url(self) -> str:
        """The store's form: ``redis+cluster://h:p,h:p,...`` (every node a startup node)."""
        return "redis+cluster://" + ",".join(f"{h}:{p}" for h, p in self.startup_nodes)

    def flush(self) -> None:
        """Empty every master (database 0, the only one)."""
        for port in self.masters():
            with _client(port) as c:
                c.flushdb()

    def client(self, **kwargs: Any) -> RedisCluster:
        return RedisCluster(host=LOOPBACK, port=self.nodes[0].port, **kwargs)

    def master_of(self, key: str) -> RedisServer:
        with self.client() as c:
            node = c.get_node_from_key(key)
        return next(n for n in self.nodes if n.port == node.port)

    # -- faults ---------------------------------------------------------------------

    def kill_master(self, key: str) -> tuple[RedisServer, list[int]]:
        """SIGKILL the master serving ``key``'s slot; return it and its replicas' ports."""
        master = self.master_of(key)
        replicas = self._replicas_of(master.port)
        master.kill()
        return master, replicas

    def wait_failover(
        self, old: RedisServer, replicas: Sequence[int], timeout: float = SETTLE
    ) -> RedisServer:
        """Block until one of ``replicas`` is a master and the cluster serves every slot."""

        def promoted() -> RedisServer | None:
            live = [n for n in self.nodes if n.running]
            for node in live:
                try:
                    with _client(node.port) as c:
                        if "cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                            return None
                except redis.RedisError:
                    return None
            masters = set(self.masters())
            new = [p for p in replicas if p in masters and _role(p) == "master"]
            return next((n for n in self.nodes if new and n.port == new[0]), None)

        return wait_for(promoted, timeout, f"a replica of {old.port} promoted, every slot served")

    def stop(self) -> None:
        for node in self.nodes:
            node.cleanup()
