"""The blocking facade, the Prometheus adapter, the conformance worker and the seed-000 example."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import redis
from helpers import CONSUMER, GROUP, STREAM, client, eventually, pending, running, worker
from prometheus_client import CollectorRegistry

from pelican_worker import Message, Outcome, partition_of
from pelican_worker.keys import errors_key, members_key, partition_stream, settings_key, terminal_key, topic_key
from pelican_worker.prometheus import register
from pelican_worker.sync import Worker as SyncWorker

ROOT = Path(__file__).resolve().parents[1]


def _sync_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True)


def test_the_blocking_facade_runs_plain_functions_in_threads(redis_url: str) -> None:
    r = _sync_client(redis_url)
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    for job in ["a", "b", "gone"]:
        r.xadd(STREAM, {"job": job})
    threads: set[str] = set()

    def handle(message: Message) -> Outcome:
        threads.add(threading.current_thread().name)
        time.sleep(0.05)  # blocking code is fine here
        return Outcome.terminal("RecordNotFound") if message.text("job") == "gone" else Outcome.done()

    facade = SyncWorker(redis_url, STREAM, GROUP, CONSUMER, concurrency=2)
    runner = threading.Thread(target=lambda: facade.run(handle, signals=False))
    runner.start()
    deadline = time.monotonic() + 10
    while facade.stats.done + facade.stats.terminal < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    facade.stop()
    runner.join(30)
    assert not runner.is_alive()
    assert (facade.stats.done, facade.stats.terminal) == (2, 1)
    assert all(name.startswith("pelican-handler") for name in threads)
    assert r.xpending(STREAM, GROUP)["pending"] == 0
    assert r.hgetall(terminal_key(STREAM, GROUP)) == {"RecordNotFound": "1"}


SYNC_WORKER = """
import os, sys, time
from pelican_worker import Outcome
from pelican_worker.sync import Worker

def handle(message):
    print(message.id, flush=True)
    time.sleep(0.3)
    return Outcome.done()

stats = Worker(os.environ["REDIS_URL"], os.environ["STREAM"], os.environ["GROUP"], "sync-1").run(handle)
print(f"done={stats.done}", flush=True)
"""


def test_the_blocking_facade_shuts_down_gracefully_on_sigterm(redis_url: str) -> None:
    r = _sync_client(redis_url)
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    entry = r.xadd(STREAM, {"job": "a"})
    process = _start(["-c", SYNC_WORKER], _conformance_env(redis_url))
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == entry  # the handler is running
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert stdout.strip() == "done=1"  # the running handler finished within the grace
    assert r.xpending(STREAM, GROUP)["pending"] == 0


BLOCKED_SYNC_WORKER = """
import os, time
from pelican_worker import Outcome
from pelican_worker.sync import Worker

def handle(message):
    print(message.id, flush=True)
    time.sleep(60)  # blocking code that ignores the shutdown
    return Outcome.done()

