/**
 * The library's worker beside a hand-written ioredis XREADGROUP / XACK loop (one XACK for each read's batch), on the same server in one run:
 * N messages each, every handler an async no-op; and the worker again with an OpenTelemetry SDK installed, recording
 * a span per handler run, and with an OpenTelemetry meter provider recording its metrics. `npm run bench` (REDIS_URL to use a running server, else one is started on a free loopback
 * port; N to change the count).
 */
import { createRequire } from "node:module";
import { setTimeout as sleep } from "node:timers/promises";
import { context, metrics, propagation, trace } from "@opentelemetry/api";
import { AsyncLocalStorageContextManager } from "@opentelemetry/context-async-hooks";
import { W3CTraceContextPropagator } from "@opentelemetry/core";
import {
  AggregationTemporality,
  InMemoryMetricExporter,
  MeterProvider,
  PeriodicExportingMetricReader,
} from "@opentelemetry/sdk-metrics";
import { BasicTracerProvider, InMemorySpanExporter, SimpleSpanProcessor } from "@opentelemetry/sdk-trace-base";
import { Redis } from "ioredis";

import { Worker, done } from "../src/index.js";
import { startRedis } from "../test/support/server.js";

const N = Number(process.env["N"] ?? 20_000);
const GROUP = "bench";
const quiet = { info: () => undefined, warn: () => undefined, error: () => undefined };
const handle = async (): Promise<void> => undefined;
/** The context a traced producer writes into each entry (contract/README.md, "Trace context"). */
const TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

let runs = 0;
/** The spans the SDK recorded, in every traced run. */
let recorded = 0;

/** A new stream holding N entries, and its group at the start. */
async function fill(admin: Redis): Promise<string> {
  const stream = `bench-${process.pid}-${++runs}`;
  await admin.xgroup("CREATE", stream, GROUP, "0", "MKSTREAM");
  for (let i = 0; i < N; i += 1000) {
    const pipeline = admin.pipeline();
    for (let j = i; j < Math.min(N, i + 1000); j++)
      pipeline.xadd(stream, "*", "n", String(j), "payload", "x".repeat(100), "traceparent", TRACEPARENT);
    await pipeline.exec();
  }
  return stream;
}

async function library(url: string, admin: Redis, concurrency: number): Promise<number> {
  const stream = await fill(admin);
  const worker = new Worker({ redis: url, stream, group: GROUP, consumer: "bench", concurrency, logger: quiet });
  const began = performance.now();
  const running = worker.run(async () => {
    await handle();
    return done();
  });
  while (worker.stats().done < N) await sleep(2);
  const seconds = (performance.now() - began) / 1000;
  await worker.stop();
  await running;
  return N / seconds;
}

/**
 * `library` with an OpenTelemetry SDK installed as an application that traces would (the W3C propagator, the
 * AsyncLocalStorage context manager), every span recorded and kept in memory; removed after the run.
 */
async function traced(url: string, admin: Redis, concurrency: number): Promise<number> {
  const exporter = new InMemorySpanExporter();
  trace.setGlobalTracerProvider(new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] }));
  propagation.setGlobalPropagator(new W3CTraceContextPropagator());
  context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
  try {
    const rate = await library(url, admin, concurrency);
    recorded += exporter.getFinishedSpans().length;
    return rate;
  } finally {
    trace.disable();
    propagation.disable();
    context.disable();
  }
}

/** `library` with an OpenTelemetry meter provider installed (its metrics read at the end); removed after the run. */
async function metered(url: string, admin: Redis, concurrency: number): Promise<number> {
  const exporter = new InMemoryMetricExporter(AggregationTemporality.CUMULATIVE);
  const reader = new PeriodicExportingMetricReader({ exporter, exportIntervalMillis: 60_000 });
  const provider = new MeterProvider({ readers: [reader] });
  metrics.setGlobalMeterProvider(provider);
  try {
    return await library(url, admin, concurrency);
  } finally {
    await provider.shutdown();
    metrics.disable();
  }
}

async function handWritten(url: string, admin: Redis, count: number): Promise<number> {
  const stream = await fill(admin);
  const conn = new Redis(url);
  const began = performance.now();
  for (let acked = 0; acked < N;) {
    const reply = (await conn.xreadgroup(
      "GROUP",
      GROUP,
      "bench",
      "COUNT",
      count,
      "BLOCK",
      1000,
      "STREAMS",
      stream,
      ">",
    )) as Array<[string, Array<[string, string[]]>]> | null;
    const ids = (reply?.[0]?.[1] ?? []).map(([id]) => id);
    await Promise.all(ids.map(() => handle()));
    // One XACK for the whole batch, as a hand-written loop does.
    if (ids.length > 0) await conn.xack(stream, GROUP, ...ids);
    acked += ids.length;
  }
  const seconds = (performance.now() - began) / 1000;
  conn.disconnect();
  return N / seconds;
}

const external = process.env["REDIS_URL"];
const server = external ? undefined : await startRedis();
const url = external ?? server?.url ?? "";
const admin = server?.admin ?? new Redis(url);
const version = /redis_version:(\S+)/.exec(await admin.info("server"))?.[1];
const ioredis = (createRequire(import.meta.url)("ioredis/package.json") as { version: string }).version;
console.log(`${N} messages a run, redis-server ${version}, node ${process.version}, ioredis ${ioredis}`);
// The machine may be shared: each configuration runs ROUNDS times, interleaved with its pair, and the best counts.
const ROUNDS = Number(process.env["ROUNDS"] ?? 3);
console.log(`best of ${ROUNDS} interleaved rounds`);
const rows: string[] = [];
const tracing: string[] = [];
const metering: string[] = [];
for (const [concurrency, count] of [
  [1, 1],
  [16, 16],
] as const) {
  let [hand, lib, withSdk, withMeter] = [0, 0, 0, 0];
  for (let round = 0; round < ROUNDS; round++) {
    hand = Math.max(hand, await handWritten(url, admin, count));
    lib = Math.max(lib, await library(url, admin, concurrency));
    withSdk = Math.max(withSdk, await traced(url, admin, concurrency));
    withMeter = Math.max(withMeter, await metered(url, admin, concurrency));
  }
  const loop = `COUNT ${count}${count > 1 ? ", one XACK a batch" : ""}`;
  rows.push(
    `| ${loop} | concurrency ${concurrency} | ${Math.round(hand)} | ${Math.round(lib)} | ${(lib / hand).toFixed(2)} |`,
  );
  tracing.push(
    `| concurrency ${concurrency} | ${Math.round(lib)} | ${Math.round(withSdk)} | ${(withSdk / lib).toFixed(2)} |`,
  );
  metering.push(
    `| concurrency ${concurrency} | ${Math.round(lib)} | ${Math.round(withMeter)} | ${(withMeter / lib).toFixed(2)} |`,
  );
}
console.log("| hand-written loop | library worker | hand-written msgs/s | library msgs/s | library / hand-written |");
console.log("| --- | --- | --- | --- | --- |");
for (const row of rows) console.log(row);
console.log("\ntracing: the library worker without an SDK and with one recording a span per handler run");
console.log("| library worker | no SDK msgs/s | SDK msgs/s | SDK / no SDK |");
console.log("| --- | --- | --- | --- |");
for (const row of tracing) console.log(row);
console.log(`${recorded} spans recorded`);
console.log("\nmetrics: the library worker without an SDK and with a meter provider recording its metrics");
console.log("| library worker | no SDK msgs/s | SDK msgs/s | SDK / no SDK |");
console.log("| --- | --- | --- | --- |");
for (const row of metering) console.log(row);
if (server) await server.stop();
else admin.disconnect();
