"""The key directory's claim (found false in review, 2026-12-07): "Health checks PING the subscription, so
a silent dead peer is noticed too."

A subscription whose peer stops answering without closing (a partition, a dropped conntrack entry, a
frozen proxy) must unsync the directory within a few health-check intervals: meanwhile other replicas'
announcements are lost, and a synced directory answers "absent" for every key they write, without asking
Redis. redis-py's health check only sends the PING; nothing waits for its PONG, so the directory stays
synced, answering "absent" for a key Redis holds, until TCP gives up (~15 minutes) or the 10-minute rescan."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import redis

from cache.key_directory import KeyDirectory, announce_channel
from tests.conftest import wait_for


class FreezableProxy:
    """A TCP proxy to Redis that can stop forwarding (both ways) while keeping every socket open: a peer
    that went silent without a FIN or RST."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.frozen = threading.Event()
        self.closed = threading.Event()
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except (socket.timeout, OSError):
                continue
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.1)
        while not self.closed.is_set():
            if self.frozen.is_set():
                time.sleep(0.05)  # neither read nor forward: the bytes wait in kernel buffers
                continue
            try:
                data = src.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            if not data:
                return
            try:
                dst.sendall(data)
            except OSError:
                return

    def freeze(self) -> None:
        """Stop forwarding; returns once no pump is inside a recv that could still forward what it reads."""
        self.frozen.set()
        time.sleep(0.5)  # a pump's recv times out after 0.1 s, then it parks

    def close(self) -> None:
        self.closed.set()
        for s in self.sockets:
            try:
                s.close()
            except OSError:
                pass


def test_a_subscription_whose_peer_went_silent_unsyncs_the_directory(redis_server):
    port = int(redis_server.rsplit(":", 1)[1].split("/")[0])
    proxy = FreezableProxy(port)
    namespace = f"test:kdsilent:{uuid.uuid4().hex[:8]}"
    raw = redis.Redis.from_url(redis_server)
    directory = KeyDirectory(f"redis://127.0.0.1:{proxy.port}/0", namespace).start()
    try:
        assert wait_for(lambda: directory.synced, 10)
        proxy.freeze()  # the directory's peer goes silent; Redis itself is fine for everyone else
        name = f"{namespace}:written-meanwhile"
        raw.set(name, b"v", ex=600)
        raw.publish(announce_channel(namespace), name)  # the announcement never reaches the directory
        # health checks every 5 s, socket timeout 2 s: a few intervals are plenty to notice
        wait_for(lambda: not directory.synced, 20)
        assert raw.exists(name) == 1
        assert directory.contains(name) is not False, (
            "a directory whose subscription went silent stays synced and answers 'absent' for a key "
            "Redis holds"
        )
    finally:
        proxy.frozen.clear()
        directory.close()
        proxy.close()
        raw.close()


def test_a_subscription_redis_py_renewed_by_itself_is_followed_by_a_rescan(redis_server):
    """redis-py reconnects and resubscribes a pub/sub connection by itself when its URL asks for retries
    (`?retry_on_timeout=true`: querystring options win over the client's arguments, and README shows URL
    options). Announcements published while it was disconnected are lost; the directory, seeing no error,
    stays synced without the rescan every reconnect must bring, and answers "absent" for those keys."""
    namespace = f"test:kdresub:{uuid.uuid4().hex[:8]}"
    raw = redis.Redis.from_url(redis_server)
    directory = KeyDirectory(f"{redis_server}?retry_on_timeout=true", namespace).start()
    try:
        assert wait_for(lambda: directory.synced, 10)
        assert wait_for(lambda: raw.pubsub_numsub(announce_channel(namespace))[0][1] == 1, 5)
        raw.client_kill_filter(_type="pubsub")  # the directory's subscription drops
        name = f"{namespace}:written-while-disconnected"
        raw.set(name, b"v", ex=600)
        assert raw.publish(announce_channel(namespace), name) == 0, "nobody heard the announcement"
        assert wait_for(lambda: raw.pubsub_numsub(announce_channel(namespace))[0][1] == 1, 10), "resubscribed"
        wait_for(lambda: directory.contains(name) is not False, 5)
        assert raw.exists(name) == 1
        assert directory.contains(name) is not False, (
            "resubscribed without a rescan: the directory answers 'absent' for a key Redis holds"
        )
    finally:
        directory.close()
        raw.close()
