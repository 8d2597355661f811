/**
 * One partition of an `ordering: PerKey` topic (contract/README.md, "Order per key"): entries dispatched in id order
 * into per-key queues, at most one entry of a key in flight, different keys side by side up to the concurrency. A
 * failure or a retry holds its key: the entry stays pending, this worker's, and runs again in place after the
 * backoff, its delivery counted on the server first (`XCLAIM ... RETRYCOUNT`). At the cap it is left to the
 * operator's pass (`DeadLetterOnly` on such a topic), which dead-letters it once idle; the key goes on when the entry
 * left this consumer's pending list.
 */
import { setTimeout as sleep } from "node:timers/promises";

import { connect, errorText, type Connection, type RedisTarget } from "./connection.js";
import {
  ERROR_TEXT_MAX,
  KEY_FIELD,
  TOPIC_CONTRACT_VERSION,
  consumersKey,
  errorsKey,
  settingsKey,
  terminalKey,
} from "./keys.js";
import { Message } from "./message.js";
import { workerMeter, type Ended, type WorkerMeter } from "./meter.js";
import { checkOutcome, type Outcome } from "./outcome.js";
import { takeOver, type PartitionRunner } from "./partition.js";
import { withScripts, type ScriptCommands } from "./scripts.js";
import { leaseIntervalMs, parseSettings, type WorkerSettings } from "./settings.js";
import { processing } from "./trace.js";
import { chunks, cutUtf8, parseStreams, type Handler, type Logger, type WorkerStats } from "./worker.js";

/** How retries in place are spaced: the topic's `backoffFactor` and `backoffMaxMs` (0: no most). */
export interface Spacing {
  factor: number;
  maxMs: number;
}

/** `minIdleMs * factor^(deliveries-1)`, at most `maxMs` (and at most what a timer can wait). */
export function retryDelayMs(spacing: Spacing, minIdleMs: number, deliveries: number): number {
  const wait = minIdleMs * spacing.factor ** Math.max(0, deliveries - 1);
  return Math.min(spacing.maxMs > 0 ? Math.min(wait, spacing.maxMs) : wait, MAX_TIMER_MS);
}

export interface InOrderOptions {
  redis: RedisTarget;
  stream: string;
  group: string;
  consumer: string;
  concurrency: number;
  blockMs: number;
  shutdownGraceMs: number;
  logger: Logger;
  spacing: Spacing;
}

/** The settings a partition of a `PerKey` topic runs by; the operator writes them all. */
interface PartitionSettings extends WorkerSettings {
  minIdleMs: number;
  retryAfterMs: number;
  maxDeliveries: number;
}

/** An entry held by this worker: read, and not yet done, terminal or dead-lettered. */
interface Held {
  readonly message: Message;
  /** It failed (or asked for a retry) here: its next run counts a delivery first. */
  failed: boolean;
  /** At the cap: no longer leased, left to the pass. */
  capped: boolean;
}

/** A key's head being run. */
interface Run {
  readonly abort: AbortController;
  /** Lost, or cut by the shutdown grace: its outcome is not written. */
  abandoned: boolean;
  finished: Promise<void>;
}

/** The most entries held at once per unit of concurrency: read ahead so that keys behind a slow one still run. */
const HELD_PER_SLOT = 4;
/** The most ids one read, lease or give-back carries. */
const ID_BATCH = 100;
const MAX_TIMER_MS = 2 ** 31 - 1;
const READ_TIMEOUT_OVER_BLOCK_MS = 10_000;

