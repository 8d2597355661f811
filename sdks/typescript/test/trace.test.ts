/**
 * A message's trace through the stream (SPEC 23, contract/README.md "Trace context") against a real redis-server,
 * with the OpenTelemetry SDK's in-memory exporter, the W3C propagator and the AsyncLocalStorage context manager
 * installed as an application would: what the entry carries, and the spans of each publish and handler run, one
 * trace from the application's request to every run. The first test runs before any SDK is installed (the tests of a
 * file run in order, and this file in a process of its own: the provider and the propagator are global).
 */
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";
import { context, propagation, trace, SpanKind, SpanStatusCode, type Span } from "@opentelemetry/api";
import { AsyncLocalStorageContextManager } from "@opentelemetry/context-async-hooks";
import { W3CTraceContextPropagator } from "@opentelemetry/core";
import {
  BasicTracerProvider,
  InMemorySpanExporter,
  SimpleSpanProcessor,
  type ReadableSpan,
} from "@opentelemetry/sdk-trace-base";
import type { Redis } from "ioredis";

import {
  KEY_FIELD,
  Producer,
  PublishOutcomeUnknown,
  PublishUnavailable,
  TopicProducer,
  TopicWorker,
  Worker,
  done,
  errorsKey,
  partitionStream,
  retry,
  settingsKey,
  terminal,
  topicKey,
  type Message,
  type Outcome,
} from "../src/index.js";
import { commandTokens } from "../src/producer.js";
import { Carried, KEPT } from "../src/trace.js";
import { startProxy } from "./support/proxy.js";
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

let exporter: InMemorySpanExporter | undefined;

/** Installs the SDK once (as an application does at start), and empties the exporter for the test. */
function installSdk(): InMemorySpanExporter {
  if (!exporter) {
    exporter = new InMemorySpanExporter();
    trace.setGlobalTracerProvider(new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] }));
    propagation.setGlobalPropagator(new W3CTraceContextPropagator());
    context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
  }
  exporter.reset();
  return exporter;
}

/** Runs `work` inside a new span of the application's, `name`, ended after it. */
async function inSpan<T>(name: string, work: () => Promise<T>): Promise<{ span: Span; value: T }> {
  const span = trace.getTracer("shop").startSpan(name);
  try {
    return { span, value: await context.with(trace.setSpan(context.active(), span), work) };
  } finally {
    span.end();
  }
}

/** Each entry of `stream`: its id and its fields as text, in order. */
async function entries(on: Redis, stream: string): Promise<Array<{ id: string; fields: string[] }>> {
  return (await on.xrange(stream, "-", "+")).map(([id, fields]) => ({ id, fields }));
}

function named(spans: readonly ReadableSpan[], name: string): ReadableSpan[] {
  return spans.filter((span) => span.name === name);
}

function ofMessage(spans: readonly ReadableSpan[], id: string): ReadableSpan {
  const span = spans.find((s) => s.attributes["messaging.message.id"] === id);
  assert.ok(span, `a span of message ${id}`);
  return span;
}

/** The handler the tests run: it obeys the field `handle`. */
async function obey(message: Message): Promise<Outcome> {
  switch (message.field("handle")) {
    case "fail":
      throw new Error("the card was declined");
    case "terminal:Gone":
      return terminal("Gone");
    case "retry":
      return retry();
    default:
      return done();
  }
}

test("without an SDK nothing is added to an entry and the handler runs in no span", async () => {
  const stream = freshStream("orders");
  await createGroup(admin, stream, group);
  const producer = new Producer({ redis: server.url, stream });
  const { value: id } = await inSpan("checkout", () => producer.publish({ handle: "done" }));
  await producer.close();
  assert.deepEqual(await entries(admin, stream), [{ id, fields: ["handle", "done"] }]);

  const worker = new Worker({
    redis: server.url,
    stream,
    group,
    consumer: "worker-1",
    blockMs: 100,
    logger: recordingLogger(),
  });
  const seen: Array<string | undefined> = [];
  const running = worker.run(async () => {
    seen.push(trace.getActiveSpan()?.spanContext().spanId);
    return done();
  });
  await waitFor("the handler run", () => worker.stats().done === 1);
  await worker.stop();
  await running;
  assert.deepEqual(seen, [undefined]);
});

