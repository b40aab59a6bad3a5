"""A private RabbitMQ node, with its own epmd."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import uuid
from collections.abc import Mapping

from tests.servers.basics import (
    LOOPBACK,
    ServerStartError,
    find_binary,
    free_port,
    log_tail,
    wait_for,
)
from tests.servers.managed import ManagedServer
from tests.servers.process import signal_group, spawn


def _amqp_handshake_ok(port: int, timeout: float = 1.0) -> bool:
    """True if an AMQP 0-9-1 server on ``port`` answers with Connection.Start."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout) as s:
            s.sendall(b"AMQP\x00\x00\x09\x01")
            data = b""
            while len(data) < 11:
                chunk = s.recv(4096)
                if not chunk:
                    return False
                data += chunk
    except OSError:
        return False
    # method frame (type 1) on channel 0, class 10 (connection) method 10 (start)
    return data[0] == 1 and data[1:3] == b"\x00\x00" and data[7:11] == b"\x00\x0a\x00\x0a"


class RabbitMQServer(ManagedServer):
    """A private RabbitMQ node with its own epmd, ports and directories.

    Node name ``rabbit-<unique>@localhost``; AMQP on ``127.0.0.1:<port>``;
    Erlang distribution, its epmd and the CLI tools' distribution ports are
    private too; no plugins (no management UI).  Runs as the current user
    (root works) by bypassing Debian's ``su rabbitmq`` wrapper script.
    """

    name = "rabbitmq"
    start_timeout = 90.0
    stop_timeout = 60.0

    def __init__(
        self,
        tmpdir: str | os.PathLike[str],
        port: int | None = None,
        *,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(tmpdir, port, env)
        self.server_bin = find_binary("rabbitmq-server", ["/usr/lib/rabbitmq/bin/rabbitmq-server"])
        self.ctl_bin = find_binary("rabbitmqctl", ["/usr/lib/rabbitmq/bin/rabbitmqctl"])
        self.epmd_bin = find_binary(
            "epmd", ["/usr/lib/erlang/bin/epmd", "/usr/lib/erlang/erts-*/bin/epmd"]
        )
        self.nodename = f"rabbit-{os.getpid()}-{uuid.uuid4().hex[:8]}@localhost"
        self.dist_port = free_port()
        self.epmd_port = free_port()
        self.ctl_dist_port = free_port()
        self.home = self.base / "home"
        self.mnesia_base = self.base / "mnesia"
        self.log_base = self.base / "log"
        for d in (self.home, self.mnesia_base, self.log_base):
            d.mkdir()
        self.config_file = self.base / "rabbitmq.conf"
        self.env_file = self.base / "rabbitmq-env.conf"
        self.plugins_file = self.base / "enabled_plugins"
        self._epmd: subprocess.Popen[bytes] | None = None
        self.epmd_log = self.base / "epmd.log"

    def url(self, vhost: str = "/") -> str:
        path = "/" if vhost == "/" else vhost
        return f"amqp://guest:guest@{LOOPBACK}:{self.port}/{path}"

    def _env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RABBITMQ_", "ERL_")) and k not in ("NOTIFY_SOCKET",)
        }
        erl_args = "-kernel inet_dist_use_interface {127,0,0,1}"
        env.update(
            HOME=str(self.home),
            LC_ALL="C.UTF-8",
            LANG="C.UTF-8",
            ERL_EPMD_PORT=str(self.epmd_port),
            ERL_EPMD_ADDRESS=LOOPBACK,
            RABBITMQ_CONF_ENV_FILE=str(self.env_file),
            RABBITMQ_NODENAME=self.nodename,
            RABBITMQ_NODE_IP_ADDRESS=LOOPBACK,
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_CTL_DIST_PORT_MIN=str(self.ctl_dist_port),
            RABBITMQ_CTL_DIST_PORT_MAX=str(self.ctl_dist_port),
            RABBITMQ_CONFIG_FILE=str(self.config_file),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(self.base / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.plugins_file),
            RABBITMQ_MNESIA_BASE=str(self.mnesia_base),
            RABBITMQ_LOG_BASE=str(self.log_base),
            RABBITMQ_PID_FILE=str(self.base / "rabbitmq.pid"),
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=erl_args,
            RABBITMQ_CTL_ERL_ARGS=erl_args,
            # run the VM in place of the wrapper shell (no signal-forwarding
            # proxy), so our child *is* beam and the death signal reaches it
            RUNNING_UNDER_SYSTEMD="true",
        )
        env.update(self.extra_env)
        return env

    def _prepare(self) -> None:
        self.env_file.write_text("# private test node: no settings from /etc\n")
        self.plugins_file.write_text("[].\n")

    def _before_start(self) -> None:
        self.config_file.write_text(
            "\n".join(
                [
                    f"listeners.tcp.1 = {LOOPBACK}:{self.port}",
                    "loopback_users.guest = true",
                    "disk_free_limit.absolute = 1MB",
                    "log.file.level = info",
                    "log.console = false",
                    "",
                ]
            )
        )
        self._start_epmd()

    def _start_epmd(self) -> None:
        if self._epmd is not None and self._epmd.poll() is None:
            return
        with open(self.epmd_log, "ab") as log:
            self._epmd = spawn(
                [self.epmd_bin, "-port", str(self.epmd_port), "-address", LOOPBACK],
                log=log,
                env=self._env(),
                cwd=self.base,
            )
        epmd = self._epmd

        def up() -> bool:
            try:
                socket.create_connection((LOOPBACK, self.epmd_port), timeout=0.5).close()
            except OSError:
                return False
            return True

        def exited() -> str | None:
            code = epmd.poll()
            return None if code is None else f"epmd exited with {code}\n{log_tail(self.epmd_log)}"

        wait_for(up, 10.0, f"epmd on port {self.epmd_port}", abort=exited)

    def _stop_epmd(self) -> None:
        epmd = self._epmd
        if epmd is None:
            return
        signal_group(epmd.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            epmd.wait(10)
        self._epmd = None

    def _after_exit(self) -> None:
        self._stop_epmd()

    def _argv(self) -> list[str]:
        return [self.server_bin]

    def _is_ready(self) -> bool:
        return _amqp_handshake_ok(self.port)

    def _start_once(self, log_offset: int) -> None:
        # the broker's own log lives in log_base; append its tail on failure
        try:
            super()._start_once(log_offset)
        except ServerStartError as exc:
            own = self.log_base / f"{self.nodename}.log"
            raise ServerStartError(f"{exc}\n{log_tail(own)}") from None

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """Run ``rabbitmqctl -n NODE ARGS...`` and return its stdout."""
        result = subprocess.run(
            [self.ctl_bin, "-n", self.nodename, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=self._env(),
            cwd=self.base,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"rabbitmqctl {' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stdout}\n{result.stderr}"
            )
        return result.stdout

    def list_connections(self) -> list[str]:
        """Names ("ip:port -> ip:port") of the client connections."""
        out = self.ctl("list_connections", "name", "--quiet", "--no-table-headers")
        return [line.strip() for line in out.splitlines() if line.strip()]

    def list_vhosts(self) -> list[str]:
        out = self.ctl("list_vhosts", "name", "--quiet", "--no-table-headers")
        return [line.strip() for line in out.splitlines() if line.strip()]

    def close_all_connections(
        self, reason: str = "closed by test", *, hard: bool = False, timeout: float = 30.0
    ) -> None:
        """Close every client connection, vhost by vhost.

        RabbitMQ sends ``Connection.Close`` (CONNECTION_FORCED); a client
        that is reading sees it at once.  A client that is not reading keeps
        the connection half-open for up to 30 s while the broker waits for
        its ``Close-Ok``; with ``hard=True`` the close is repeated until no
        connection is listed any more, which resets those TCP connections
        (a second close of a closing connection terminates it).

        (``close_all_connections --global`` reported success without closing
        anything on RabbitMQ 3.10, hence the per-vhost loop.)
        """

        def close_all() -> None:
            for vhost in self.list_vhosts():
                self.ctl("close_all_connections", "--vhost", vhost, reason)

        close_all()
        if hard:

            def gone() -> bool:
                if not self.list_connections():
                    return True
                close_all()
                return False

            wait_for(gone, timeout, "client connections to close")