stats = Worker(os.environ["REDIS_URL"], os.environ["STREAM"], os.environ["GROUP"], "sync-1", shutdown_grace=0.5).run(
    handle
)
print(f"abandoned={stats.abandoned}", flush=True)
"""


def test_the_blocking_facade_s_process_exits_after_the_grace_though_a_handler_blocks(redis_url: str) -> None:
    r = _sync_client(redis_url)
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    entry = r.xadd(STREAM, {"job": "a"})
    process = _start(["-c", BLOCKED_SYNC_WORKER], _conformance_env(redis_url))
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == entry  # the handler is running
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        # The grace (0.5 s), the cancelled handlers' wait (1 s), the give-back and the interpreter's exit.
        stdout, stderr = process.communicate(timeout=5)
        took = time.monotonic() - signalled
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert stdout.strip() == "abandoned=1"
    assert took < 4, took
    [p] = r.xpending_range(STREAM, GROUP, "-", "+", 10)
    assert (p["message_id"], p["consumer"], p["times_delivered"]) == (entry, "", 0)  # given back, uncounted


def test_the_prometheus_adapter_exports_the_stats(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        await r.xadd(STREAM, {"n": "1"})
        await r.xadd(STREAM, {"n": "2"})

        async def handle(message: Message) -> Outcome:
            if message.text("n") == "2":
                raise RuntimeError("boom")
            return Outcome.done()

        w = worker(redis_url)
        registry = CollectorRegistry()
        register(w, registry)
        async with running(w, handle):
            await eventually(lambda: _handled(w.stats.done + w.stats.failed, 2))
        where = {"stream": STREAM, "group": GROUP}
        expected = {"done": 1, "terminal": 0, "failed": 1, "retried": 0, "abandoned": 0}
        for outcome, count in expected.items():
            labels = {**where, "outcome": outcome}
            assert registry.get_sample_value("pelican_worker_messages_total", labels) == count, outcome
        assert registry.get_sample_value("pelican_worker_in_flight", where) == 0
        # The one schema, exactly: these names, these labels, nothing else (the consumer is the target's label).
        samples = {(s.name, tuple(sorted(s.labels))) for m in registry.collect() for s in m.samples}
        assert samples == {
            ("pelican_worker_messages_total", ("group", "outcome", "stream")),
            ("pelican_worker_in_flight", ("group", "stream")),
        }

    asyncio.run(main())


async def _handled(count: int, expected: int) -> bool:
    return count == expected


def _start(module_args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *module_args],
        cwd=ROOT.parents[1],  # the repository root, as conformance/workers.txt runs it
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _conformance_env(redis_url: str, **extra: str) -> dict[str, str]:
    return {"REDIS_URL": redis_url, "STREAM": STREAM, "GROUP": GROUP, "CONSUMER": "conformance-1", **extra}


def _lines(process: subprocess.Popen[str], count: int, timeout: float = 15.0) -> list[dict[str, Any]]:
    assert process.stdout is not None
    lines: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while len(lines) < count:
        assert time.monotonic() < deadline, f"only {lines}"
        line = process.stdout.readline()
        if not line:
            break
        lines.append(json.loads(line))
    return lines


def test_the_conformance_worker_obeys_each_message_and_exits_0_on_sigterm(redis_url: str) -> None:
    r = _sync_client(redis_url)
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    r.hset(
        "{jobs}:pelican:{jobs}:files:workers:settings",
        mapping={"minIdleMs": "60000", "retryAfterMs": "5000", "maxDeliveries": "3"},
    )
    asked = {
        r.xadd(STREAM, {"handle": "done", "ms": "30"}): ("done", 30),
        r.xadd(STREAM, {"handle": "terminal:RecordNotFound"}): ("terminal", 0),
        r.xadd(STREAM, {"handle": "fail"}): ("fail", 0),
        r.xadd(STREAM, {"handle": "retry"}): ("retry", 0),
    }
    process = _start(["-m", "pelican_worker.conformance"], _conformance_env(redis_url))
    try:
        lines = _lines(process, 4)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    assert {line["id"]: (line["outcome"], line["ms"]) for line in lines} == asked
    assert {line["consumer"] for line in lines} == {"conformance-1"}
    assert r.hgetall(terminal_key(STREAM, GROUP)) == {"RecordNotFound": "1"}
    left = {p["message_id"]: p for p in r.xpending_range(STREAM, GROUP, "-", "+", 10)}
    failed, retried = list(asked)[2], list(asked)[3]
    assert sorted(left) == sorted([failed, retried])
    assert int(left[retried]["time_since_delivered"]) >= 60_000  # given back with an idle of minIdle
    assert r.hget(errors_key(STREAM, GROUP), failed) == "RuntimeError: the message asked the conformance worker to fail"


def test_with_an_otlp_endpoint_the_conformance_worker_exports_the_runs_span_before_its_exit(redis_url: str) -> None:
    exports: list[tuple[str, str | None, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        """An OTLP/HTTP endpoint keeping each request's path, content type and body."""

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            exports.append((self.path, self.headers.get("Content-Type"), body))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    collector = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    r = _sync_client(redis_url)
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    entry = r.xadd(STREAM, {"handle": "done", "traceparent": f"00-{trace_id}-b7ad6b7169203331-01"})
    # The batch processor's first export is 5 s away: only the flush at the exit can send the span in time.
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
    env = _conformance_env(redis_url, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_SERVICE_NAME="")
    process = _start(["-m", "pelican_worker.conformance"], env)
    try:
        lines = _lines(process, 1)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
        collector.shutdown()
    assert process.returncode == 0, stderr
    assert [(line["id"], line["outcome"]) for line in lines] == [(entry, "done")]
    assert [(path, content_type) for path, content_type, _ in exports] == [("/v1/traces", "application/x-protobuf")]
    # The protobuf holds the trace id as its 16 bytes, the names as text.
    body = exports[0][2]
    for wanted in [bytes.fromhex(trace_id), f"process {STREAM}".encode(), b"pelican-conformance-python"]:
        assert wanted in body, f"the export ({len(body)} bytes) lacks {wanted!r}"