test("a message is one trace from the request's span through its publish to each handler run", async () => {
  const exporter = installSdk();
  const stream = freshStream("orders");
  await createGroup(admin, stream, group);
  const producer = new Producer({ redis: server.url, stream });
  const handles = ["done", "fail", "terminal:Gone", "retry"];
  const { span: checkout, value: ids } = await inSpan("checkout", async () => {
    const ids: string[] = [];
    for (const handle of handles) ids.push(await producer.publish({ handle }));
    return ids;
  });
  await producer.close();
  const traceId = checkout.spanContext().traceId;
  for (const entry of await entries(admin, stream)) {
    assert.equal(entry.fields[0], "handle", "the application's fields first");
    assert.equal(entry.fields.at(-2), "traceparent", "the context last");
    assert.match(entry.fields.at(-1) ?? "", new RegExp(`^00-${traceId}-[0-9a-f]{16}-01$`), "the request's trace");
    assert.equal(entry.fields.length, 4, "no tracestate without entries");
  }

  // The handler's own spans are children of its run: it runs in the run's context.
  const activeInHandler = new Map<string, string | undefined>();
  const worker = new Worker({
    redis: server.url,
    stream,
    group,
    consumer: "worker-1",
    blockMs: 100,
    logger: recordingLogger(),
  });
  const running = worker.run(async (message) => {
    activeInHandler.set(message.id, trace.getActiveSpan()?.spanContext().spanId);
    return obey(message);
  });
  await waitFor("a handler run of each message", () => activeInHandler.size === handles.length);
  await worker.stop();
  await running;

  const spans = exporter.getFinishedSpans();
  const sends = named(spans, `send ${stream}`);
  const runs = named(spans, `process ${stream}`);
  assert.deepEqual([sends.length, runs.length], [4, 4], spans.map((s) => s.name).join(", "));
  for (const id of ids) {
    const send = ofMessage(sends, id);
    assert.equal(send.kind, SpanKind.PRODUCER);
    assert.equal(send.parentSpanContext?.spanId, checkout.spanContext().spanId, "a publish is a child of the request");
    assert.deepEqual(
      [send.attributes["messaging.system"], send.attributes["messaging.destination.name"]],
      ["redis", stream],
    );
    assert.deepEqual(
      [send.attributes["messaging.operation.type"], send.attributes["messaging.operation.name"]],
      ["send", "publish"],
    );
    const run = ofMessage(runs, id);
    assert.equal(run.kind, SpanKind.CONSUMER);
    assert.equal(run.spanContext().traceId, traceId, "one trace from the request to the handler");
    assert.equal(run.parentSpanContext?.spanId, send.spanContext().spanId, "each run continues its publish");
    assert.deepEqual(
      [run.attributes["messaging.consumer.group.name"], run.attributes["messaging.client.id"]],
      [group, "worker-1"],
    );
    assert.deepEqual(
      [run.attributes["messaging.operation.type"], run.attributes["messaging.destination.name"]],
      ["process", stream],
    );
    assert.equal(activeInHandler.get(id), run.spanContext().spanId, "the handler runs inside its run's span");
  }
  const [doneRun, failRun, terminalRun, retryRun] = ids.map((id) => ofMessage(runs, id));
  assert.equal(doneRun?.attributes["pelican.outcome"], "done");
  assert.equal(doneRun?.status.code, SpanStatusCode.UNSET);
  assert.equal(failRun?.attributes["pelican.outcome"], "fail");
  const recorded = await admin.hget(errorsKey(stream, group), ids[1] ?? "");
  assert.deepEqual(failRun?.status, { code: SpanStatusCode.ERROR, message: "Error: the card was declined" });
  assert.equal(recorded, "Error: the card was declined", "the status says what the entry's last error says");
  assert.deepEqual(
    [terminalRun?.attributes["pelican.outcome"], terminalRun?.attributes["pelican.reason"]],
    ["terminal", "Gone"],
  );
  assert.equal(retryRun?.attributes["pelican.outcome"], "retry");
});

