"""The remote tier on a Redis/Valkey Cluster (`remote_cluster`): which node
answers which key, what a failing node costs, and what the daemon knows of
the cluster.

redis-py's RedisCluster owns discovery, the slot map and MOVED/ASK for the
commands it sends itself (writes, tails). The reads that carry the bytes
(pipelined GETs into buffers, the presence GETRANGEs) are grouped here by
the node owning each key's slot and sent on that node's own client: every
key of one value shares a slot (the hash tag of PROTOCOL.md section 13), so
one value is one node's answer, and a batch costs one pipeline per node.

Rules:
1. A node that fails (refused, reset, timeout, CLUSTERDOWN, LOADING), or
   answers MOVED/ASK (a slot on its way elsewhere), costs misses for ITS
   keys only, counted under its name (`node_errors`); the other nodes'
   groups are read as usual, and the tier is not degraded for it.
2. With `read_replicas`, a group whose primary failed is asked of that
   slot's replicas, on connections that sent READONLY. Values never change
   under one key and carry a MAC, so a replica that lags gives misses, never
   wrong bytes.
3. A node that refused or reset a connection is skipped (its keys are
   misses at once, or its replicas are asked) for `_DOWN_S`. A read that ran
   out of time is counted but skips nothing: on a loaded machine a slow
   read is not a dead node (a black-holed node costs each read its
   deadline until the cluster fails it over and the map moves its slots).
4. Any node failure or redirect marks the slot map stale; the writer thread
   refreshes it (`watch`, at most every `_REFRESH_S`), never a read. The
   watch also asks CLUSTER INFO (`cluster_state`); when no node answers it,
   the tier is degraded as a single server's would be (rule 1 of the
   package), and its probe is the next watch.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

_DOWN_S = 1.0  # a failed node's keys are misses at once for this long
_REFRESH_S = 0.5  # slot map refreshes at most this often
WATCH_S = 5.0  # CLUSTER INFO at least this often while the writer is idle


def cluster_client(url: str, timeout: float, tls: dict[str, Any], read_replicas: bool, retries: int) -> Any:
    """A RedisCluster for `url` (any node), bounded waits, `retries` quick
    retries for the redirects it follows itself (the reader's 0: a read on the
    loop thread waits one timeout at most, a redirect is a miss; the writer's
    a few). Raises what discovery raises when no node answers
    (RedisClusterException, redis.RedisError)."""
    from redis import cluster as redis_cluster
    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.retry import Retry

    def readonly(conn: Any) -> None:  # rule 2: a replica serves reads only on a READONLY connection
        conn.send_command("READONLY")
        conn.read_response()

    extra = {"redis_connect_func": readonly} if read_replicas else {}
    with _MAKING:
        # redis-py makes its NodesManager by this module-level name, and asks for
        # the slot map before the constructor returns: ours checks that map.
        made, redis_cluster.NodesManager = redis_cluster.NodesManager, _checked_nodes_manager()
        try:
            return RedisCluster.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), retries),
                health_check_interval=0, **tls, **extra,
            )
        finally:
            redis_cluster.NodesManager = made


SLOTS = 16384  # a cluster's hash slots
_MAKING = threading.Lock()
_CHECKED: Any = None


def checked_slots(reply: Any, **options: Any) -> Any:
    """A CLUSTER SLOTS reply, if it is one a cluster gives: sections of
    [first, last, node, ...] within the 16,384 slots, covering each at most
    once, each node [host, port, ...]. redis-py fills a dict entry per slot of
    each section before it looks further: a node answering [0, 2**40, ...]
    had it take memory until the daemon was killed. Else ResponseError: that
    node's discovery fails, as for a node not in cluster mode."""
    from redis.exceptions import ResponseError

    if not isinstance(reply, list) or len(reply) > SLOTS:
        raise ResponseError("CLUSTER SLOTS: not a list of slot ranges")
    covered = 0
    for section in reply:
        if not isinstance(section, list) or not 3 <= len(section) <= 3 + 64:
            raise ResponseError("CLUSTER SLOTS: a section is not [first, last, node, ...]")
        first, last = section[0], section[1]
        if type(first) is not int or type(last) is not int or not 0 <= first <= last < SLOTS:
            raise ResponseError(f"CLUSTER SLOTS: slots {first!r}..{last!r} are not within 0..{SLOTS - 1}")
        covered += last - first + 1
        if covered > SLOTS or any(not isinstance(n, list) or len(n) < 2 for n in section[2:]):
            raise ResponseError("CLUSTER SLOTS: slots covered twice, or a node that is not [host, port, ...]")
    return reply


