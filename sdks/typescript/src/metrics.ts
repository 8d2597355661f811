/**
 * The worker's stats as prom-client metrics, without depending on prom-client: pass the module you use
 * (`import * as client from "prom-client"`), and the metrics are read from `worker.stats()` at each scrape.
 *
 *   pelican_worker_messages_total{stream, group, outcome}   done | terminal | failed | retried | abandoned
 *   pelican_worker_in_flight{stream, group}
 */
import type { Worker, WorkerStats } from "./worker.js";

type Labels = Record<"stream" | "group", string>;

/** The parts of prom-client this adapter uses. */
export interface PromClient {
  Counter: new (config: {
    name: string;
    help: string;
    labelNames: readonly string[];
    registers?: never[];
    collect: (this: { inc(labels: Labels & { outcome: string }, value: number): void }) => void;
  }) => unknown;
  Gauge: new (config: {
    name: string;
    help: string;
    labelNames: readonly string[];
    registers?: never[];
    collect: (this: { set(labels: Labels, value: number): void }) => void;
  }) => unknown;
}

const OUTCOMES = ["done", "terminal", "failed", "retried", "abandoned"] as const;

/**
 * Registers the metrics of `workers` (all of the process's, at once: a metric name is registered once) in
 * `registry`, or in prom-client's default registry.
 */
export function registerWorkerMetrics(
  client: PromClient,
  workers: readonly Worker[],
  options: { registry?: unknown } = {},
): void {
  const registers = options.registry === undefined ? {} : { registers: [options.registry as never] };
  // What each counter showed at the last scrape: a counter only goes up, by the difference.
  const shown = new Map<Worker, Pick<WorkerStats, (typeof OUTCOMES)[number]>>();
  new client.Counter({
    name: "pelican_worker_messages_total",
    help: "Messages handled by the worker, by outcome (abandoned: given back on shutdown)",
    labelNames: ["stream", "group", "outcome"],
    ...registers,
    collect() {
      for (const worker of workers) {
        const stats = worker.stats();
        const before = shown.get(worker);
        for (const outcome of OUTCOMES) {
          this.inc({ stream: worker.stream, group: worker.group, outcome }, stats[outcome] - (before?.[outcome] ?? 0));
        }
        shown.set(worker, stats);
      }
    },
  });
  new client.Gauge({
    name: "pelican_worker_in_flight",
    help: "Messages being handled by the worker now",
    labelNames: ["stream", "group"],
    ...registers,
    collect() {
      for (const worker of workers) this.set({ stream: worker.stream, group: worker.group }, worker.stats().inFlight);
    },
  });
}