test("a batch is one send span whose context every entry carries", async () => {
  const exporter = installSdk();
  const stream = freshStream("orders");
  const producer = new Producer({ redis: server.url, stream });
  const { value: published } = await inSpan("import", () => producer.publishBatch([{ n: "1" }, { n: "2" }]));
  await producer.close();
  const [send, ...others] = named(exporter.getFinishedSpans(), `send ${stream}`);
  assert.ok(send && others.length === 0, "one send span");
  assert.equal(send.attributes["messaging.batch.message_count"], 2);
  const context = `00-${send.spanContext().traceId}-${send.spanContext().spanId}-01`;
  assert.deepEqual(await entries(admin, stream), [
    { id: published.ids[0], fields: ["n", "1", "traceparent", context] },
    { id: published.ids[1], fields: ["n", "2", "traceparent", context] },
  ]);
});

for (const ordering of ["None", "PerKey"]) {
  test(`a topic's publish and handler run (ordering ${ordering}) name the topic, the key and the partition`, async () => {
    const exporter = installSdk();
    const topic = `events-${process.pid}-${ordering}`;
    await makeTopic(topic, 2, ordering);
    const producer = await TopicProducer.connect(server.url, topic);
    const { value: published } = await inSpan("checkout", () =>
      producer.publish({ handle: "done" }, { key: "order-42" }),
    );
    await producer.close();
    const stream = partitionStream(topic, published.partition);

    const worker = await TopicWorker.connect({
      redis: server.url,
      topic,
      group,
      consumer: "member-1",
      blockMs: 100,
      logger: recordingLogger(),
    });
    const running = worker.run(obey);
    await waitFor("the handler run", () => named(exporter.getFinishedSpans(), `process ${stream}`).length === 1);
    await worker.stop();
    await running;

    const spans = exporter.getFinishedSpans();
    const send = ofMessage(named(spans, `send ${stream}`), published.id);
    const run = ofMessage(named(spans, `process ${stream}`), published.id);
    for (const span of [send, run]) {
      assert.deepEqual(
        [
          span.attributes["pelican.topic"],
          span.attributes["pelican.key"],
          span.attributes["messaging.destination.name"],
        ],
        [topic, "order-42", stream],
      );
    }
    assert.equal(run.parentSpanContext?.spanId, send.spanContext().spanId, "the run continues its publish");
    assert.equal(run.attributes["pelican.outcome"], "done");
    const [entry] = await entries(admin, stream);
    assert.deepEqual(entry?.fields.slice(0, 4), [KEY_FIELD, "order-42", "handle", "done"], "the key first");
    assert.equal(entry?.fields[4], "traceparent", "the context last");
  });
}

