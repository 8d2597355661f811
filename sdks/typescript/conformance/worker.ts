/**
 * The conformance worker (contract/README.md, "The conformance worker"): configured by environment, its handler
 * obeys each message's `handle` (done | retry | fail | terminal:<Reason> | exit) after sleeping `ms`, and prints one
 * JSON line per handler run on stdout, and exits 4 (after its shutdown) when the operator speaks a contract version
 * this library does not know. Run from the repository root, once built:
 *
 *   REDIS_URL=redis://127.0.0.1:6379 STREAM=jobs GROUP=workers node sdks/typescript/dist/conformance/worker.js
 *
 * With `SENTINEL_MASTER=<name>`, `REDIS_URL` names a sentinel, and ioredis asks it for the primary monitored under
 * that name (`sentinels` and `name`), again whenever it reconnects.
 *
 * With `MODE=publish` it is a producer instead: it publishes `MESSAGES` messages idempotently (message ids `m-0`,
 * `m-1`, ...), each published again with the same id until it answers an entry id, one JSON line per attempt.
 */
import { writeSync } from "node:fs";
import { setTimeout as sleep } from "node:timers/promises";

import {
  Producer,
  PublishOutcomeUnknown,
  PublishUnavailable,
  ContractVersionError,
  Worker,
  done,
  retry,
  terminal,
  type Outcome,
  type RedisTarget,
} from "../src/index.js";

function required(name: string): string {
  const value = process.env[name];
  if (!value) {
    console.error(`conformance worker: ${name} is not set`);
    process.exit(2);
  }
  return value;
}

/** `REDIS_URL` as the library takes it: the URL itself, or the sentinel it names with `SENTINEL_MASTER`. */
function target(url: string): RedisTarget {
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
  process.exit(0);
}

const grace = process.env["SHUTDOWN_GRACE_MS"];
const worker = new Worker({
  redis: target(required("REDIS_URL")),
  stream: required("STREAM"),
  group: required("GROUP"),
  ...(process.env["CONSUMER"] ? { consumer: process.env["CONSUMER"] } : {}),
  ...(grace ? { shutdownGraceMs: Number(grace) } : {}),
});

/** One line per handler run, written synchronously: it is on stdout before an `exit` ends the process. */
function report(id: string, outcome: string, ms: number): void {
  writeSync(1, JSON.stringify({ id, consumer: worker.consumer, outcome, ms }) + "\n");
}

worker.installSignalHandlers();
try {
  await worker.run(async (message): Promise<Outcome> => {
    const handle = message.field("handle") ?? "done";
    const ms = Number(message.field("ms") ?? 0) || 0;
    if (handle === "exit") {
      report(message.id, "exit", ms);
      process.exit(3);
    }
    await sleep(ms);
    if (handle.startsWith("terminal:")) {
      report(message.id, "terminal", ms);
      return terminal(handle.slice("terminal:".length));
    }
    if (handle === "done" || handle === "retry") {
      report(message.id, handle, ms);
      return handle === "done" ? done() : retry();
    }
    report(message.id, "fail", ms);
    throw new Error(handle === "fail" ? "the message asked to fail" : `unknown handle ${JSON.stringify(handle)}`);
  });
} catch (error) {
  // The worker logged the version error itself.
  if (error instanceof ContractVersionError) process.exit(4);
  console.error(`conformance worker: ${String(error)}`);
  process.exit(1);
}
// Handlers the grace cut off may still hold timers: the shutdown is complete, so the process ends here.
process.exit(0);
