"""The contract's pieces without a server: key names, settings parsing, reasons, error texts, script copies."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import pytest

from pelican_worker import KNOWN_CONTRACT_VERSIONS, ContractVersionError, InvalidReason, Message, Outcome
from pelican_worker.keys import bounds_key, errors_key, hash_tag, rejected_key, settings_key, terminal_key
from pelican_worker.message import error_text
from pelican_worker.settings import SettingsError, WorkerSettings, lease_interval, parse_settings

#: The repository's contract folder, when the package is tested inside the Pelican repository.
CONTRACT = Path(__file__).resolve().parents[3] / "contract"
SCRIPTS = [
    "bounded_publish.lua",
    "bounded_publish_batch.lua",
    "give_back.lua",
    "lease.lua",
    "membership.lua",
    "terminal_ack.lua",
]


def _packaged(name: str) -> bytes:
    return files("pelican_worker").joinpath(name).read_bytes()


def _in_the_repository() -> None:
    if not (CONTRACT / "VERSION").is_file():
        pytest.skip(f"not inside the Pelican repository (no {CONTRACT}): the packaged copies are checked alone")


def test_the_package_ships_the_contract_s_scripts_and_a_version_it_knows() -> None:
    shipped = sorted(p.name for p in files("pelican_worker").joinpath("scripts").iterdir() if p.name.endswith(".lua"))
    assert shipped == SCRIPTS
    assert int(_packaged("CONTRACT_VERSION").decode().strip()) in KNOWN_CONTRACT_VERSIONS


def test_the_package_s_copies_are_the_contract_s_byte_for_byte() -> None:
    _in_the_repository()
    theirs = {p.name: p.read_bytes() for p in (CONTRACT / "scripts").glob("*.lua")}
    assert sorted(theirs) == SCRIPTS
    differ = [name for name in SCRIPTS if _packaged(f"scripts/{name}") != theirs[name]]
    assert differ == [], f"copies differ from contract/scripts: {differ}; run scripts/sync"
    assert _packaged("CONTRACT_VERSION") == (CONTRACT / "VERSION").read_bytes(), "run scripts/sync"
    assert _packaged("partitions.json") == (CONTRACT / "partitions.json").read_bytes(), "run scripts/sync"


def test_hash_tag_is_the_first_non_empty_braced_part_else_the_name() -> None:
    assert hash_tag("{orders}:events") == "orders"
    assert hash_tag("a{b}c{d}") == "b"
    assert hash_tag("{a{b}x") == "a{b"
    assert hash_tag("notifications") == "notifications"
    assert hash_tag("empty{}tag") == "empty{}tag"
    assert hash_tag("open{only") == "open{only"


def test_key_names() -> None:
    assert settings_key("{orders}:events", "billing") == "{orders}:pelican:{orders}:events:billing:settings"
    assert terminal_key("{orders}:events", "billing") == "{orders}:pelican:{orders}:events:billing:terminal"
    assert errors_key("jobs", "w") == "{jobs}:pelican:jobs:w:errors"
    assert bounds_key("{orders}:events") == "{orders}:pelican:{orders}:events:bounds"
    assert rejected_key("jobs") == "{jobs}:pelican:jobs:rejected"


SETTINGS = WorkerSettings(min_idle_ms=4000, retry_after_ms=9000, max_deliveries=5, contract_version=1)


@pytest.mark.parametrize(
    "raw",
    [
        # What redis-py answers without decode_responses: bytes names, RESP2 (flat) and RESP3 (a map).
        [b"minIdleMs", b"4000", b"retryAfterMs", b"9000", b"maxDeliveries", b"5", b"contractVersion", b"1"],
        {b"minIdleMs": b"4000", b"retryAfterMs": b"9000", b"maxDeliveries": b"5", b"contractVersion": b"1"},
        {"minIdleMs": "4000", "retryAfterMs": "9000", "maxDeliveries": "5", "contractVersion": "1"},
    ],
)
def test_settings_are_parsed_by_decoded_name(raw: object) -> None:
    assert parse_settings(raw) == SETTINGS


def test_settings_without_a_contract_version_are_version_1() -> None:
    parsed = parse_settings({b"minIdleMs": b"4000", b"retryAfterMs": b"9000"})
    assert parsed == WorkerSettings(4000, 9000, None, 1)


def test_an_empty_settings_hash_is_no_settings() -> None:
    assert parse_settings([]) is None
    assert parse_settings({}) is None


@pytest.mark.parametrize("version", [b"2", b"0", b"v1", b"", b"2.0", b"1.0", b" 1", b"1x", "\u00b9".encode()])
def test_an_unknown_contract_version_names_both_versions(version: bytes) -> None:
    with pytest.raises(ContractVersionError) as raised:
        parse_settings({b"minIdleMs": b"4000", b"retryAfterMs": b"9000", b"contractVersion": version})
    text = str(raised.value)
    assert f"the operator speaks worker contract {version.decode()}, this library knows 1" in text
    assert "upgrade the library" in text


def test_the_version_is_read_first_whatever_the_other_fields_hold() -> None:
    with pytest.raises(ContractVersionError) as raised:
        parse_settings({b"minIdleMs": b"soon", b"contractVersion": b"2.0"})  # no retryAfterMs either
    assert raised.value.operator_version == "2.0"


@pytest.mark.parametrize(
    "raw",
    [
        {b"retryAfterMs": b"9000"},
        {b"minIdleMs": b"4s", b"retryAfterMs": b"9000"},
        {b"minIdleMs": b"-1", b"retryAfterMs": b"9000"},
        {b"minIdleMs": b"4000", b"retryAfterMs": b"9000", b"maxDeliveries": b"many"},
    ],
)
def test_malformed_settings_are_an_error_never_a_silent_default(raw: object) -> None:
    with pytest.raises(SettingsError):
        parse_settings(raw)


def test_lease_interval_is_a_third_of_min_idle_within_100_ms_and_10_s() -> None:
    assert lease_interval(None) == 1.0
    assert lease_interval(WorkerSettings(3000, 0, None, 1)) == 1.0
    assert lease_interval(WorkerSettings(120, 0, None, 1)) == 0.1
    assert lease_interval(WorkerSettings(300_000, 0, None, 1)) == 10.0


def test_reasons_are_camel_case_up_to_63_characters() -> None:
    assert Outcome.terminal("RecordNotFound").reason == "RecordNotFound"
    assert Outcome.terminal("X").reason == "X"
    assert Outcome.terminal("A" + "b" * 62).reason == "A" + "b" * 62
    for bad in ["", "recordNotFound", "Record_Not_Found", "Record Not", "Ünicode", "RecordNotFound\n", "A" + "b" * 63]:
        with pytest.raises(InvalidReason, match=r"\^\[A-Z\]\[A-Za-z0-9\]\{0,62\}\$"):
            Outcome.terminal(bad)
    with pytest.raises(InvalidReason):
        Outcome("terminal", "bad reason")


def test_error_text_is_cut_to_1024_bytes_at_a_character_boundary() -> None:
    short = error_text(KeyError("job-1"))
    assert short == "KeyError: 'job-1'"
    assert error_text(RuntimeError()) == "RuntimeError"
    long = error_text(ValueError("€" * 1000)).encode()
    assert len(long) <= 1024
    assert long.decode("utf-8").startswith("ValueError: €")
    assert len(long) == 12 + 3 * ((1024 - 12) // 3)


def test_message_fields() -> None:
    m = Message("1-0", [(b"a", b"\xff"), (b"a", b"2"), (b"job", "é".encode())])
    assert m.field("a") == b"\xff"
    assert m.field(b"a") == b"\xff"
    assert m.text("a") is None
    assert m.text("job") == "é"
    assert m.field("b") is None
