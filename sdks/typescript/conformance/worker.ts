/**
 * The conformance worker (contract/README.md, "The conformance worker"): configured by environment, its handler
 * obeys each message's `handle` (done | retry | fail | terminal:<Reason> | exit) after sleeping `ms`, and prints one
 * JSON line per handler run on stdout, and exits 4 (after its shutdown) when the operator speaks a contract version
 * this library does not know. Run from the repository root, once built:
 *
 *   REDIS_URL=redis://127.0.0.1:6379 STREAM=jobs GROUP=workers node sdks/typescript/dist/conformance/worker.js
 *
 * With `SENTINEL_MASTER=<name>`, `REDIS_URL` names a sentinel, and ioredis asks it for the primary monitored under
 * that name (`sentinels` and `name`), again whenever it reconnects. With `REDIS_CLUSTER=1`, `REDIS_URL` names a
 * primary of a Redis Cluster, and the program connects through ioredis' `Cluster`.
 *
 * With `TOPIC=<T>` instead of `STREAM` it is a member of the topic's group (a `TopicWorker`, member `CONSUMER`,
 * membership ttl `MEMBERSHIP_TTL_MS` when set), and each line also says the entry's `partition`, its `key` and when
 * the handler began and returned (`startedAt`, `endedAt`, ms since the epoch); a topic it refuses exits 4.
 *
 * With `MODE=publish` it is a producer instead: it publishes `MESSAGES` messages idempotently (message ids `m-0`,
 * `m-1`, ...), each published again with the same id until it answers an entry id, one JSON line per attempt.
 *
 * With `OTEL_EXPORTER_OTLP_ENDPOINT` set, the library's spans go to it over OTLP (`traces.ts`); whichever way the
 * program ends, the spans still queued are exported first (for at most 5 s).
 *
 * With `METRICS_PORT` set (a worker of a stream), the worker's metrics (`@pelican-io/worker/prom-client`, in a
 * prom-client registry of its own) are served at `http://127.0.0.1:<port>/metrics`.
 */
import { writeSync } from "node:fs";
import { createServer } from "node:http";
import { setTimeout as sleep } from "node:timers/promises";

import {
  KEY_FIELD,
  Producer,
  PublishOutcomeUnknown,
  PublishUnavailable,
  ContractVersionError,
  TopicError,
  TopicUnavailable,
  TopicWorker,
  Worker,
  done,
  retry,
  terminal,
  type Message,
  type Outcome,
  type RedisTarget,
} from "../src/index.js";

/** The SDK exporting the library's spans, when the program was given an OTLP endpoint. */
const traces = process.env["OTEL_EXPORTER_OTLP_ENDPOINT"] ? (await import("./traces.js")).exportTraces() : undefined;

/** Ends the process with `code` once the spans still queued are exported, waiting for them at most 5 s. */
async function exit(code: number): Promise<never> {
  if (traces) {
    const flushed = traces.shutdown().catch((error: unknown) => {
      console.error(`conformance worker: exporting the last spans: ${String(error)}`);
    });
    await Promise.race([flushed, sleep(5_000)]);
  }
  process.exit(code);
}

function required(name: string): string {
  const value = process.env[name];
  if (!value) {
    console.error(`conformance worker: ${name} is not set`);
    process.exit(2);
  }
  return value;
}

/**
 * `REDIS_URL` as the library takes it: the URL itself, the sentinel it names with `SENTINEL_MASTER`, or with
 * `REDIS_CLUSTER=1` a primary of the Redis Cluster.
 */
function target(url: string): RedisTarget {
  if (process.env["REDIS_CLUSTER"] === "1") {
    const node = new URL(url);
    return { cluster: [{ host: node.hostname, port: Number(node.port || 6379) }] };
  }
  const name = process.env["SENTINEL_MASTER"];
  if (!name) return url;
  const sentinel = new URL(url);
  return {
    sentinels: [{ host: sentinel.hostname, port: Number(sentinel.port || 26379) }],
    name,
    db: Number(sentinel.pathname.slice(1) || 0),
  };
}

/**
 * An attempt whose outcome is unknown (its reply was lost) or that found the server unavailable is published again
 * with the same message id, as the contract says: the server answers the first entry's id.
 */
async function publish(redis: RedisTarget, stream: string, messages: number): Promise<void> {
  for (let n = 0; n < messages; n++) {
    const message = `m-${n}`;
    for (;;) {
      // A producer of its own per attempt: a lost reply leaves the last connection broken.
      const producer = await new Producer({ redis, stream }).idempotent();
      try {
        const id = await producer.publish(message, { n: String(n) });
        writeSync(1, JSON.stringify({ message, outcome: "published", id }) + "\n");
        break;
      } catch (error) {
        if (!(error instanceof PublishOutcomeUnknown || error instanceof PublishUnavailable)) throw error;
        writeSync(1, JSON.stringify({ message, outcome: "unknown" }) + "\n");
        await sleep(100);
      } finally {
        await producer.close();
      }
    }
  }
}