def _checked_nodes_manager() -> Any:
    """redis-py's NodesManager, with every node client it makes checking
    CLUSTER SLOTS replies (`checked_slots`): at discovery and at each refresh."""
    global _CHECKED
    if _CHECKED is None:
        from redis.cluster import NodesManager

        class CheckedNodesManager(NodesManager):
            def create_redis_node(self, host, port, **kwargs):
                node = super().create_redis_node(host, port, **kwargs)
                node.set_response_callback("CLUSTER SLOTS", checked_slots)
                return node

        _CHECKED = CheckedNodesManager
    return _CHECKED


def redirected(exc_or_reason: Any) -> bool:
    """A reply that says the key's slot is (going) elsewhere: a miss and a stale slot map."""
    from redis.exceptions import AskError, ClusterDownError, TryAgainError

    if isinstance(exc_or_reason, (AskError, TryAgainError, ClusterDownError)):
        return True
    text = str(getattr(exc_or_reason, "reason", exc_or_reason))
    return text.startswith(("error reply: MOVED", "error reply: ASK", "error reply: TRYAGAIN", "error reply: CLUSTERDOWN"))


class Nodes:
    """What the daemon knows of the cluster behind one RedisCluster client
    (the reader's): per-node errors, nodes skipped, the state the last watch saw."""

    def __init__(self, client_factory: Callable[[], Any], read_replicas: bool):
        self._factory = client_factory
        self.read_replicas = read_replicas
        self._client: Any = None
        self._lock = threading.Lock()  # errors (STATS reads them on the serving thread: never held across I/O)
        self._making = threading.Lock()  # the client's discovery, which waits on nodes
        self.errors: dict[str, int] = {}
        self._down: dict[str, float] = {}
        self.stale = False
        self._refreshed = 0.0
        self.state = "unknown"  # cluster_state of the last CLUSTER INFO ("ok", "fail"), or why none answered

    @property
    def client(self) -> Any:
        """The RedisCluster, made on first use (discovery needs a node that answers)."""
        client = self._client
        if client is not None:
            return client
        with self._making:
            if self._client is None:
                self._client = self._factory()
            return self._client

    def groups(self, keys: Sequence[bytes]) -> tuple[list[tuple[list[Any], list[int]]], list[int]]:
        """The keys' positions grouped by the node owning their slot, each with
        the clients to try in order (primary, then its replicas under rule 2,
        less the nodes skipped under rule 3); and the positions no node can
        answer now (a slot not covered, or every candidate skipped)."""
        from redis.crc import key_slot

        slots = self.client.nodes_manager.slots_cache
        now = time.monotonic()
        by_node: dict[str, tuple[list[Any], list[int]]] = {}
        nobody: list[int] = []
        for i, key in enumerate(keys):
            owners = slots.get(key_slot(key)) or []
            owners = owners if self.read_replicas else owners[:1]
            live = [n for n in owners if self._down.get(n.name, 0.0) <= now]
            if not live:
                nobody.append(i)
                continue
            group = by_node.get(live[0].name)
            if group is None:
                group = by_node[live[0].name] = (live, [])
            group[1].append(i)
        return list(by_node.values()), nobody

    def redis(self, node: Any) -> Any:
        return self.client.get_redis_connection(node)

    def prefixes(self, keys: Sequence[bytes], nbytes: int, errors: tuple[type[BaseException], ...]) -> list[Any]:
        """The first `nbytes` of each key (GETRANGE), one pipeline per node
        owning their slots, read by the daemon's own bounded reader (get.py's
        `first`: a node answering more than it was asked is never read whole):
        per key its bytes, or a Refused (a reply longer than asked, an error
        reply about that key: WRONGTYPE); b"" for the keys of a node that
        failed or redirected (rules 1-3). Raises `errors` only from discovery."""
        from kvd.store.remote.get import Refused, get_many

        out: list[Any] = [b""] * len(keys)
        groups, _ = self.groups(keys)
        for candidates, idx in groups:
            for node in candidates:
                try:
                    found = get_many(self.redis(node), [keys[i] for i in idx], bytearray, first=nbytes)
                except errors as exc:  # (LOADING, MASTERDOWN, ...: get_many raises them, the node answers no key now)
                    self.failed(node, exc)
                    continue
                if any(isinstance(r, Refused) and redirected(r) for r in found):
                    self.failed(node, down=False)
                for i, r in zip(idx, found):
                    out[i] = b"" if r is None or (isinstance(r, Refused) and redirected(r)) else r
                break
        return out

    def get(self, keys: Sequence[bytes], alloc: Any, deadline: Any, errors: tuple[type[BaseException], ...],
            **kw: Any) -> list[Any]:
        """get_many of `keys` (kw: its sizes, groups, most), one pipeline per
        node owning their slots; None (a miss) for the keys of a node that
        failed or redirected (rules 1-3), and for those left when the
        deadline ran out. Raises only when the read was abandoned (the
        deadline's stop flag: not the node's fault)."""
        import redis

        from kvd.store.remote.get import Refused, get_many

        out: list[Any] = [None] * len(keys)
        groups, _ = self.groups(keys)
        for candidates, idx in groups:
            sub = {k: (v if k == "most" else [v[i] for i in idx]) for k, v in kw.items()}
            for node in candidates:
                if deadline.stop is not None and deadline.stop.is_set():
                    deadline.left()  # raises: abandoned by the loop thread
                if time.monotonic() >= deadline.at:
                    return out  # the read's time is up: the rest are misses, no node to blame
                try:
                    got = get_many(self.redis(node), [keys[i] for i in idx], alloc, deadline=deadline, **sub)
                except errors as exc:
                    if deadline.stop is not None and deadline.stop.is_set():
                        raise
                    self.failed(node, exc, down=not isinstance(exc, redis.TimeoutError))
                    continue
                if any(isinstance(r, Refused) and redirected(r) for r in got):
                    self.failed(node, down=False)
                for i, r in zip(idx, got):
                    out[i] = None if isinstance(r, Refused) and redirected(r) else r
                break
        return out

    def failed(self, node: Any, exc: BaseException | None = None, *, down: bool = True) -> None:
        """Rule 1 and 3: count it under the node's name, skip the node a while, refresh the map."""
        with self._lock:
            self.errors[node.name] = self.errors.get(node.name, 0) + 1
            if down:
                self._down[node.name] = time.monotonic() + _DOWN_S
            self.stale = True

    def failed_key(self, key: bytes) -> None:
        """A command redis-py routed itself (a tails hash) failed: count it under the key's primary."""
        from redis.crc import key_slot

        owners = self.client.nodes_manager.slots_cache.get(key_slot(key)) or []
        if owners:
            self.failed(owners[0], down=False)

    def watch(self) -> None:
        """Rule 4, on the writer thread: refresh a stale slot map, then ask one
        node after another for CLUSTER INFO until one answers. Raises the last
        error when none does."""
        client = self.client
        if self.stale and time.monotonic() - self._refreshed >= _REFRESH_S:
            self._refreshed = time.monotonic()
            self.stale = False
            client.nodes_manager.initialize()
        last: BaseException | None = None
        for node in client.get_nodes():
            try:
                info = self.redis(node).execute_command("CLUSTER INFO")
            except Exception as exc:  # noqa: BLE001 - a node down: ask the next one
                last = exc
                continue
            fields = {str(k): str(v).strip() for k, v in info.items()} if isinstance(info, dict) else {}
            self.state = fields.get("cluster_state", "unknown")
            if self.state != "ok" or fields.get("cluster_known_nodes") != str(len(client.get_nodes())):
                self.stale = True  # a failover under way, or nodes added: the map will change
            return
        self.state = "unreachable"
        raise last if last is not None else ConnectionError("no cluster node known")

    def run(self, stop: threading.Event, failed: Callable[[BaseException], None], ok: Callable[[], None]) -> None:
        """The watcher thread: `watch` every WATCH_S (every _REFRESH_S while the
        map is stale) until `stop`; `failed(exc)` when no node answers, `ok()` when one does."""
        while not stop.wait(_REFRESH_S if self.stale else WATCH_S):
            try:
                self.watch()
            except Exception as exc:  # noqa: BLE001 - RedisClusterException is not a RedisError
                failed(exc)
            else:
                ok()

    def stats(self) -> dict[str, Any]:
        client = self._client
        nodes = client.get_nodes() if client is not None else []
        with self._lock:
            errors = dict(self.errors)
        return {
            "cluster_state": self.state, "cluster_nodes": len(nodes),
            "cluster_primaries": sum(1 for n in nodes if n.server_type == "primary"),
            "node_errors": errors,
        }