test("a retried idempotent publish writes the context of its first attempt", async (t) => {
  const target = await idmpServer();
  if (target === undefined) {
    t.skip("the redis-server has no XADD ... IDMP (Redis 8.6+) and no IDMP_REDIS_SERVER is named");
    return;
  }
  const exporter = installSdk();
  const proxy = await startProxy(target.port);
  try {
    const stream = freshStream("orders");
    const producer = await new Producer({ redis: `redis://127.0.0.1:${proxy.port}`, stream }).idempotent("shop-1");
    // The first attempt never reaches the server: its outcome is unknown to the producer.
    proxy.loseNextRequest();
    const first = await inSpan("checkout", () => producer.publish("order-7", { order: "7" }).catch((e: unknown) => e));
    assert.ok(first.value instanceof PublishOutcomeUnknown, String(first.value));
    assert.equal(await target.admin.xlen(stream), 0, "the first attempt wrote nothing");
    // The application publishes it again, later, in another span, until it is written (the connection reconnects
    // meanwhile: an attempt before then is unavailable).
    let id: string | undefined;
    for (let attempt = 0; id === undefined && attempt < 50; attempt++) {
      const again = await inSpan("retry", () =>
        producer.publish("order-7", { order: "7" }).catch((e: unknown) => {
          if (e instanceof PublishUnavailable) return undefined;
          throw e;
        }),
      );
      id = again.value;
      if (id === undefined) await sleep(100);
    }
    await producer.close();
    assert.ok(id, "published again");
    const sends = named(exporter.getFinishedSpans(), `send ${stream}`);
    const [firstSend] = sends;
    assert.ok(firstSend);
    assert.equal(firstSend.parentSpanContext?.spanId, first.span.spanContext().spanId);
    assert.equal(firstSend.status.code, SpanStatusCode.ERROR);
    assert.equal(firstSend.attributes["pelican.message_id"], "order-7");
    const written = ofMessage(sends, id);
    assert.notEqual(written.spanContext().traceId, firstSend.spanContext().traceId, "published in another trace");
    const context = `00-${firstSend.spanContext().traceId}-${firstSend.spanContext().spanId}-01`;
    assert.deepEqual(await entries(target.admin, stream), [{ id, fields: ["order", "7", "traceparent", context] }]);
  } finally {
    await proxy.close();
    if (target !== server) await target.stop();
  }
});

test("the carried fields are kept for the last 1,024 message ids only, each taken once", () => {
  const carried = new Carried();
  for (let n = 0; n <= KEPT; n++) carried.keep(`m-${n}`, [["traceparent", String(n)]]);
  assert.equal(carried.take("m-0"), undefined, "the oldest was dropped");
  assert.deepEqual(carried.take(`m-${KEPT}`), [["traceparent", String(KEPT)]]);
  assert.equal(carried.take(`m-${KEPT}`), undefined, "taken once");
  carried.keep("m-1", [["traceparent", "again"]]);
  assert.deepEqual(carried.take("m-1"), [["traceparent", "again"]], "kept again under its id");
});

/** A topic of `partitions` as the operator makes it (contract version 2), its group on each partition. */
async function makeTopic(topic: string, partitions: number, ordering: string): Promise<void> {
  const settings = {
    contractVersion: 2,
    partitions,
    ordering,
    backoffFactor: 1,
    backoffMaxMs: 0,
    minIdleMs: 60_000,
    retryAfterMs: 60_000,
    maxDeliveries: 5,
  };
  await admin.hset(topicKey(topic), "partitions", partitions, "contractVersion", 2);
  await admin.hset(settingsKey(topic, group), settings);
  for (let p = 0; p < partitions; p++) {
    await admin.xgroup("CREATE", partitionStream(topic, p), group, "0", "MKSTREAM");
    await admin.hset(settingsKey(partitionStream(topic, p), group), settings);
  }
}

/**
 * A server with `XADD ... IDMP` (Redis 8.6+): the test's when it has it, else one of `IDMP_REDIS_SERVER`. Without
 * either the test is skipped, saying so, unless `IDMP_REQUIRED=1` (the repository's scripts/test sets both).
 */
async function idmpServer(): Promise<RedisServer | undefined> {
  if (commandTokens(await admin.call("COMMAND", "DOCS", "XADD"), "xadd").has("IDMP")) return server;
  const named = process.env["IDMP_REDIS_SERVER"];
  if (named) return startRedis([], named);
  if (process.env["IDMP_REQUIRED"] === "1") throw new Error("IDMP_REQUIRED=1 but no IDMP_REDIS_SERVER is named");
  return undefined;
}
