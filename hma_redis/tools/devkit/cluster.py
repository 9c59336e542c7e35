"""Real Redis Cluster and Redis Sentinel deployments on loopback ports, for the tests and the
benchmarks (no mocks).

* :class:`LocalCluster`: three ``redis-server --cluster-enabled yes`` masters (optionally each
  with replicas) joined with ``redis-cli --cluster create ... --cluster-yes``; ready once every
  node reports ``cluster_state:ok`` with all 16384 slots assigned. Its ports (and URL) are
  chosen when it is built, so a client can be pointed at it before it starts.
* :class:`LocalSentinel`: one master, one replica and one ``redis-server --sentinel`` with quorum
  1 and short ``down-after-milliseconds`` / ``failover-timeout``, so a failover takes seconds.

Every process is started from PATH on free loopback ports, persistence off, and stopped by its
pid. A missing binary raises ``RuntimeError`` (the tests' ``started_cluster`` and
``started_sentinel`` turn it into a test failure, never a skip).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from hma_redis.tools.devkit.local_redis import (
    LocalRedis,
    cluster_node_args,
    free_port,
    terminate,
)

INSTALL_HINT = "Debian: apt-get install -y redis-server redis-tools (redis-server, redis-cli)"
SERVICE_NAME = "hma-test"


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(
            f"{name} not found on PATH; a Cluster or Sentinel needs it ({INSTALL_HINT})"
        )
    return path


def _free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


def _grant(client: redis.Redis, username: str | None, password: str) -> None:
    """Give ``username`` (or ``default``) the password and every right, on one server."""
    client.acl_setuser(
        username or "default",
        enabled=True,
        passwords=[f"+{password}"],
        keys=["*"],
        channels=["*"],
        commands=["+@all"],
    )


def _wait(what: str, check: object, timeout_s: float, interval_s: float = 0.1) -> None:
    """Poll ``check()`` (redis errors count as "not yet") until true or raise after timeout."""
    assert callable(check)
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except redis.RedisError as exc:
            last = exc
        time.sleep(interval_s)
    raise RuntimeError(f"timed out after {timeout_s}s waiting for {what} (last error: {last!r})")


class LocalCluster:
    """A Redis Cluster of ``masters`` primaries, each with ``replicas`` replicas, on loopback
    ports chosen when it is built (:attr:`url` is known before :meth:`start`).

    With ``username`` and ``password``, every node gets that ACL user (all commands, all keys)
    and its ``default`` user is switched off once the cluster is formed, so a client must send
    those credentials to every node it talks to, including nodes it discovers.
    """

    def __init__(
        self,
        masters: int = 3,
        node_timeout_ms: int = 15000,
        username: str | None = None,
        password: str | None = None,
        replicas: int = 0,
    ) -> None:
        self.redis_cli = _binary("redis-cli")
        _binary("redis-server")
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.username = username
        self.password = password
        self.nodes: list[LocalRedis] = []
        # A client port and a cluster-bus port per node, in node order.
        self._planned = _free_ports(2 * masters * (1 + replicas))

    @property
    def ports(self) -> list[int]:
        """The nodes' client ports (masters first as created; roles change on failover)."""
        return self._planned[::2]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        auth = f"{self.username}:{self.password}@" if self.password else ""
        return f"redis+cluster://{auth}{hosts}/"

    def start(self) -> LocalCluster:
        try:
            for port, bus_port in zip(self._planned[::2], self._planned[1::2], strict=True):
                node = LocalRedis(
                    port=port, extra_args=cluster_node_args(bus_port, self.node_timeout_ms)
                )
                self.nodes.append(node)
                node.start()
            self._create()
        except BaseException:
            self.stop()
            raise
        return self

    def _create(self) -> None:
        if self.password:
            for client in self.clients(authenticated=False):
                with client:
                    _grant(client, self.username, self.password)
        auth = (
            ["--user", self.username or "default", "--pass", self.password] if self.password else []
        )
        args = [
            self.redis_cli, *auth, "--no-auth-warning", "--cluster", "create",
            *(f"127.0.0.1:{p}" for p in self.ports),
            "--cluster-replicas", str(self.replicas), "--cluster-yes",
        ]  # fmt: skip
        proc = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{proc.stdout}\n{proc.stderr}")
        self.wait_ok()
        if self.username not in (None, "default"):
            for client in self.clients():
                with client:
                    client.acl_setuser("default", enabled=False)

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Wait until every node reports ``cluster_state:ok`` with all slots assigned."""

        def ready() -> bool:
            for client in self.clients():
                with client:
                    info = client.cluster("info")
                    if info.get("cluster_state") != "ok":
                        return False
                    if int(info.get("cluster_slots_assigned", 0)) != 16384:
                        return False
                    if int(info.get("cluster_known_nodes", 0)) != len(self.ports):
                        return False
            return True

        _wait("cluster_state:ok on every node", ready, timeout_s=timeout_s)

    def clients(self, authenticated: bool = True) -> list[redis.Redis]:
        """One plain (non-cluster) client per running node, in port order."""
        return [self._client(n.port, 5, authenticated) for n in self.nodes if n.proc is not None]

    def _client(self, port: int, timeout_s: float, authenticated: bool = True) -> redis.Redis:
        """A plain client of the node on ``port`` (as the cluster's user unless not
        ``authenticated``)."""
        if not authenticated:
            return redis.Redis(port=port, socket_timeout=timeout_s, socket_connect_timeout=5)
        return redis.Redis(
            port=port,
            socket_timeout=timeout_s,
            socket_connect_timeout=5,
            username=self.username,
            password=self.password,
        )

    def slot_owners(self) -> dict[int, int]:
        """``{slot: port of the master serving it}`` as the first node sees it."""
        with self.clients()[0] as client:
            ranges = client.execute_command("CLUSTER", "SLOTS")
        return {
            slot: int(node[1])
            for start, end, node, *_ in ranges
            for slot in range(int(start), int(end) + 1)
        }

    def node_id(self, port: int) -> str:
        with redis.Redis(port=port, username=self.username, password=self.password) as client:
            return str(client.execute_command("CLUSTER", "MYID").decode())

    def move_slot(self, slot: int, to_port: int) -> None:
        """Reshard one slot (and its keys) to the node on ``to_port``, as an operator would."""
        self.begin_migration(slot, to_port)
        self.end_migration(slot, to_port)

    def begin_migration(self, slot: int, to_port: int) -> None:
        """Start resharding one slot to the node on ``to_port`` and move its keys there, but
        leave it MIGRATING / IMPORTING: its old owner answers ASK for keys it does not hold."""
        from_port = self.slot_owners()[slot]
        src = self._client(from_port, 10)
        dst = self._client(to_port, 10)
        with src, dst:
            src_id, dst_id = self.node_id(from_port), self.node_id(to_port)
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100000)
            if keys:
                auth = ["AUTH2", self.username or "default", self.password] if self.password else []
                src.execute_command(
                    "MIGRATE", "127.0.0.1", to_port, "", 0, 10000, *auth, "KEYS", *keys
                )

    def end_migration(self, slot: int, to_port: int) -> None:
        """Finish a :meth:`begin_migration`: every node assigns the slot to ``to_port``."""
        dst_id = self.node_id(to_port)
        for client in self.clients():
            with client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        _wait(f"slot {slot} to move", lambda: self.slot_owners()[slot] == to_port, timeout_s=30)

    def start_moving_slot(self, slot: int, to_port: int, keys: list[bytes]) -> None:
        """Begin resharding ``slot`` to the node on ``to_port`` and move only ``keys`` of it:
        the slot stays MIGRATING / IMPORTING (its other keys on the old node) until
        :meth:`settle_slot`, as while an operator's reshard is under way."""
        from_port = self.slot_owners()[slot]
        src = self._client(from_port, 10)
        dst = self._client(to_port, 10)
        with src, dst:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(from_port))
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(to_port))
            auth = ["AUTH2", self.username or "default", self.password] if self.password else []
            src.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 10000, *auth, "KEYS", *keys)

    def settle_slot(self, slot: int) -> None:
        """End a migration :meth:`start_moving_slot` began: the slot stays where it was."""
        for client in self.clients():
            with client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")

    def replica_of(self, master_port: int) -> int:
        """The port of a replica of the master on ``master_port``."""
        for client in self.clients():
            with client:
                info = client.info("replication")
                if info.get("role") == "slave" and int(info["master_port"]) == master_port:
                    return int(client.connection_pool.connection_kwargs["port"])
        raise RuntimeError(f"no replica of the master on port {master_port}")

    def failover(self, replica_port: int, timeout_s: float = 60.0) -> None:
        """``CLUSTER FAILOVER`` on the replica on ``replica_port`` (sent again if a try times
        out); returns once it is a master and every running node names it for its slots."""
        replica = self._client(replica_port, 5)
        with replica:
            _wait(
                "the replica's link to its master",
                lambda: replica.info("replication").get("master_link_status") == "up",
                timeout_s=timeout_s,
            )
            old = int(replica.info("replication")["master_port"])
            deadline = time.monotonic() + timeout_s
            while replica.info("replication").get("role") != "master":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the replica on port {replica_port} was not promoted")
                replica.execute_command("CLUSTER", "FAILOVER")
                with contextlib.suppress(RuntimeError):
                    _wait(
                        "the promotion",
                        lambda: replica.info("replication").get("role") == "master",
                        timeout_s=10,
                    )

        def agreed() -> bool:
            for client in self.clients():
                with client:
                    ranges = client.execute_command("CLUSTER", "SLOTS")
                    if any(int(node[1]) == old for _, _, node, *_ in ranges):
                        return False
            return True

        _wait("every node to name the new master", agreed, timeout_s=timeout_s)

    def flushall(self) -> None:
        for client in self.clients():
            with client:
                client.flushall()
                client.config_resetstat()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.nodes = []


