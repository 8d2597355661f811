"""The group's settings hash (``{T}:pelican:<stream>:<group>:settings``), as the operator publishes it.

redis-py answers ``HGETALL`` with bytes names unless the client decodes responses, so every name is decoded before
it is looked up: ``hash.get("minIdleMs")`` on a bytes-keyed dict finds nothing, and a default taken silently then
leases at the wrong pace.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KNOWN_CONTRACT_VERSIONS",
    "TOPIC_CONTRACT_VERSIONS",
    "UNPUBLISHED_IDLE_MS",
    "UNPUBLISHED_LEASE_INTERVAL",
    "ContractVersionError",
    "SettingsError",
    "WorkerSettings",
    "lease_interval",
    "parse_settings",
]

#: The worker contract versions this library implements.
KNOWN_CONTRACT_VERSIONS: frozenset[int] = frozenset({1})
#: The contract versions a topic's settings (and its partitions') may say.
TOPIC_CONTRACT_VERSIONS: frozenset[int] = frozenset({2})

#: The idle time given back entries get when no settings are published: Pelican's default ``minIdle``.
UNPUBLISHED_IDLE_MS = 300_000
#: How often leases are extended when no settings are published (seconds).
UNPUBLISHED_LEASE_INTERVAL = 1.0


class ContractVersionError(Exception):
    """The operator speaks a worker contract this library does not know: the worker refuses to start."""

    def __init__(self, operator_version: str, known_versions: frozenset[int] = KNOWN_CONTRACT_VERSIONS) -> None:
        self.operator_version = operator_version
        known = ", ".join(str(v) for v in sorted(known_versions))
        super().__init__(
            f"the operator speaks worker contract {operator_version}, this library knows {known}: "
            "upgrade the library (pip install --upgrade pelican-worker)"
        )


class SettingsError(Exception):
    """A settings field holds something that is no decimal integer."""


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """The fields a worker reads, in milliseconds where they are times."""

    min_idle_ms: int
    retry_after_ms: int
    max_deliveries: int | None
    contract_version: int


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _fields(raw: Any) -> dict[str, str]:
    """``HGETALL``'s reply as RESP2 (a flat list) or RESP3 (a map), bytes or text, with decoded names."""
    if isinstance(raw, Mapping):
        return {_text(k): _text(v) for k, v in raw.items()}
    flat = list(raw or [])
    return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


def _integer(fields: Mapping[str, str], name: str) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if not value.isascii() or not value.isdigit():
        raise SettingsError(f"settings field {name} is {value!r}, not a decimal integer")
    return int(value)


def parse_settings(raw: Any, known: frozenset[int] = KNOWN_CONTRACT_VERSIONS) -> WorkerSettings | None:
    """The settings in an ``HGETALL`` reply; ``None`` for an empty hash (no policy publishes any yet).

    Raises :class:`ContractVersionError` for a contract version not in ``known`` (a topic's partition knows only
    the topic's contract, 2; a stream only those of :data:`KNOWN_CONTRACT_VERSIONS`) (a hash without
    ``contractVersion`` was written before the contract had one: version 1), and :class:`SettingsError` when
    ``minIdleMs`` or ``retryAfterMs`` is missing or a field is no decimal integer.
    """
    fields = _fields(raw)
    if not fields:
        return None
    version_text = fields.get("contractVersion")
    if version_text is not None and (
        not version_text.isascii() or not version_text.isdigit() or int(version_text) not in known
    ):
        raise ContractVersionError(version_text, known)
    version = int(version_text) if version_text is not None else 1
    if version not in known:
        raise ContractVersionError("1 (no contractVersion)", known)
    min_idle = _integer(fields, "minIdleMs")
    retry_after = _integer(fields, "retryAfterMs")
    if min_idle is None or retry_after is None:
        missing = [n for n, v in (("minIdleMs", min_idle), ("retryAfterMs", retry_after)) if v is None]
        raise SettingsError(f"settings hash without {' and '.join(missing)} (fields: {sorted(fields)})")
    return WorkerSettings(
        min_idle_ms=min_idle,
        retry_after_ms=retry_after,
        max_deliveries=_integer(fields, "maxDeliveries"),
        contract_version=version,
    )


def lease_interval(settings: WorkerSettings | None) -> float:
    """Seconds between lease ticks: ``min(minIdleMs / 3, 10 s)``, never under 100 ms; 1 s without settings."""
    if settings is None:
        return UNPUBLISHED_LEASE_INTERVAL
    return min(max(settings.min_idle_ms / 3000, 0.1), 10.0)
