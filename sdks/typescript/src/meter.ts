/**
 * The worker's and the producer's metrics through OpenTelemetry's API (SPEC 23; docs/src/tracing.md, "Metrics"): the
 * messaging conventions' instruments and Pelican's own, the same names, units and attributes in every library,
 * recorded where the stats are counted so that they agree with `worker.stats()` (and the Prometheus names of
 * `metrics.ts`). Without the API nothing is recorded; with it, nothing until the application installs an SDK's meter
 * provider, before it makes its workers and producers (their instruments are made with them).
 */
import type { Attributes, Counter, Histogram, UpDownCounter } from "@opentelemetry/api";

import { api, INSTRUMENTATION } from "./otel.js";

/** How a handler run ended, as the stats count it: `pelican.outcome` (the Prometheus `outcome` label). */
export type Ended = "done" | "terminal" | "failed" | "retried";

/** `messaging.process.duration`'s buckets, in seconds: the conventions' advice. */
const DURATION_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10];

/** A worker's instruments, with their attribute sets made once. */
export interface WorkerMeter {
  /** A message handed to a handler. */
  started(): void;
  /** Messages out of flight: settled, or left to the give-back on shutdown. */
  landed(count: number): void;
  /** A handler run that took `seconds`, counted as `ended`; `error` is what the handler threw, when it failed. */
  ended(ended: Ended, seconds: number, error?: unknown): void;
  /** Messages given back on shutdown. */
  abandoned(count: number): void;
}

const NOT_MEASURED: WorkerMeter = {
  started: () => undefined,
  landed: () => undefined,
  ended: () => undefined,
  abandoned: () => undefined,
};

export function workerMeter(stream: string, group: string): WorkerMeter {
  if (!api) return NOT_MEASURED;
  const meter = api.metrics.getMeter(INSTRUMENTATION);
  const consumed: Counter = meter.createCounter("messaging.client.consumed.messages", {
    unit: "{message}",
    description: "Messages delivered to the worker's handlers",
  });
  const duration: Histogram = meter.createHistogram("messaging.process.duration", {
    unit: "s",
    description: "Handler runs, by how they ended (pelican.outcome)",
    advice: { explicitBucketBoundaries: DURATION_BUCKETS },
  });
  const inFlight: UpDownCounter = meter.createUpDownCounter("pelican.worker.in_flight", {
    unit: "{message}",
    description: "Messages being handled by the worker now",
  });
  const abandoned: Counter = meter.createCounter("pelican.worker.abandoned", {
    unit: "{message}",
    description: "Messages given back unfinished on shutdown, their delivery not counted",
  });
  const names: Attributes = { "messaging.destination.name": stream, "messaging.consumer.group.name": group };
  const messaging = (operation: string): Attributes => ({
    "messaging.system": "redis",
    "messaging.operation.name": operation,
    "messaging.operation.type": operation,
    ...names,
  });
  const receive = messaging("receive");
  const process = messaging("process");
  const outcomes: Record<Ended, Attributes> = {
    done: { ...process, "pelican.outcome": "done" },
    terminal: { ...process, "pelican.outcome": "terminal" },
    failed: { ...process, "pelican.outcome": "failed" },
    retried: { ...process, "pelican.outcome": "retried" },
  };
  return {
    started() {
      consumed.add(1, receive);
      inFlight.add(1, names);
    },
    landed(count) {
      if (count > 0) inFlight.add(-count, names);
    },
    ended(ended, seconds, error) {
      const attributes = error === undefined ? outcomes[ended] : { ...outcomes[ended], "error.type": errorType(error) };
      duration.record(seconds, attributes);
    },
    abandoned(count) {
      if (count > 0) abandoned.add(count, names);
    },
  };
}

/** What a handler threw, as `error.type`: its class's name (`TypeError`), `_OTHER` for a value that is no object. */
function errorType(error: unknown): string {
  if (typeof error !== "object" || error === null) return "_OTHER";
  const name = (error.constructor as { name?: unknown } | undefined)?.name;
  return typeof name === "string" && name !== "" ? name : "_OTHER";
}

/** How a publish ended: written, or `error.type` (refused, unavailable, unknown, failed). */
export type Sent = "sent" | "refused" | "unavailable" | "unknown" | "failed";

/** A producer's instrument, with its attribute sets made once: `count` entries published, or not. */
export type ProducerMeter = (sent: Sent, count: number) => void;

export function producerMeter(stream: string): ProducerMeter {
  if (!api) return () => undefined;
  const counter: Counter = api.metrics.getMeter(INSTRUMENTATION).createCounter("messaging.client.sent.messages", {
    unit: "{message}",
    description: "Entries published, with error.type when not written (or not known to be)",
  });
  const written: Attributes = {
    "messaging.system": "redis",
    "messaging.destination.name": stream,
    "messaging.operation.name": "publish",
    "messaging.operation.type": "send",
  };
  const attributes: Record<Sent, Attributes> = {
    sent: written,
    refused: { ...written, "error.type": "refused" },
    unavailable: { ...written, "error.type": "unavailable" },
    unknown: { ...written, "error.type": "unknown" },
    failed: { ...written, "error.type": "failed" },
  };
  return (sent, count) => {
    if (count > 0) counter.add(count, attributes[sent]);
  };
}
