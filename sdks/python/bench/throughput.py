"""Throughput of the library's worker beside a hand-written redis-py asyncio XREADGROUP/XACK loop, on the same server
in one run.

    python bench/throughput.py [N]      (default 20000; REDIS_URL, else a redis-server started on a free port;
                                         ROUNDS, default 3: each run that many times, the best counts;
                                         SDK=metrics: the last runs with a meter provider instead)

Each run gets a fresh stream of N entries already published (each with the ``traceparent`` a traced producer writes),
a handler that does nothing, and is timed from the start until every entry is acknowledged. The ratio compares the
library with the hand loop of the same batch size: concurrency 1 with COUNT 1, concurrency 16 with COUNT 16, each with
one XACK a batch. Then the library runs again with an OpenTelemetry SDK installed, recording a span per handler run
(kept in memory), or with ``SDK=metrics`` a meter provider recording the worker's metrics (read by an in-memory
reader): OpenTelemetry takes one provider of each per process, so these runs come last, and one of them per process.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis
from opentelemetry import metrics, propagate, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from redis.asyncio import Redis

from pelican_worker import Message, Outcome, Worker

GROUP = "bench"
#: The context a traced producer writes into each entry (contract/README.md, "Trace context").
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def prepare(r: Redis, stream: str, n: int) -> None:
    await r.delete(stream)
    await r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for start in range(0, n, 1000):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(n, start + 1000)):
            pipe.xadd(stream, {"job": str(i), "path": f"/data/{i}.txt", "traceparent": TRACEPARENT})
        await pipe.execute()


async def library(url: str, stream: str, n: int, concurrency: int) -> float:
    async def handle(message: Message) -> Outcome:
        return Outcome.done()

    worker = Worker(url, stream, GROUP, "bench-1", concurrency=concurrency, block=0.1)
    stop = asyncio.Event()
    started = time.perf_counter()
    task = asyncio.create_task(worker.run(handle, stop))
    while worker.stats.done < n:  # noqa: ASYNC110 - the stats have no event to wait on: polled every 2 ms
        await asyncio.sleep(0.002)
    elapsed = time.perf_counter() - started
    stop.set()
    await task
    return elapsed


async def hand_loop(url: str, stream: str, n: int, count: int) -> float:
    r = Redis.from_url(url)

    async def handle(entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        return None

    acked = 0
    started = time.perf_counter()
    while acked < n:
        reply: Any = await r.xreadgroup(GROUP, "hand-1", {stream: ">"}, count=count, block=100)
        for _, entries in reply:
            for entry_id, fields in entries:
                await handle(entry_id, fields)
            # One XACK for the whole batch, as a hand-written loop does.
            await r.xack(stream, GROUP, *(entry_id for entry_id, _ in entries))
            acked += len(entries)
    elapsed = time.perf_counter() - started
    await r.aclose()
    return elapsed


async def measure(url: str, n: int) -> None:
    r = Redis.from_url(url)
    runs: list[tuple[str, Callable[[str], Awaitable[float]]]] = [
        ("hand loop, COUNT 1", lambda s: hand_loop(url, s, n, 1)),
        ("pelican_worker, concurrency 1", lambda s: library(url, s, n, 1)),
        ("hand loop, COUNT 16, one XACK a batch", lambda s: hand_loop(url, s, n, 16)),
        ("pelican_worker, concurrency 16", lambda s: library(url, s, n, 16)),
    ]
    sdk = "metered" if os.environ.get("SDK") == "metrics" else "traced"
    traced: list[tuple[str, Callable[[str], Awaitable[float]]]] = [
        (f"pelican_worker {sdk}, concurrency 1", lambda s: library(url, s, n, 1)),
        (f"pelican_worker {sdk}, concurrency 16", lambda s: library(url, s, n, 16)),
    ]
    rounds = int(os.environ.get("ROUNDS", "3"))
    rates: dict[str, float] = {}
    exporter = InMemorySpanExporter()
    for phase in (runs, traced):
        if phase is traced and sdk == "metered":
            metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
        elif phase is traced:
            # As an application that traces does: the SDK, the W3C propagator.
            provider = TracerProvider()
            provider.add_span_processor(SimpleSpanProcessor(exporter))
            trace.set_tracer_provider(provider)
            propagate.set_global_textmap(TraceContextTextMapPropagator())
        # The machine may be shared: the runs of a phase take turns, and each one's best round counts.
        for _ in range(rounds):
            for name, run in phase:
                await prepare(r, "bench", n)
                rates[name] = max(rates.get(name, 0.0), n / await run("bench"))
                await r.delete("bench")
    await r.aclose()
    print(f"{n} messages per run, best of {rounds}, one server, one process (Python {sys.version.split()[0]})")
    print(f"{'run':40} {'msgs/s':>10}")
    for name, rate in rates.items():
        print(f"{name:40} {rate:>10.0f}")
    for library_run, hand_run in [(runs[1][0], runs[0][0]), (runs[3][0], runs[2][0])]:
        print(f"ratio {library_run} / {hand_run}: {rates[library_run] / rates[hand_run]:.2f}")
    for traced_run, library_run in [(traced[0][0], runs[1][0]), (traced[1][0], runs[3][0])]:
        print(f"ratio {traced_run} / {library_run}: {rates[traced_run] / rates[library_run]:.2f}")
    if sdk == "traced":
        print(f"{len(exporter.get_finished_spans())} spans recorded")


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    binary = os.environ.get("REDIS_SERVER") or shutil.which("redis-server")
    if binary is None:
        sys.exit("no redis-server: set REDIS_URL, or put redis-server on PATH (or name it in REDIS_SERVER)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    probe = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            probe.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    probe.close()
    return server, f"redis://127.0.0.1:{port}"


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    url = os.environ.get("REDIS_URL")
    server = None
    if url is None:
        server, url = start_server()
    try:
        asyncio.run(measure(url, n))
    finally:
        if server is not None:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