export class InOrderPartition implements PartitionRunner {
  private readonly queues = new Map<string, Held[]>();
  /** Keys whose head may start, in the order they became ready. */
  private readonly ready: string[] = [];
  private readonly running = new Map<string, Run>();
  private readonly retryTimers = new Set<NodeJS.Timeout>();
  private readonly counters = { done: 0, terminal: 0, failed: 0, retried: 0, abandoned: 0 };
  /** The same counts through OpenTelemetry's API, recorded with them. */
  private readonly measure: WorkerMeter;
  private readonly stopping = new AbortController();
  private held = 0;
  private lost = false;
  private closed = false;
  private handler: Handler | undefined;
  private settings: PartitionSettings | undefined;
  private reader: Connection | undefined;
  private writer: (Connection & ScriptCommands) | undefined;
  private leaseTimer: NodeJS.Timeout | undefined;
  /** Wakes the read loop when room is made or the worker stops. */
  private wakeReader: (() => void) | undefined;

  constructor(private readonly options: InOrderOptions) {
    this.measure = workerMeter(options.stream, options.group);
  }

  /** Takes the partition's pending list over, then runs it in order per key until `stop()` or `lose()`. */
  async run(handler: Handler): Promise<WorkerStats> {
    const { redis, blockMs } = this.options;
    const reader = connect(redis, {
      commandTimeout: blockMs + READ_TIMEOUT_OVER_BLOCK_MS,
      autoResendUnfulfilledCommands: false,
      enableReadyCheck: false,
    });
    const writer = withScripts(connect(redis, { commandTimeout: 10_000, enableReadyCheck: false }));
    for (const [conn, role] of [
      [reader, "reader"],
      [writer, "writer"],
    ] as const) {
      let last = "";
      conn.on("error", (error: unknown) => {
        const text = errorText(error);
        if (text !== last) this.log("warn", `${role} connection: ${text}; reconnecting`);
        last = text;
      });
      conn.on("ready", () => (last = ""));
    }
    this.reader = reader;
    this.writer = writer;
    this.handler = handler;
    try {
      await takeOver(writer, this.options.stream, this.options.group, this.options.consumer);
      this.settings = await this.readSettings(writer);
      this.scheduleLease();
      await this.readLoop(reader);
      if (!this.lost) await this.finish();
    } finally {
      this.closed = true;
      clearTimeout(this.leaseTimer);
      for (const timer of this.retryTimers) clearTimeout(timer);
      reader.disconnect();
      if (this.lost) writer.disconnect();
      else await writer.quit().catch(() => writer.disconnect());
    }
    return { ...this.counters, inFlight: this.running.size };
  }

  stop(): void {
    if (this.stopping.signal.aborted) return;
    this.stopping.abort();
    this.wakeReader?.();
  }

  lose(): void {
    this.lost = true;
    for (const run of this.running.values()) {
      run.abandoned = true;
      run.abort.abort(new Error("the partition was lost: another member handles the message"));
    }
    this.stop();
    // Ends a blocking read at once.
    this.reader?.disconnect();
  }

  private get stopped(): boolean {
    return this.stopping.signal.aborted;
  }

  private async readSettings(writer: Connection): Promise<PartitionSettings> {
    const { stream, group } = this.options;
    const settings = parseSettings(await writer.hgetall(settingsKey(stream, group)), [TOPIC_CONTRACT_VERSION]);
    const { minIdleMs, maxDeliveries } = settings;
    if (minIdleMs === undefined || maxDeliveries === undefined) {
      throw new Error(`partition ${stream} has no settings of the topic's contract (minIdleMs, maxDeliveries)`);
    }
    return { ...settings, minIdleMs, maxDeliveries, retryAfterMs: settings.retryAfterMs ?? minIdleMs };
  }