if (process.env["MODE"] === "publish") {
  await publish(target(required("REDIS_URL")), required("STREAM"), Number(required("MESSAGES")));
  await exit(0);
}

/** One JSON line, written synchronously: it is on stdout before an `exit` ends the process. */
function line(fields: Record<string, unknown>): void {
  writeSync(1, JSON.stringify(fields) + "\n");
}

/** Obeys the message's `handle` after sleeping its `ms`, reporting the outcome before it is returned. */
async function obey(message: Message, report: (outcome: string, ms: number) => void): Promise<Outcome> {
  // `HANDLE` overrides every message's `handle` (a worker that fails whatever it reads).
  const handle = process.env["HANDLE"] || message.field("handle") || "done";
  const ms = Number(message.field("ms") ?? 0) || 0;
  if (handle === "exit") {
    report("exit", ms);
    return exit(3);
  }
  await sleep(ms);
  if (handle.startsWith("terminal:")) {
    report("terminal", ms);
    return terminal(handle.slice("terminal:".length));
  }
  if (handle === "done" || handle === "retry") {
    report(handle, ms);
    return handle === "done" ? done() : retry();
  }
  report("fail", ms);
  throw new Error(handle === "fail" ? "the message asked to fail" : `unknown handle ${JSON.stringify(handle)}`);
}

const redis = target(required("REDIS_URL"));
const group = required("GROUP");
const grace = process.env["SHUTDOWN_GRACE_MS"];
const ttl = process.env["MEMBERSHIP_TTL_MS"];
const common = {
  redis,
  group,
  ...(process.env["CONSUMER"] ? { consumer: process.env["CONSUMER"] } : {}),
  ...(grace ? { shutdownGraceMs: Number(grace) } : {}),
};

/** A member of the topic's group; each line also says where the entry was read, its key, and when it ran. */
async function runTopic(topic: string): Promise<void> {
  let worker: TopicWorker;
  try {
    worker = await TopicWorker.connect({ ...common, topic, ...(ttl ? { ttlMs: Number(ttl) } : {}) });
  } catch (error) {
    if (!(error instanceof TopicError) || error instanceof TopicUnavailable) throw error;
    console.error(`conformance worker: ${error.message}`);
    return exit(4);
  }
  worker.installSignalHandlers();
  await worker.run((message, { partition }) => {
    const startedAt = Date.now();
    const key = message.field(KEY_FIELD) ?? null;
    return obey(message, (outcome, ms) => {
      const endedAt = outcome === "exit" ? startedAt : Date.now();
      line({ id: message.id, consumer: worker.consumer, outcome, ms, partition, key, startedAt, endedAt });
    });
  });
}

/** Serves `worker`'s metrics as an application would: the adapter in a registry, read at each scrape. */
async function serveMetrics(worker: Worker, port: number): Promise<void> {
  const client = await import("prom-client");
  const { registerWorkerMetrics } = await import("../src/metrics.js");
  const registry = new client.Registry();
  registerWorkerMetrics(client, [worker], { registry });
  const server = createServer((request, response) => {
    if (request.url !== "/metrics") {
      response.writeHead(404).end();
      return;
    }
    registry.metrics().then(
      (text) => response.writeHead(200, { "content-type": registry.contentType }).end(text),
      (error: unknown) => response.writeHead(500).end(String(error)),
    );
  });
  await new Promise<void>((listening) => server.listen(port, "127.0.0.1", listening));
  // The server never keeps the process alive: the worker's shutdown ends it.
  server.unref();
}

async function runStream(stream: string): Promise<void> {
  const worker = new Worker({ ...common, stream });
  worker.installSignalHandlers();
  const metricsPort = process.env["METRICS_PORT"];
  if (metricsPort) await serveMetrics(worker, Number(metricsPort));
  await worker.run((message) =>
    obey(message, (outcome, ms) => line({ id: message.id, consumer: worker.consumer, outcome, ms })),
  );
}

try {
  const topic = process.env["TOPIC"];
  if (topic) await runTopic(topic);
  else await runStream(required("STREAM"));
} catch (error) {
  // The worker logged the version error itself.
  if (error instanceof ContractVersionError) await exit(4);
  console.error(`conformance worker: ${String(error)}`);
  await exit(1);
}
// Handlers the grace cut off may still hold timers: the shutdown is complete, so the process ends here.
await exit(0);
