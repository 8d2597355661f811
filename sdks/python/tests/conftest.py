"""A real redis-server on a free loopback port for the whole session (``REDIS_SERVER`` names the binary; by default
the one on PATH), emptied before each test.

Tests are plain functions that call ``asyncio.run``: each gets a fresh event loop with nothing shared between tests,
and the suite needs no plugin.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _free_cluster_port() -> int:
    """A free port whose Cluster bus port (the port + 10000) is a port too, and free."""
    for _ in range(100):
        port = _free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Cluster node in 100 tries")


def _serve(binary: str, *options: str, port: int | None = None) -> Iterator[int]:
    """Starts ``binary`` on ``port`` (default: a free loopback port) until the generator is closed."""
    port = port if port is not None else _free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *options],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.05)
        client.close()
        yield port
    finally:
        server.terminate()
        server.wait(10)


def _redis_server() -> str:
    binary = os.environ.get("REDIS_SERVER") or shutil.which("redis-server")
    if binary is None:
        pytest.fail("no redis-server: put one on PATH or name it in REDIS_SERVER")
    return binary


@pytest.fixture(scope="session")
def redis_port() -> Iterator[int]:
    yield from _serve(_redis_server())


@pytest.fixture(scope="session")
def cluster_ports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    """A Redis Cluster of 3 primaries on loopback ports (``redis-cli --cluster create``, the redis-cli next to the
    server or on PATH), for the whole session."""
    binary = _redis_server()
    beside = Path(binary).with_name("redis-cli")
    cli = str(beside) if beside.is_file() else shutil.which("redis-cli")
    if cli is None:
        pytest.fail("no redis-cli beside the redis-server nor on PATH: the Cluster tests need it")
    folder = tmp_path_factory.mktemp("cluster")
    with contextlib.ExitStack() as nodes:
        ports = []
        for i in range(3):
            options = ("--cluster-enabled", "yes", "--cluster-config-file", str(folder / f"nodes-{i}.conf"))
            server = contextlib.contextmanager(_serve)(
                binary, *options, "--dir", str(folder), port=_free_cluster_port()
            )
            ports.append(nodes.enter_context(server))
        addresses = [f"127.0.0.1:{port}" for port in ports]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-yes"], check=True, capture_output=True, timeout=60
        )
        for port in ports:
            node = redis.Redis(port=port)
            deadline = time.monotonic() + 10
            while b"cluster_state:ok" not in node.execute_command("CLUSTER", "INFO"):  # type: ignore[no-untyped-call]
                if time.monotonic() > deadline:
                    pytest.fail(f"the Cluster node on {port} is not ok after 10 s")
                time.sleep(0.05)
            node.close()
        yield ports


@pytest.fixture
def cluster_url(cluster_ports: list[int]) -> str:
    """One primary of the Cluster, every primary emptied."""
    for port in cluster_ports:
        node = redis.Redis(port=port)
        node.flushall()
        node.close()
    return f"redis://127.0.0.1:{cluster_ports[0]}"


@pytest.fixture(scope="session")
def idmp_port() -> Iterator[int]:
    """A server with ``XADD ... IDMP`` (Redis 8.6+), named by ``IDMP_REDIS_SERVER``. Without one the tests that need
    it are skipped, saying so, unless ``IDMP_REQUIRED=1`` (the repository's scripts/test sets both): then they fail."""
    binary = os.environ.get("IDMP_REDIS_SERVER")
    if not binary:
        if os.environ.get("IDMP_REQUIRED") == "1":
            pytest.fail("IDMP_REQUIRED=1 but no IDMP_REDIS_SERVER (a Redis 8.6+ redis-server) is named")
        pytest.skip("no IDMP_REDIS_SERVER (a Redis 8.6+ redis-server): idempotent publishes are not tested")
    yield from _serve(binary)


@pytest.fixture
def idmp_redis_url(idmp_port: int) -> str:
    client = redis.Redis(port=idmp_port)
    client.flushall()
    client.close()
    return f"redis://127.0.0.1:{idmp_port}"


@pytest.fixture
def redis_url(redis_port: int) -> str:
    client = redis.Redis(port=redis_port)
    client.flushall()
    client.close()
    return f"redis://127.0.0.1:{redis_port}"
