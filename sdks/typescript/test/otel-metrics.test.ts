/**
 * The worker's and the producer's metrics through OpenTelemetry (SPEC 23, docs/src/tracing.md "Metrics") against a
 * real redis-server, with the OpenTelemetry SDK's in-memory exporter installed as an application would: the
 * instruments' names, units, attribute sets and values a dashboard reads, and that they agree with the worker's stats
 * (the Prometheus view). The first test runs before any SDK is installed (the tests of a file run in order, and this
 * file in a process of its own: the meter provider is global).
 */
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { metrics } from "@opentelemetry/api";
import {
  AggregationTemporality,
  DataPointType,
  InMemoryMetricExporter,
  MeterProvider,
  PeriodicExportingMetricReader,
} from "@opentelemetry/sdk-metrics";
import type { Redis } from "ioredis";

import {
  Producer,
  PublishFailed,
  Worker,
  done,
  retry,
  terminal,
  type HandlerContext,
  type Message,
  type Outcome,
} from "../src/index.js";
import { DELIVERIES_FIELD } from "../src/keys.js";
import { startRedis, type RedisServer } from "./support/server.js";
import { createGroup, freshStream, recordingLogger, waitFor } from "./support/helpers.js";

let server: RedisServer;
let admin: Redis;
const group = "billing";

before(async () => {
  server = await startRedis();
  admin = server.admin;
});
after(() => server.stop());

/** The handler the tests run: it obeys the field `handle`; a requeued copy of a retry is done. */
async function obey(message: Message, context: HandlerContext): Promise<Outcome> {
  switch (message.field("handle")) {
    case "fail":
      throw new TypeError("the card was declined");
    case "terminal":
      return terminal("Gone");
    case "retry":
      return message.field(DELIVERIES_FIELD) === undefined ? retry() : done();
    case "slow":
      await new Promise((cut) => context.signal.addEventListener("abort", cut));
      return done();
    default:
      return done();
  }
}

function workerOn(stream: string): Worker {
  return new Worker({
    redis: server.url,
    stream,
    group,
    consumer: "worker-1",
    blockMs: 50,
    shutdownGraceMs: 200,
    logger: recordingLogger(),
  });
}

/** What the operator's pass does to a failed or retried message: a copy at the end of the stream, the original ACKed. */
async function requeue(stream: string, id: string): Promise<void> {
  const [[, fields] = ["", []]] = await admin.xrange(stream, id, id);
  await admin.xadd(stream, "*", ...fields, "pelican-origin-id", id, DELIVERIES_FIELD, "1");
  await admin.xack(stream, group, id);
}

/** The points of an instrument of the meter `pelican`: attributes (as sorted pairs) -> value (a histogram's count). */
type Points = Map<string, number>;

function key(attributes: Record<string, unknown>): string {
  return JSON.stringify(Object.entries(attributes).sort(([a], [b]) => a.localeCompare(b)));
}

function points(exporter: InMemoryMetricExporter, name: string): { unit: string; points: Points } {
  const last = exporter.getMetrics().at(-1);
  const scope = last?.scopeMetrics.find((s) => s.scope.name === "pelican");
  const metric = scope?.metrics.find((m) => m.descriptor.name === name);
  assert.ok(metric, `an instrument ${name}`);
  const found: Points = new Map();
  for (const point of metric.dataPoints) {
    const value =
      metric.dataPointType === DataPointType.HISTOGRAM ? (point.value as { count: number }).count : point.value;
    found.set(key(point.attributes), value as number);
  }
  return { unit: metric.descriptor.unit, points: found };
}

test("without an SDK a publish and a handler run record nothing and count as ever", async () => {
  const stream = freshStream("plain");
  await createGroup(admin, stream, group);
  const producer = new Producer({ redis: server.url, stream });
  await producer.publish({ handle: "done" });
  await producer.close();
  const worker = workerOn(stream);
  const running = worker.run(obey);
  await waitFor("the handler run", () => worker.stats().done === 1);
  await worker.stop();
  assert.equal((await running).done, 1);
});

test("a worker and a producer record the messaging conventions' instruments, as the stats count", async () => {
  // The application installs an SDK, before it makes its producers and workers.
  const exporter = new InMemoryMetricExporter(AggregationTemporality.CUMULATIVE);
  const reader = new PeriodicExportingMetricReader({ exporter, exportIntervalMillis: 3_600_000 });
  metrics.setGlobalMeterProvider(new MeterProvider({ readers: [reader] }));

  const stream = freshStream("orders");
  await createGroup(admin, stream, group);
  const producer = new Producer({ redis: server.url, stream });
  const worker = workerOn(stream);
  const running = worker.run(obey);
  const ids: Record<string, string> = {};
  for (const handle of ["done", "fail", "retry", "terminal"]) ids[handle] = await producer.publish({ handle });
  await waitFor("four runs", () => worker.stats().done + worker.stats().failed + worker.stats().retried === 3);
  await waitFor("the terminal one", () => worker.stats().terminal === 1);
  // The pass retries the failure and the retry; the failure's copy fails again (at the cap: dead-letter-bound).
  await requeue(stream, ids["fail"] ?? "");
  await requeue(stream, ids["retry"] ?? "");
  await waitFor("the copies' runs", () => worker.stats().done === 2 && worker.stats().failed === 2);
  await producer.publish({ handle: "slow" });
  await waitFor("the slow one in flight", () => worker.stats().inFlight === 1);
  await worker.stop();
  const stats = await running;
  const wrongType = freshStream("not-a-stream");
  await admin.set(wrongType, "x");
  const wrong = new Producer({ redis: server.url, stream: wrongType });
  await assert.rejects(wrong.publish({ handle: "done" }), PublishFailed);
  await Promise.all([producer.close(), wrong.close()]);
  assert.deepEqual(stats, { done: 2, terminal: 1, failed: 2, retried: 1, abandoned: 1, inFlight: 0 });
  await reader.forceFlush();

  const names = { "messaging.destination.name": stream, "messaging.consumer.group.name": group };
  const messaging = (operation: string, more: Record<string, string> = {}) =>
    key({
      "messaging.system": "redis",
      "messaging.operation.name": operation,
      "messaging.operation.type": operation,
      ...names,
      ...more,
    });
  assert.deepEqual(points(exporter, "messaging.client.consumed.messages"), {
    unit: "{message}",
    points: new Map([[messaging("receive"), 7]]),
  });
  const outcome = (outcome: string) => messaging("process", { "pelican.outcome": outcome });
  assert.deepEqual(points(exporter, "messaging.process.duration"), {
    unit: "s",
    points: new Map([
      [outcome("done"), 2],
      [messaging("process", { "pelican.outcome": "failed", "error.type": "TypeError" }), 2],
      [outcome("retried"), 1],
      [outcome("terminal"), 1],
    ]),
  });
  assert.deepEqual(points(exporter, "pelican.worker.in_flight"), {
    unit: "{message}",
    points: new Map([[key(names), 0]]),
  });
  assert.deepEqual(points(exporter, "pelican.worker.abandoned"), {
    unit: "{message}",
    points: new Map([[key(names), 1]]),
  });
  const publish = (destination: string, more: Record<string, string> = {}) =>
    key({
      "messaging.system": "redis",
      "messaging.destination.name": destination,
      "messaging.operation.name": "publish",
      "messaging.operation.type": "send",
      ...more,
    });
  assert.deepEqual(points(exporter, "messaging.client.sent.messages"), {
    unit: "{message}",
    points: new Map([
      [publish(stream), 5],
      [publish(wrongType, { "error.type": "failed" }), 1],
    ]),
  });
});
