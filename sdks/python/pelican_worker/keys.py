"""Pelican's Redis key names, as the worker contract lists them.

Every key lives in the stream's hash slot: ``{T}:pelican:...`` with ``T`` the stream's hash tag.
"""

from __future__ import annotations

__all__ = [
    "DELIVERIES_FIELD",
    "ERROR_TEXT_MAX",
    "KEY_FIELD",
    "ORIGIN_ID_FIELD",
    "bounds_key",
    "consumers_key",
    "epochs_key",
    "errors_key",
    "hash_tag",
    "members_key",
    "owners_key",
    "partition_stream",
    "rejected_key",
    "settings_key",
    "terminal_key",
    "topic_key",
]

#: The field a requeued copy carries with the message's deliveries before it.
DELIVERIES_FIELD = "pelican-deliveries"
#: The field a requeued copy carries with the id the message was first published under.
ORIGIN_ID_FIELD = "pelican-origin-id"
#: The field a topic's keyed message carries its key in, first.
KEY_FIELD = "pelican-key"
#: The most bytes of a message's last error a worker writes.
ERROR_TEXT_MAX = 1024


def hash_tag(stream: str) -> str:
    """The content of the first ``{...}`` of ``stream`` when it is not empty, else the whole name.

    This is Redis Cluster's rule: the first ``{`` and the first ``}`` after it.
    """
    open_ = stream.find("{")
    if open_ >= 0:
        close = stream.find("}", open_ + 1)
        if close > open_ + 1:
            return stream[open_ + 1 : close]
    return stream


def settings_key(stream: str, group: str) -> str:
    """``{T}:pelican:<stream>:<group>:settings``: the group's settings, written by the operator."""
    return f"{{{hash_tag(stream)}}}:pelican:{stream}:{group}:settings"


def terminal_key(stream: str, group: str) -> str:
    """``{T}:pelican:<stream>:<group>:terminal``: reason -> messages ended as terminal."""
    return f"{{{hash_tag(stream)}}}:pelican:{stream}:{group}:terminal"


def errors_key(stream: str, group: str) -> str:
    """``{T}:pelican:<stream>:<group>:errors``: pending entry id -> the text of its last failure."""
    return f"{{{hash_tag(stream)}}}:pelican:{stream}:{group}:errors"


def consumers_key(stream: str, group: str) -> str:
    """``{T}:pelican:<stream>:<group>:consumers``: consumer -> its last lease tick (the server's time, ms), written by
    ``lease.lua``: the heartbeat that tells the operator's ``strategy: Reassign`` the consumer is alive."""
    return f"{{{hash_tag(stream)}}}:pelican:{stream}:{group}:consumers"


def bounds_key(stream: str) -> str:
    """``{T}:pelican:<stream>:bounds``: group -> ``backlog.maxLength``, read by the bounded publish scripts."""
    return f"{{{hash_tag(stream)}}}:pelican:{stream}:bounds"


def rejected_key(stream: str) -> str:
    """``{T}:pelican:<stream>:rejected``: group -> publishes refused for it."""
    return f"{{{hash_tag(stream)}}}:pelican:{stream}:rejected"


def partition_stream(topic: str, partition: int) -> str:
    """``{T:i}``: partition ``i`` of topic ``T``, the whole name its hash tag (a slot of its own)."""
    return f"{{{topic}:{partition}}}"


def topic_key(topic: str) -> str:
    """``{T}:pelican:T:topic``: the topic's ``partitions`` and ``contractVersion``, whatever the group."""
    return f"{{{topic}}}:pelican:{topic}:topic"


def members_key(topic: str, group: str) -> str:
    """``{T}:pelican:T:<group>:members``: member -> its lease deadline (the server's time, ms)."""
    return f"{{{topic}}}:pelican:{topic}:{group}:members"


def owners_key(topic: str, group: str) -> str:
    """``{T}:pelican:T:<group>:owners``: partition index -> the member that owns it."""
    return f"{{{topic}}}:pelican:{topic}:{group}:owners"


def epochs_key(topic: str, group: str) -> str:
    """``{T}:pelican:T:<group>:epochs``: partition index -> its epoch, incremented at every hand-over."""
    return f"{{{topic}}}:pelican:{topic}:{group}:epochs"
