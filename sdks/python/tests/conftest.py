"""A real redis-server on a free loopback port for the whole session (``REDIS_SERVER`` names the binary; by default
the one on PATH), emptied before each test.

Tests are plain functions that call ``asyncio.run``: each gets a fresh event loop with nothing shared between tests,
and the suite needs no plugin.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _serve(binary: str) -> Iterator[int]:
    """Starts ``binary`` on a free loopback port until the generator is closed."""
    port = _free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
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


@pytest.fixture(scope="session")
def redis_port() -> Iterator[int]:
    binary = os.environ.get("REDIS_SERVER") or shutil.which("redis-server")
    if binary is None:
        pytest.fail("no redis-server: put one on PATH or name it in REDIS_SERVER")
    yield from _serve(binary)


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
