/**
 * The conformance worker (contract/README.md, "The conformance worker"): configured by environment, its handler
 * obeys each message's `handle` (done | retry | fail | terminal:<Reason> | exit) after sleeping `ms`, and prints one
 * JSON line per handler run on stdout. Run from the repository root, once built:
 *
 *   REDIS_URL=redis://127.0.0.1:6379 STREAM=jobs GROUP=workers node sdks/typescript/dist/conformance/worker.js
 */
import { writeSync } from "node:fs";
import { setTimeout as sleep } from "node:timers/promises";

import { Worker, done, retry, terminal, type Outcome } from "../src/index.js";

function required(name: string): string {
  const value = process.env[name];
  if (!value) {
    console.error(`conformance worker: ${name} is not set`);
    process.exit(2);
  }
  return value;
}

const grace = process.env["SHUTDOWN_GRACE_MS"];
const worker = new Worker({
  redis: required("REDIS_URL"),
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
  console.error(`conformance worker: ${String(error)}`);
  process.exit(1);
}
// Handlers the grace cut off may still hold timers: the shutdown is complete, so the process ends here.
process.exit(0);
