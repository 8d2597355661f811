"""What a handler receives and what it answers."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pelican_worker.keys import ERROR_TEXT_MAX, KEY_FIELD

__all__ = ["InvalidReason", "Message", "Outcome", "error_text"]

_REASON = re.compile(r"[A-Z][A-Za-z0-9]{0,62}")


@dataclass(frozen=True, slots=True)
class Message:
    """One stream entry. Fields are raw bytes, in the order they were added (names may repeat).

    ``partition`` is the topic's partition the entry was read from (``None`` on a plain stream).
    """

    id: str
    fields: list[tuple[bytes, bytes]]
    partition: int | None = None

    @property
    def key(self) -> bytes | None:
        """A topic message's key (its ``pelican-key`` field, the first), or ``None`` for a message without one."""
        return self.field(KEY_FIELD)

    def field(self, name: str | bytes) -> bytes | None:
        """The value of a field (the first one when the name repeats), or ``None``."""
        key = name.encode() if isinstance(name, str) else name
        return next((v for k, v in self.fields if k == key), None)

    def text(self, name: str | bytes) -> str | None:
        """The value of a field as UTF-8 text; ``None`` when it is missing or not UTF-8."""
        value = self.field(name)
        if value is None:
            return None
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return None


class InvalidReason(ValueError):
    """A terminal reason that is not CamelCase; raised before anything is written."""

    def __init__(self, code: str) -> None:
        self.code = code
        super().__init__(
            f"invalid terminal reason code {code!r}: it must be CamelCase, match ^[A-Z][A-Za-z0-9]{{0,62}}$ "
            "(e.g. RecordNotFound)"
        )


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a handler ended a message. An exception is a failure, not an outcome."""

    kind: Literal["done", "retry", "terminal"]
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "terminal":
            if self.reason is None or _REASON.fullmatch(self.reason) is None:
                raise InvalidReason(str(self.reason))
        elif self.reason is not None:
            raise ValueError(f"a {self.kind} outcome has no reason")

    @classmethod
    def done(cls) -> Outcome:
        """Processed: acknowledge."""
        return cls("done")

    @classmethod
    def retry(cls) -> Outcome:
        """Failed, retry it under the policy's backoff without waiting ``minIdle`` (the delivery counts)."""
        return cls("retry")

    @classmethod
    def terminal(cls, reason: str) -> Outcome:
        """Will never succeed: acknowledge and count under ``reason`` (raises :class:`InvalidReason`)."""
        return cls("terminal", reason)


def error_text(error: BaseException) -> str:
    """The text recorded as a message's last error: the exception's type and message, cut to 1,024 bytes of UTF-8
    at a character boundary."""
    message = str(error)
    full = f"{type(error).__name__}: {message}" if message else type(error).__name__
    return full.encode("utf-8", "replace")[:ERROR_TEXT_MAX].decode("utf-8", "ignore")