  /** Reads while there is room: the own pending list first (what it took over), then new entries. */
  private async readLoop(reader: Connection): Promise<void> {
    const { stream, group, consumer, concurrency, blockMs } = this.options;
    const most = Math.max(1, concurrency) * HELD_PER_SLOT;
    let cursor: string | undefined = "0";
    while (!this.stopped) {
      const room = Math.min(most - this.held, ID_BATCH);
      if (room <= 0) {
        await new Promise<void>((resolve) => (this.wakeReader = resolve));
        continue;
      }
      const from = cursor ?? ">";
      const block = cursor === undefined ? ["BLOCK", blockMs] : [];
      let entries;
      try {
        const reply = await reader.callBuffer(
          "XREADGROUP",
          "GROUP",
          group,
          consumer,
          "COUNT",
          room,
          ...block,
          "STREAMS",
          stream,
          from,
        );
        entries = parseStreams(reply);
      } catch (error) {
        if (this.lost) return;
        this.log("warn", "read failed; retrying", { error: errorText(error) });
        await sleep(500, undefined, { signal: this.stopping.signal }).catch(() => undefined);
        continue;
      }
      if (cursor !== undefined) cursor = entries.at(-1)?.[0];
      // An entry whose payload was deleted is no message: the pass drops it.
      for (const [id, pairs] of entries) if (pairs) this.hold(new Message(id, pairs));
      this.pump();
    }
  }

  /** Queues `message` behind its key's earlier entries: its `pelican-key`, or the entry alone. */
  private hold(message: Message): void {
    const key = message.fieldBuffer(KEY_FIELD);
    const name = key ? `key:${key.toString("hex")}` : `id:${message.id}`;
    const queue = this.queues.get(name);
    this.held++;
    if (queue) queue.push({ message, failed: false, capped: false });
    else {
      this.queues.set(name, [{ message, failed: false, capped: false }]);
      this.ready.push(name);
    }
  }

  /** Starts the heads of ready keys while slots are free. */
  private pump(): void {
    while (!this.stopped && this.running.size < Math.max(1, this.options.concurrency)) {
      const key = this.ready.shift();
      if (key === undefined) return;
      const head = this.queues.get(key)?.[0];
      if (!head) continue;
      const run: Run = { abort: new AbortController(), abandoned: false, finished: Promise.resolve() };
      this.running.set(key, run);
      this.measure.started();
      run.finished = this.runHead(key, head, run)
        .catch((error: unknown) =>
          this.log("error", "a message's outcome was not written", { error: errorText(error) }),
        )
        .finally(() => {
          if (this.running.delete(key)) this.measure.landed(1);
          this.pump();
        });
    }
  }

  private async runHead(key: string, head: Held, run: Run): Promise<void> {
    const id = head.message.id;
    if (head.failed) {
      let counted: boolean;
      try {
        counted = await this.countDelivery(id);
      } catch (error) {
        this.log("warn", "could not count the delivery of a run in place; tried again after the backoff", {
          entryId: id,
          error: errorText(error),
        });
        if (!run.abandoned) this.retryLater(key, this.settingsNow().minIdleMs);
        return;
      }
      if (run.abandoned) return;
      // No longer this consumer's (the pass dead-lettered it, the partition moved): the key goes on.
      if (!counted) return this.next(key);
    }
    let outcome: Outcome | undefined;
    let failure: unknown;
    const startedAt = performance.now();
    try {
      const handler = this.handlerNow();
      const context = { signal: run.abort.signal };
      outcome = await processing(this.options, head.message, async () =>
        checkOutcome(await handler(head.message, context)),
      );
    } catch (error) {
      failure = error;
    }
    const seconds = (performance.now() - startedAt) / 1000;
    if (run.abandoned) return;
    if (outcome?.kind === "done") return this.ack(key, head, seconds);
    if (outcome?.kind === "terminal") return this.ackTerminal(key, head, outcome.reason, seconds);
    if (outcome?.kind === "retry") this.count("retried", seconds);
    else await this.recordFailure(id, failure, seconds);
    await this.again(key, head);
  }

  private async ack(key: string, head: Held, seconds: number): Promise<void> {
    const { stream, group } = this.options;
    const id = head.message.id;
    try {
      const pipeline = this.writerNow().pipeline().xack(stream, group, id);
      if (head.failed) pipeline.hdel(errorsKey(stream, group), id);
      const replies = (await pipeline.exec()) ?? [];
      const error = replies.find(([failed]) => failed)?.[0];
      if (error) throw error;
      this.count("done", seconds);
    } catch (error) {
      // The key goes on: the entry stays pending, and whoever takes the partition over runs it again.
      this.log("warn", "XACK failed; the message stays pending", { entryId: id, error: errorText(error) });
      this.count("failed", seconds);
    }
    this.next(key);
  }

