"""The contract's scripts, read from this package's own ``scripts/`` folder (copies of ``contract/scripts``)."""

from __future__ import annotations

from importlib.resources import files

__all__ = ["script_source"]


def script_source(name: str) -> str:
    """The source of ``scripts/<name>.lua``, byte for byte as shipped."""
    return (files("pelican_worker") / "scripts" / f"{name}.lua").read_bytes().decode("utf-8")