class LocalSentinel:
    """One master, one replica and one sentinel (quorum 1) watching service ``SERVICE_NAME``.

    With ``username`` and ``password``, both data servers get that ACL user (all commands, all
    keys); their ``default`` user stays open for replication and the sentinel.
    """

    def __init__(
        self,
        service: str = SERVICE_NAME,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        self.server_binary = _binary("redis-server")
        self.service = service
        self.username = username
        self.password = password
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.servers: list[LocalRedis] = []
        self.sentinel_port = 0
        self.dir = tempfile.mkdtemp(prefix="hma-sentinel-test-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f"{self.username or ''}:{self.password}@" if self.password else ""
        return f"redis+sentinel://{auth}127.0.0.1:{self.sentinel_port}/{self.service}/0"

    def start(self) -> LocalSentinel:
        try:
            master = LocalRedis().start()
            self.servers.append(master)
            replica = LocalRedis(extra_args=["--replicaof", "127.0.0.1", str(master.port)])
            self.servers.append(replica)
            replica.start()
            with redis.Redis(port=replica.port, socket_timeout=5) as client:
                _wait(
                    "the replica's link to its master",
                    lambda: client.info("replication").get("master_link_status") == "up",
                    timeout_s=30,
                )
            if self.password:
                for server in self.servers:
                    with redis.Redis(port=server.port) as client:
                        _grant(client, self.username, self.password)
            self._start_sentinel(master.port)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_sentinel(self, master_port: int) -> None:
        self.sentinel_port = free_port()
        conf = Path(self.dir) / "sentinel.conf"
        name = self.service
        conf.write_text(
            f"port {self.sentinel_port}\n"
            "bind 127.0.0.1\n"
            "protected-mode no\n"
            f"dir {self.dir}\n"
            f"sentinel monitor {name} 127.0.0.1 {master_port} 1\n"
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}\n"
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {name} 1\n"
        )
        log = open(Path(self.dir) / "sentinel.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [self.server_binary, str(conf), "--sentinel"], stdout=log, stderr=subprocess.STDOUT
        )

        def knows_replica() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-sentinel exited at start-up:\n{self.log_tail()}")
            with self.sentinel_client() as client:
                replicas = client.sentinel_slaves(name)
                return any(
                    not r["is_sdown"] and r.get("master-link-status") == "ok" for r in replicas
                )

        _wait("the sentinel to discover the replica", knows_replica, timeout_s=30)

    def log_tail(self) -> str:
        path = Path(self.dir) / "sentinel.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def sentinel_client(self) -> redis.Redis:
        return redis.Redis(port=self.sentinel_port, socket_timeout=5, socket_connect_timeout=5)

    def master_port(self) -> int:
        """The master's port as the sentinel reports it."""
        with self.sentinel_client() as client:
            _, port = client.sentinel_get_master_addr_by_name(self.service)
        return int(port)

    def server(self, port: int) -> LocalRedis:
        return next(s for s in self.servers if s.port == port)

    def data_client(self, port: int, db: int = 0) -> redis.Redis:
        """A client on one data server (master or replica), as the tier user."""
        return redis.Redis(
            port=port, db=db, username=self.username, password=self.password, socket_timeout=5
        )

    def wait_replicated(self, timeout_s: float = 30.0) -> None:
        """Wait until the replica has everything the master has (same replication offset)."""
        master = self.master_port()
        replica = next(s.port for s in self.servers if s.port != master and s.proc is not None)

        def caught_up() -> bool:
            with self.data_client(master) as m, self.data_client(replica) as r:
                offset = int(m.info("replication")["master_repl_offset"])
                return int(r.info("replication").get("slave_repl_offset", -1)) >= offset

        _wait("the replica to catch up", caught_up, timeout_s=timeout_s)

    def failover(self, timeout_s: float = 30.0) -> int:
        """``SENTINEL FAILOVER``; return the new master's port once it accepts writes."""
        old = self.master_port()
        with self.sentinel_client() as client:
            client.execute_command("SENTINEL", "FAILOVER", self.service)
        return self.wait_for_new_master(old, timeout_s)

    def wait_for_new_master(self, old_port: int, timeout_s: float = 30.0) -> int:
        """Wait until the sentinel names a master other than ``old_port`` and it is a master."""

        def switched() -> bool:
            port = self.master_port()
            if port == old_port:
                return False
            with redis.Redis(port=port, socket_timeout=2) as client:
                return client.info("replication").get("role") == "master"

        _wait(f"a new master (old one on port {old_port})", switched, timeout_s=timeout_s)
        return self.master_port()

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)
        self.proc = None
        for server in self.servers:
            server.stop()
        self.servers = []
        shutil.rmtree(self.dir, ignore_errors=True)