  private async ackTerminal(key: string, head: Held, reason: string, seconds: number): Promise<void> {
    const { stream, group } = this.options;
    const id = head.message.id;
    this.log("warn", "message ended as terminal", { entryId: id, reason });
    try {
      await this.writerNow().pelicanTerminalAck(
        stream,
        terminalKey(stream, group),
        errorsKey(stream, group),
        group,
        id,
        reason,
      );
      this.count("terminal", seconds);
    } catch (error) {
      this.log("warn", "terminal ACK failed; the message stays pending", { entryId: id, error: errorText(error) });
      this.count("failed", seconds);
    }
    this.next(key);
  }

  /** A failure: its text recorded as the entry's last error. */
  private async recordFailure(id: string, failure: unknown, seconds: number): Promise<void> {
    const { stream, group } = this.options;
    const text = cutUtf8(errorText(failure), ERROR_TEXT_MAX);
    this.log("warn", "handler failed; run again in place after the backoff", { entryId: id, error: text });
    // A thrown `undefined` is a handler's error too (its `error.type` is `_OTHER`).
    this.count("failed", seconds, failure ?? null);
    try {
      await this.writerNow().hset(errorsKey(stream, group), id, text);
    } catch (error) {
      this.log("warn", "could not record the message's last error", { entryId: id, error: errorText(error) });
    }
  }

  /** After a failure or a retry: run again in place after the backoff, or at the cap leave it to the pass. */
  private async again(key: string, head: Held): Promise<void> {
    const id = head.message.id;
    head.failed = true;
    const { minIdleMs, maxDeliveries } = this.settingsNow();
    let deliveries: number | undefined;
    try {
      deliveries = await this.deliveriesOf(id);
    } catch (error) {
      this.log("warn", "could not read the delivery count; retried after the backoff", {
        entryId: id,
        error: errorText(error),
      });
      deliveries = 1;
    }
    if (deliveries === undefined) return this.next(key);
    if (deliveries >= maxDeliveries) {
      this.log("info", "at the cap: left to the pass, which dead-letters it; its key waits", {
        entryId: id,
        deliveries,
      });
      head.capped = true;
      return;
    }
    this.retryLater(key, retryDelayMs(this.options.spacing, minIdleMs, deliveries));
  }

  private retryLater(key: string, ms: number): void {
    const timer = setTimeout(() => {
      this.retryTimers.delete(timer);
      this.ready.push(key);
      this.pump();
    }, ms);
    this.retryTimers.add(timer);
  }

  /** The key's head left (done, terminal, gone from the pending list): its next entry may start. */
  private next(key: string): void {
    const queue = this.queues.get(key);
    queue?.shift();
    this.held--;
    if (queue && queue.length > 0) this.ready.push(key);
    else this.queues.delete(key);
    this.wakeReader?.();
  }

  private scheduleLease(): void {
    if (this.closed) return;
    this.leaseTimer = setTimeout(() => {
      void this.leaseTick().finally(() => this.scheduleLease());
    }, leaseIntervalMs(this.settings));
  }

  /**
   * Extends the leases of every entry held but those at the cap (the consumer's heartbeat too), and lets the keys
   * whose capped head left the pending list go on.
   */
  private async leaseTick(): Promise<void> {
    const { stream, group, consumer } = this.options;
    const leased = [...this.queues.values()]
      .flat()
      .filter((held) => !held.capped)
      .map((held) => held.message.id);
    try {
      for (const chunk of leased.length > 0 ? chunks(leased, ID_BATCH) : [[]]) {
        await this.writerNow().pelicanLease(stream, consumersKey(stream, group), group, consumer, ...chunk);
      }
      for (const [key, queue] of this.queues) {
        const head = queue[0];
        if (head?.capped && (await this.deliveriesOf(head.message.id)) === undefined) {
          this.next(key);
          this.pump();
        }
      }
    } catch (error) {
      if (!this.closed)
        this.log("warn", "could not extend the leases; retrying at the next tick", { error: errorText(error) });
    }
  }

