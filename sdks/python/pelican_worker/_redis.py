"""Clients and replies: the library parses the few replies it reads itself, the same on RESP2 and RESP3, whether or
not the client decodes responses."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.client import NEVER_DECODE

__all__ = [
    "RAW",
    "Client",
    "ClientFactory",
    "Entry",
    "RedisSource",
    "command_docs",
    "make_client",
    "queue_raw",
    "range_entries",
    "raw_command",
    "read_entries",
    "socket_timeout_of",
    "text",
]

#: A client of one server, or of a Redis Cluster (a topic's partitions are spread over its shards).
Client = Redis | RedisCluster
#: Builds a new client each call; the library owns and closes what it returns.
ClientFactory = Callable[[], Client]
#: A ``redis://`` URL, or a factory of clients.
RedisSource = str | ClientFactory

#: Command option: read the reply without decoding it (redis-py's own flag).
RAW: dict[str, Any] = {NEVER_DECODE: True}

# Replies the library parses itself: redis-py's own parsers turn entries into dicts, which loses field order and
# repeated names.
_RAW_REPLIES = ("XREADGROUP", "XRANGE", "XPENDING", "XAUTOCLAIM", "XCLAIM", "HGETALL", "COMMAND")


def _unparsed(response: Any, **_options: Any) -> Any:
    return response


def make_client(source: RedisSource, *, socket_timeout: float, resend: bool) -> Client:
    """A client of the library's own. ``resend=False``: a command is sent once, never again after a lost reply."""
    client: Client
    if isinstance(source, str):
        if resend:
            client = Redis.from_url(source, socket_timeout=socket_timeout, socket_connect_timeout=5.0)
        else:
            # retry_on_timeout is False by default (and deprecated since redis-py 6), so it is not passed.
            client = Redis.from_url(
                source,
                socket_timeout=socket_timeout,
                socket_connect_timeout=5.0,
                retry=Retry(NoBackoff(), 0),
                retry_on_error=[],
            )
    else:
        client = source()
        if not resend:
            # Whatever the factory configured: no retries on this client's connections, present and future.
            client.set_retry(Retry(NoBackoff(), 0))
    for command in _RAW_REPLIES:
        # A Cluster client parses COMMAND itself whenever it learns the topology (command_docs below).
        if command != "COMMAND" or isinstance(client, Redis):
            client.set_response_callback(command, _unparsed)
    return client


async def command_docs(conn: Client, command: str) -> Any:
    """``COMMAND DOCS <command>``, unparsed."""
    if isinstance(conn, Redis):
        return await raw_command(conn, "COMMAND", "DOCS", command)
    # The Cluster client's own COMMAND parser is set aside for this call alone, once it has learnt the topology.
    await conn.initialize()
    parse = conn.response_callbacks.pop("COMMAND", None)
    try:
        return await raw_command(conn, "COMMAND", "DOCS", command)
    finally:
        if parse is not None:
            conn.response_callbacks["COMMAND"] = parse


async def raw_command(conn: Client, *args: Any) -> Any:
    """Sends a command and answers its reply undecoded and unparsed (redis-py leaves ``execute_command`` untyped)."""
    return await conn.execute_command(*args, **RAW)


def socket_timeout_of(client: Client) -> float | None:
    """The socket timeout the client's connections have (``None``: none)."""
    pool = client.connection_pool if isinstance(client, Redis) else None
    kwargs = pool.connection_kwargs if pool is not None else client.get_connection_kwargs()
    timeout: float | None = kwargs.get("socket_timeout")
    return timeout


def queue_raw(pipe: Pipeline | ClusterPipeline, *args: Any) -> None:
    """Queues a command whose reply comes back undecoded and unparsed."""
    pipe.execute_command(*args, **RAW)


def text(value: Any) -> str:
    """A reply element as text, whether the client decodes responses or not."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _raw(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _pairs(flat: Any) -> list[tuple[bytes, bytes]] | None:
    if flat is None:
        return None
    if isinstance(flat, Mapping):
        return [(_raw(k), _raw(v)) for k, v in flat.items()]
    return [(_raw(flat[i]), _raw(flat[i + 1])) for i in range(0, len(flat), 2)]


Entry = tuple[str, list[tuple[bytes, bytes]] | None]


def read_entries(reply: Any) -> list[Entry]:
    """The entries of an ``XREADGROUP`` reply (RESP2 ``[[stream, entries]]`` or RESP3 ``{stream: entries}``).

    Fields are ``None`` for an entry whose payload was deleted while it was pending.
    """
    if not reply:
        return []
    ranges = reply.values() if isinstance(reply, Mapping) else (r[1] for r in reply)
    return [entry for found in ranges for entry in range_entries(found)]


def range_entries(reply: Any) -> list[Entry]:
    """The entries of an ``XRANGE`` reply, in order."""
    return [(text(entry[0]), _pairs(entry[1])) for entry in reply or []]