def test_the_conformance_worker_gives_back_on_sigterm_within_its_grace(redis_url: str) -> None:
    r = _sync_client(redis_url)
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    entry = r.xadd(STREAM, {"handle": "done", "ms": "60000"})
    process = _start(["-m", "pelican_worker.conformance"], _conformance_env(redis_url, SHUTDOWN_GRACE_MS="200"))
    try:
        deadline = time.monotonic() + 15
        while r.xpending(STREAM, GROUP)["pending"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert stdout == ""  # the cut-off run reported nothing
    [p] = r.xpending_range(STREAM, GROUP, "-", "+", 10)
    assert (p["message_id"], p["consumer"], p["times_delivered"]) == (entry, "", 0)


def test_the_conformance_worker_exits_with_3_at_once(redis_url: str) -> None:
    r = _sync_client(redis_url)
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    entry = r.xadd(STREAM, {"handle": "exit"})
    process = _start(["-m", "pelican_worker.conformance"], _conformance_env(redis_url))
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 3, stderr
    assert [json.loads(line) for line in stdout.splitlines()] == [
        {"id": entry, "consumer": "conformance-1", "outcome": "exit", "ms": 0}
    ]
    assert r.xpending(STREAM, GROUP)["pending"] == 1  # nothing acknowledged


def test_the_conformance_worker_exits_with_4_for_an_unknown_contract_version(redis_url: str) -> None:
    r = _sync_client(redis_url)
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    r.hset(
        "{jobs}:pelican:{jobs}:files:workers:settings",
        mapping={"minIdleMs": "60000", "retryAfterMs": "5000", "contractVersion": "2"},
    )
    r.xadd(STREAM, {"handle": "done"})
    process = _start(["-m", "pelican_worker.conformance"], _conformance_env(redis_url))
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 4, stderr
    assert stdout == ""  # nothing handled
    assert stderr.count("the operator speaks worker contract 2, this library knows 1") == 1, stderr
    assert r.xpending(STREAM, GROUP)["pending"] == 0


def test_the_seed_000_example(redis_url: str) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import file_jobs
    finally:
        sys.path.pop(0)

    class Store:
        async def get(self, job_id: str) -> file_jobs.Job | None:
            if job_id == "2":
                raise ConnectionError("the job store did not answer")
            return {"1": file_jobs.Job(str(ROOT / "README.md")), "3": file_jobs.Job("/no/such/file")}.get(job_id)

    async def main() -> None:
        r = client(redis_url)
        await r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        ids = {job: await r.xadd(STREAM, {"job": job}) for job in ["1", "2", "3", "4"]}
        w = worker(redis_url)
        async with running(w, file_jobs.FileJobs(Store()).handle):
            await eventually(lambda: _handled(w.stats.done + w.stats.terminal + w.stats.failed, 4))
        assert (w.stats.done, w.stats.terminal, w.stats.failed) == (1, 1, 2)
        assert await r.hgetall(terminal_key(STREAM, GROUP)) == {"RecordNotFound": "1"}  # job 4: no record
        assert sorted(p.id for p in await pending(r)) == sorted([ids["2"], ids["3"]])  # left for the pass's retry
        errors = await r.hgetall(errors_key(STREAM, GROUP))
        assert errors[ids["2"]] == "ConnectionError: the job store did not answer"
        assert str(errors[ids["3"]]).startswith("FileNotFoundError")  # a missing file is not terminal

    asyncio.run(main())


def _topic_env(redis_url: str, **extra: str) -> dict[str, str]:
    return {"REDIS_URL": redis_url, "TOPIC": "orders", "GROUP": GROUP, "CONSUMER": "member-1", **extra}


def _make_topic(r: redis.Redis, partitions: int) -> None:
    fields = {"contractVersion": 2, "partitions": partitions, "ordering": "PerKey", "minIdleMs": 60_000}
    fields |= {"retryAfterMs": 1_000, "maxDeliveries": 5}
    r.hset(topic_key("orders"), mapping={"partitions": partitions, "contractVersion": 2})
    r.hset(settings_key("orders", GROUP), mapping=fields)  # type: ignore[arg-type]
    for p in range(partitions):
        r.hset(settings_key(partition_stream("orders", p), GROUP), mapping=fields)  # type: ignore[arg-type]
        r.xgroup_create(partition_stream("orders", p), GROUP, id="0", mkstream=True)


def test_the_conformance_worker_s_topic_mode_says_the_partition_key_and_times_of_each_run(redis_url: str) -> None:
    r = _sync_client(redis_url)
    _make_topic(r, 3)
    # Partition and id: ids of different partitions may be the same.
    asked: dict[tuple[int, bytes | str], str | None] = {}
    for i in range(6):
        key = f"order-{i % 2}"
        entry = r.xadd(partition_stream("orders", partition_of(key, 3)), {"pelican-key": key, "ms": "20"})
        asked[partition_of(key, 3), entry] = key
    keyless = r.xadd(partition_stream("orders", 1), {"handle": "done"})
    asked[1, keyless] = None
    process = _start(["-m", "pelican_worker.conformance"], _topic_env(redis_url, MEMBERSHIP_TTL_MS="2000"))
    try:
        lines = _lines(process, 7)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    assert {(line["partition"], line["id"]): line["key"] for line in lines} == asked
    assert {(line["consumer"], line["outcome"]) for line in lines} == {("member-1", "done")}
    for line in lines:
        assert line["endedAt"] - line["startedAt"] >= (20 if line["key"] else 0)
        assert abs(line["startedAt"] - time.time() * 1000) < 60_000
    # PerKey: the runs of one key one after the other.
    for key in ("order-0", "order-1"):
        runs = sorted((line["startedAt"], line["endedAt"]) for line in lines if line["key"] == key)
        assert all(before[1] <= after[0] for before, after in itertools.pairwise(runs))
    # The member left on SIGTERM.
    assert r.hgetall(members_key("orders", GROUP)) == {}


def test_the_conformance_worker_exits_with_4_for_a_topic_it_refuses(redis_url: str) -> None:
    r = _sync_client(redis_url)
    for description in ({}, {"contractVersion": 3, "partitions": 2}):
        r.delete(settings_key("orders", GROUP))
        if description:
            r.hset(settings_key("orders", GROUP), mapping=description)  # type: ignore[arg-type]
        process = _start(["-m", "pelican_worker.conformance"], _topic_env(redis_url))
        _, stderr = process.communicate(timeout=30)
        assert process.returncode == 4, stderr
        assert "orders" in stderr