  /**
   * After the read loop: runs in flight finish within the grace and their outcomes are written; everything else
   * held is given back uncounted, its key's order kept for the next owner (it takes the pending list in id order).
   */
  private async finish(): Promise<void> {
    const { stream, group, consumer, shutdownGraceMs } = this.options;
    let timer: NodeJS.Timeout | undefined;
    const graceOver = new Promise<boolean>((resolve) => (timer = setTimeout(() => resolve(true), shutdownGraceMs)));
    const allFinished = Promise.all([...this.running.values()].map((run) => run.finished)).then(() => false);
    if (await Promise.race([allFinished, graceOver])) {
      for (const run of this.running.values()) {
        run.abandoned = true;
        run.abort.abort(new Error("the shutdown grace ran out: the message was given back"));
      }
    }
    clearTimeout(timer);
    const left = [...this.queues.values()]
      .flat()
      .filter((held) => !held.capped)
      .map((held) => held.message.id);
    try {
      for (const chunk of left.length > 0 ? chunks(left, ID_BATCH) : [[]]) {
        const idle = this.settingsNow().retryAfterMs;
        const given = await this.writerNow().pelicanGiveBack(stream, group, consumer, idle, 1, ...chunk);
        this.counters.abandoned += Number(given);
        this.measure.abandoned(Number(given));
      }
    } catch (error) {
      this.log("warn", "could not give back what was left", { left: left.length, error: errorText(error) });
    }
    this.log("info", "partition stopped: the messages not finished were given back", {
      given: this.counters.abandoned,
    });
  }

  /** Counts a run that took `seconds` as `ended`, in the stats and their metrics (`handlerError`: thrown). */
  private count(ended: Ended, seconds: number, handlerError?: unknown): void {
    this.counters[ended]++;
    this.measure.ended(ended, seconds, handlerError);
  }

  /** The entry's delivery count while it is this consumer's; undefined once it is not. */
  private async deliveriesOf(id: string): Promise<number | undefined> {
    const { stream, group, consumer } = this.options;
    const reply = await this.writerNow().call("XPENDING", stream, group, id, id, 1, consumer);
    const row: unknown = Array.isArray(reply) ? reply[0] : undefined;
    return Array.isArray(row) ? Number(row[3]) : undefined;
  }

  /**
   * Counts the delivery of a run in place (`XCLAIM ... RETRYCOUNT n+1 JUSTID`, only while the entry is this
   * consumer's): false when it no longer is.
   */
  private async countDelivery(id: string): Promise<boolean> {
    const { stream, group, consumer } = this.options;
    const deliveries = await this.deliveriesOf(id);
    if (deliveries === undefined) return false;
    const claimed = await this.writerNow().call(
      "XCLAIM",
      stream,
      group,
      consumer,
      0,
      id,
      "RETRYCOUNT",
      deliveries + 1,
      "JUSTID",
    );
    return Array.isArray(claimed) && claimed.length > 0;
  }

  private log(level: keyof Logger, message: string, fields: Record<string, unknown> = {}): void {
    const { stream, group, consumer } = this.options;
    this.options.logger[level](message, { stream, group, consumer, ...fields });
  }

  private settingsNow(): PartitionSettings {
    if (!this.settings) throw new Error("the partition is not running");
    return this.settings;
  }

  private handlerNow(): Handler {
    if (!this.handler) throw new Error("the partition is not running");
    return this.handler;
  }

  private writerNow(): Connection & ScriptCommands {
    if (!this.writer) throw new Error("the partition is not running");
    return this.writer;
  }
}
