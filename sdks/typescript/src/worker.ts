/**
 * The worker: the dispatch layer of an application consumer (contract/README.md, "The worker's loop"). It reads
 * its own PEL first, then new entries, runs at most `concurrency` handlers; at every lease tick it holds a lease on
 * every entry in flight (the same call is its heartbeat) and takes up hand-overs; it gives back on shutdown, and is
 * the only place that acknowledges.
 */
import { setTimeout as sleep } from "node:timers/promises";
import type { ChainableCommander } from "ioredis";

import { connect, errorText, isReplyError, podName, type Connection, type RedisTarget } from "./connection.js";
import { DELIVERIES_FIELD, ERROR_TEXT_MAX, consumersKey, errorsKey, settingsKey, terminalKey } from "./keys.js";
import { Message } from "./message.js";
import { workerMeter, type Ended, type WorkerMeter } from "./meter.js";
import { checkOutcome, type Outcome } from "./outcome.js";
import { withScripts, type ScriptCommands } from "./scripts.js";
import { processing } from "./trace.js";
import {
  ContractVersionError,
  KNOWN_CONTRACT_VERSIONS,
  UNPUBLISHED_IDLE_MS,
  leaseIntervalMs,
  parseSettings,
  type WorkerSettings,
} from "./settings.js";

export interface WorkerOptions {
  /** A `redis://` URL or ioredis options; the worker opens two connections of its own (reads, writes). */
  redis: RedisTarget;
  stream: string;
  group: string;
  /** Default: the Pod's name (`POD_NAME`, else `HOSTNAME`), else the host name; `consumers.pods` matches by it. */
  consumer?: string;
  /** Handlers running at once. Default 16. */
  concurrency?: number;
  /**
   * How long one read waits for new entries, in whole milliseconds: at least 1 (`BLOCK 0` waits for ever on the
   * server); the reader's own timeout is 10 s above it. Default 1,000 ms.
   */
  blockMs?: number;
  /** On shutdown, how long handlers may still run before their messages are given back. Default 20,000 ms. */
  shutdownGraceMs?: number;
  /** How long a message's lease is extended; past it the pass may retry the message. Default 30 minutes. */
  maxHandlingMs?: number;
  /** Where the worker's log lines go. Default: one line per event on stderr (stdout stays the application's). */
  logger?: Logger;
}

/** One call per event; `fields` are the event's details (stream, group, consumer, entryId, error, ...). */
export interface Logger {
  info(message: string, fields?: Record<string, unknown>): void;
  warn(message: string, fields?: Record<string, unknown>): void;
  error(message: string, fields?: Record<string, unknown>): void;
}

export interface HandlerContext {
  /**
   * Aborted when the shutdown grace ran out and the message was given back to the operator's pass: stop the
   * work; nothing the handler returns after that is written.
   */
  readonly signal: AbortSignal;
}

/**
 * Resolves to the message's outcome. Whatever it throws or rejects with (an `Error` or any other value, whose text
 * is then `String(value)`) is a failure: no ACK, the error recorded, the worker goes on.
 */
export type Handler = (message: Message, context: HandlerContext) => Promise<Outcome>;

export interface RunOptions {
  /** Stops the worker (as `stop()` does) when aborted. */
  signal?: AbortSignal;
}

export interface WorkerStats {
  done: number;
  terminal: number;
  /** Handler errors, and outcomes the server refused to record: left pending for the operator's retry. */
  failed: number;
  /** `retry()`: given back to the operator's pass, the delivery counted. */
  retried: number;
  /** Given back on shutdown, the delivery not counted. */
  abandoned: number;
  inFlight: number;
}

/** The most ids one lease or give-back call carries. */
const ID_BATCH = 100;
/** How many ids of recorded errors are remembered, to remove each with its message's ACK. */
const ERRORS_REMEMBERED = 10_000;
/** How much shorter than the time since it failed here an entry's idle must be for it to count as handed back. */
const HAND_OVER_MARGIN_MS = 1000;
/** How much longer than `blockMs` the reader waits for a blocking read's reply. */
const READ_TIMEOUT_OVER_BLOCK_MS = 10_000;

/** The longest a read waits for the slots of handlers whose outcomes are being written. */
const SETTLE_WAIT_MS = 5;

/** A requeued copy's field: the entry may have a last error. */
const DELIVERIES = Buffer.from(DELIVERIES_FIELD);

/** Why a handler's signal is aborted. */
const GIVEN_BACK = "the shutdown grace ran out: the message was given back";
const LOST = "the partition was lost: another member handles the message";

/** A `done` outcome waiting for the acknowledger's next XACK. */
interface PendingAck {
  readonly id: string;
  /** The entry may have a last error: its field is removed with the ACK. */
  readonly clearError: boolean;
  readonly written: (error: unknown) => void;
}

/** An entry being handled. */
interface InFlight {
  readonly startedAt: number;
  /** Made when the handler first reads its `signal` (most never do, and one costs more than the rest of a start). */
  abort: AbortController | undefined;
  /** Resolves when its outcome is written (or skipped). */
  finished: Promise<void>;
  /** The handler has returned: its outcome is being written. */
  settled: boolean;
  /** Its `done` outcome waits for its XACK: its slot is free. */
  acking: boolean;
  /** Given back on shutdown: its outcome is not written. */
  abandoned: boolean;
  /** Past `maxHandlingMs`: no longer leased (said once). */
  overdue: boolean;
}

/** A handler's context, a class rather than an object literal with a getter: one allocation a message, not three. */
class EntryContext implements HandlerContext {
  constructor(private readonly entry: InFlight) {}

  get signal(): AbortSignal {
    const entry = this.entry;
    if (!entry.abort) {
      entry.abort = new AbortController();
      if (entry.abandoned) entry.abort.abort(new Error(GIVEN_BACK));
    }
    return entry.abort.signal;
  }
}

/**
 * One line: the level, the message, then each field as `key=value`, the value quoted as JSON when it is empty or
 * holds a space, a quote, an `=` or a line break (a failure's text may hold any of them).
 */
export function logLine(level: string, message: string, fields: Record<string, unknown> = {}): string {
  const parts = Object.entries(fields).map(([key, value]) => {
    const text = typeof value === "string" ? value : (JSON.stringify(value) ?? String(value));
    return `${key}=${/^[^\s"=]+$/.test(text) ? text : JSON.stringify(text)}`;
  });
  return [`pelican worker ${level}: ${message}`, ...parts].join(" ");
}

export const stderrLogger: Logger = {
  info: (message, fields) => process.stderr.write(`${logLine("INFO", message, fields)}\n`),
  warn: (message, fields) => process.stderr.write(`${logLine("WARN", message, fields)}\n`),
  error: (message, fields) => process.stderr.write(`${logLine("ERROR", message, fields)}\n`),
};

export class Worker {
  readonly stream: string;
  readonly group: string;
  readonly consumer: string;
  private readonly target: RedisTarget;
  private readonly concurrency: number;
  private readonly blockMs: number;
  private readonly shutdownGraceMs: number;
  private readonly maxHandlingMs: number;
  private readonly log: Logger;

  private readonly counters = { done: 0, terminal: 0, failed: 0, retried: 0, abandoned: 0 };
  /** The same counts through OpenTelemetry's API, recorded with them. */
  private readonly measure: WorkerMeter;
  private readonly inFlight = new Map<string, InFlight>();
  /**
   * Entries delivered to this consumer that wait for a free slot (a read and a hand-over came back together):
   * leased meanwhile, given back on shutdown.
   */
  private readonly queued = new Map<string, Message>();
  /** The own PEL was read to its end (entries delivered to this name before a restart): hand-overs from now on. */
  private ownPelRead = false;
  /**
   * When the read on its way was sent (none once what it brought is in flight or queued): an entry delivered since
   * is in the own PEL before its reply is here, and may be that read's, not a hand-over.
   */
  private readSentAt: number | undefined;
  private handler: Handler | undefined;
  /** An unknown contract version met at a lease tick: the worker shuts down, then `run` rejects with it. */
  private fatal: ContractVersionError | undefined;
  /** Entries whose handler failed (or asked for a retry) here, with when: the pass retries them, never this worker. */
  private readonly failedHere = new Map<string, number>();
  /** Entries whose last error this worker recorded: the field goes with their ACK. */
  private readonly errorsRecorded = new Set<string>();
  private settings: WorkerSettings | undefined;
  /** Aborted by `stop()`: ends the pauses of the read loop at once. */
  private readonly stopping = new AbortController();
  private running: Promise<WorkerStats> | undefined;
  private reader: Connection | undefined;
  private writer: (Connection & ScriptCommands) | undefined;
  private leaseTimer: NodeJS.Timeout | undefined;
  /**
   * The lease tick under way, from gathering its ids to the end of its hand-over check; a retry's give-back waits
   * for it. The writer keeps the order of what it sends, but ioredis sends a script again as `EVAL` once its
   * `EVALSHA` is refused with `NOSCRIPT` (the script cache emptied): a lease that gathered the entry would then run
   * after the give-back, undo the idle time it set, and the own PEL's check would take the entry for a hand-over.
   */
  private leasing: Promise<void> | undefined;
  /** `done` outcomes of handlers that finished together: acknowledged in one XACK (see `ack`). */
  private pendingAcks: PendingAck[] = [];
  /**
   * The read loop reads again soon, without blocking: that read carries the XACK of what waits in `pendingAcks`
   * (one round trip for the acknowledgements and the read, as in a hand-written loop). Else the writer writes them.
   */
  private acksCarried = false;
  /** A write of `pendingAcks` on the writer is due at the next turn of the event loop. */
  private ackWriteDue = false;
  /** Entries in flight whose slots are free: their `done` outcomes wait for the XACK. */
  private acking = 0;
  /** Wakes the read loop when a handler finishes or the worker stops. */
  private wake: (() => void) | undefined;
  /** Said once each: a settings read refused, a settings read failed. */
  private readonly said = new Set<string>();
  /** The connections are closing: no lease is scheduled any more. */
  private closed = false;
  /** Stopped by `lose()`: nothing more is written, nothing given back. */
  private lost = false;

  constructor(options: WorkerOptions) {
    this.target = options.redis;
    this.stream = options.stream;
    this.group = options.group;
    this.consumer = options.consumer || podName();
    this.concurrency = Math.max(1, options.concurrency ?? 16);
    this.blockMs = options.blockMs ?? 1000;
    if (!Number.isInteger(this.blockMs) || this.blockMs < 1) {
      throw new RangeError(
        `blockMs must be a whole number of milliseconds, at least 1 (BLOCK 0 waits for ever on the server); ` +
          `got ${this.blockMs}`,
      );
    }
    this.shutdownGraceMs = options.shutdownGraceMs ?? 20_000;
    this.maxHandlingMs = options.maxHandlingMs ?? 30 * 60 * 1000;
    this.log = options.logger ?? stderrLogger;
    this.measure = workerMeter(this.stream, this.group);
  }

  /**
   * Runs until `stop()` (or `signal`): then stops reading, lets handlers finish within the grace, gives back what
   * is left, closes its connections and resolves with the stats. Rejects with a `ContractVersionError` when the
   * operator speaks a contract version this library does not know: before reading anything when it is there at
   * the start, after a graceful shutdown (as on `stop()`) when a lease tick meets it. Read errors do not stop the
   * worker: they are logged and retried.
   */
  run(handler: Handler, options: RunOptions = {}): Promise<WorkerStats> {
    if (this.running) throw new Error("this worker already ran: create a new Worker");
    const { signal } = options;
    const onAbort = (): void => void this.stop();
    signal?.addEventListener("abort", onAbort, { once: true });
    if (signal?.aborted) this.stopping.abort();
    this.running = this.runUntilStopped(handler).finally(() => signal?.removeEventListener("abort", onAbort));
    return this.running;
  }

  /** Asks the worker to shut down; resolves (or rejects) as `run()` does, once the shutdown is complete. */
  stop(): Promise<WorkerStats> {
    this.requestStop();
    return this.running ?? Promise.resolve(this.stats());
  }

  private requestStop(): void {
    if (!this.stopping.signal.aborted) {
      this.stopping.abort();
      this.wake?.();
    }
  }

  /**
   * Stops the worker on the first of `signals` (a second one ends the process as usual). Returns a function that
   * removes the handlers.
   */
  installSignalHandlers(signals: readonly NodeJS.Signals[] = ["SIGTERM", "SIGINT"]): () => void {
    const onSignal = (): void => void this.stop();
    for (const signal of signals) process.once(signal, onSignal);
    return () => signals.forEach((signal) => process.off(signal, onSignal));
  }

  stats(): WorkerStats {
    return { ...this.counters, inFlight: this.inFlight.size };
  }

  private get stopRequested(): boolean {
    return this.stopping.signal.aborted;
  }

  private async runUntilStopped(handler: Handler): Promise<WorkerStats> {
    // No ready check: it needs INFO, which the worker's ACL (examples/acl/worker.acl) does not grant; a LOADING
    // server's refusals are retried like any other.
    // The reader's timeout covers a blocking read. A read cut by a lost connection is not resent: the loop
    // decides what to read next (entries whose reply was lost are in the own PEL, taken up as hand-overs).
    const reader = connect(this.target, {
      commandTimeout: this.blockMs + READ_TIMEOUT_OVER_BLOCK_MS,
      autoResendUnfulfilledCommands: false,
      enableReadyCheck: false,
    });
    // Every write the worker makes can be repeated without harm (XACK, HSET, the scripts check the owner), so the
    // writer keeps ioredis' resends after a reconnect.
    const writer = withScripts(connect(this.target, { commandTimeout: 10_000, enableReadyCheck: false }));
    this.reader = reader;
    this.writer = writer;
    this.logConnectionErrors(reader, "reader");
    this.logConnectionErrors(writer, "writer");
    this.handler = handler;
    try {
      if (await this.startUp()) {
        await this.beforeFirstRead(writer);
        this.scheduleLease();
        await this.readLoop(handler);
        if (this.lost) this.dropInFlight();
        else await this.finishInFlight();
      }
    } finally {
      this.closed = true;
      clearTimeout(this.leaseTimer);
      reader.disconnect();
      if (this.lost) writer.disconnect();
      else await writer.quit().catch(() => writer.disconnect());
    }
    if (this.fatal) throw this.fatal;
    return this.stats();
  }

  private logConnectionErrors(conn: Connection, role: string): void {
    let last = "";
    conn.on("error", (error: unknown) => {
      const text = errorText(error);
      if (text !== last) this.log.warn(`${role} connection: ${text}; reconnecting`, this.where());
      last = text;
    });
    conn.on("ready", () => (last = ""));
  }

  /** The contract versions this worker speaks: the library's, or 2 on a topic's partition. */
  protected speaks(): readonly number[] {
    return KNOWN_CONTRACT_VERSIONS;
  }

  /** What a worker does once connected, before it reads its own PEL: nothing here (a partition takes it over). */
  protected async beforeFirstRead(_writer: Connection): Promise<void> {}

  /**
   * Stops at once, as a partition that went to another member must: no handler starts, no outcome is written,
   * nothing is given back (the new owner takes the pending list over); handlers running see their signal aborted.
   * `run` then resolves with the stats so far.
   */
  protected lose(): void {
    this.lost = true;
    this.requestStop();
    // Ends a blocking read at once.
    this.reader?.disconnect();
  }

  private dropInFlight(): void {
    for (const entry of this.inFlight.values()) {
      entry.abandoned = true;
      entry.abort?.abort(new Error(LOST));
    }
    this.log.warn("stopped at once: the messages in flight and queued are the new owner's", {
      ...this.where(),
      dropped: this.inFlight.size + this.queued.size,
    });
    this.measure.landed(this.inFlight.size);
    this.inFlight.clear();
    this.acking = 0;
    this.queued.clear();
  }

  /** Reads the settings and checks the contract version before the first read; false when stopped meanwhile. */
  private async startUp(): Promise<boolean> {
    let wait = 1000;
    while (!this.stopRequested) {
      try {
        await this.readSettings();
        return true;
      } catch (error) {
        if (error instanceof ContractVersionError) {
          this.log.error(error.message, this.where());
          throw error;
        }
        this.log.warn("could not read the group's settings; retrying", { ...this.where(), error: errorText(error) });
        await this.pause(wait);
        wait = Math.min(wait * 2, 10_000);
      }
    }
    return false;
  }

  /**
   * Reads the group's settings. A refusal (an ACL without `hgetall` on the key) leaves the worker without them:
   * it leases every second. An unknown contract version throws a `ContractVersionError`.
   */
  private async readSettings(): Promise<void> {
    let hash: Record<string, string>;
    try {
      hash = await this.writerConn().hgetall(settingsKey(this.stream, this.group));
    } catch (error) {
      if (!isReplyError(error)) throw error;
      this.sayOnce("settings refused", "the group's settings cannot be read: leasing every second", error);
      return;
    }
    this.settings = parseSettings(hash, this.speaks());
  }

  private sayOnce(key: string, message: string, error: unknown): void {
    if (this.said.has(key)) return;
    this.said.add(key);
    this.log.warn(message, { ...this.where(), error: errorText(error) });
  }

  private async readLoop(handler: Handler): Promise<void> {
    // Our own PEL first (entries delivered to this name before a restart), then new entries.
    let cursor: string | undefined = "0";
    let waitingForGroup = false;
    let groupWait = 1000;
    while (!this.stopRequested) {
      // The acknowledgements of the handlers that free slots wait for the next read, which comes soon.
      this.acksCarried = true;
      await this.freeSlot();
      // The handlers that can go on now run first (those a read just started mostly end at once), so that their
      // slots are counted: else a read would fetch only for the slots the last one left free. With every slot free
      // the read goes at once: the sooner it follows the last reply, the less the server has gone to sleep.
      if (this.busy() > 0) await new Promise<void>((resolve) => setImmediate(resolve));
      await this.settle();
      if (this.stopRequested) break;
      for (const [id, message] of this.queued) {
        if (this.busy() >= this.concurrency) break;
        this.queued.delete(id);
        this.start(message, handler);
      }
      const free = this.concurrency - this.busy() - this.queued.size;
      if (free <= 0) {
        // Queued entries took the slots: no read comes until one frees, and the acknowledgements do not wait for it.
        this.releaseAcks();
        continue;
      }
      let messages: Message[];
      this.readSentAt = Date.now();
      try {
        if (cursor !== undefined) {
          const read = await this.read(free, cursor);
          cursor = read.last;
          messages = read.messages;
          this.ownPelRead = cursor === undefined;
        } else {
          messages = (await this.read(free, ">")).messages;
        }
      } catch (error) {
        this.readSentAt = undefined;
        this.releaseAcks();
        if (this.lost) break;
        if (isReplyError(error) && error.message.startsWith("NOGROUP")) {
          // The group is the operator's to create: wait for it, never create it.
          if (!waitingForGroup) {
            this.log.warn("the consumer group does not exist yet: waiting for the operator to create it", {
              ...this.where(),
              error: error.message,
            });
          }
          waitingForGroup = true;
          await this.pause(groupWait);
          groupWait = Math.min(groupWait * 2, 10_000);
        } else {
          this.log.warn("read failed; retrying", { ...this.where(), error: errorText(error) });
          await this.pause(500);
        }
        continue;
      }
      if (waitingForGroup) this.log.warn("the consumer group exists now: reading", this.where());
      waitingForGroup = false;
      groupWait = 1000;
      // Delivered by a read in flight when the stop came (awaited: the server delivers to this consumer whatever
      // becomes of the call) are queued, never started, and given back on shutdown.
      this.handOut(messages, handler);
      this.readSentAt = undefined;
    }
    this.releaseAcks();
  }

  /** Slots taken: handlers running, and outcomes other than `done` being written. */
  private busy(): number {
    return this.inFlight.size - this.acking;
  }

  /** Starts a handler for each message while slots are free (and the worker runs), and queues the rest. */
  private handOut(messages: readonly Message[], handler: Handler): void {
    for (const message of messages) {
      // A hand-over and a read that brought the same entry: handled once.
      if (this.inFlight.has(message.id) || this.queued.has(message.id)) continue;
      if (this.busy() < this.concurrency && !this.stopRequested) this.start(message, handler);
      else this.queued.set(message.id, message);
    }
  }

  private async freeSlot(): Promise<void> {
    while (this.busy() >= this.concurrency && !this.stopRequested) {
      await new Promise<void>((resolve) => (this.wake = resolve));
    }
  }

  /**
   * Handlers whose outcomes other than `done` are being written free their slots once the writes are answered:
   * wait a little for them, so that one read fetches for them all rather than a read for each few.
   */
  private async settle(): Promise<void> {
    const settledBy = Date.now() + SETTLE_WAIT_MS;
    while (!this.stopRequested && this.busy() > 0 && Date.now() < settledBy) {
      if (!this.anySettling()) return;
      let timer: NodeJS.Timeout | undefined;
      await new Promise<void>((resolve) => {
        this.wake = resolve;
        timer = setTimeout(resolve, settledBy - Date.now());
      });
      clearTimeout(timer);
    }
  }

  private anySettling(): boolean {
    for (const entry of this.inFlight.values()) if (entry.settled && !entry.acking) return true;
    return false;
  }

  /** A pause that `stop()` ends early. */
  private async pause(ms: number): Promise<void> {
    await sleep(ms, undefined, { signal: this.stopping.signal }).catch(() => undefined);
  }

  /**
   * A read (see `readEntries`) that carries the XACK of the `done` outcomes waiting, in one round trip: sent before
   * a read that does not block (an XACK never waits behind a blocking read), the blocking read following when that
   * one brought nothing. Without acknowledgements to carry, a read of new entries blocks at once, and the writer
   * sends what the handlers finish meanwhile. An XACK whose connection failed is sent again by the writer.
   */
  private async read(count: number, from: string): Promise<{ messages: Message[]; last: string | undefined }> {
    const carried = this.pendingAcks;
    if (carried.length === 0) {
      if (from === ">") this.releaseAcks();
      return this.readEntries(count, from, from === ">");
    }
    this.pendingAcks = [];
    const pipeline = this.ackCommands(this.readerConn().pipeline(), carried);
    let replies: Array<[error: Error | null, result: unknown]>;
    try {
      replies = (await pipeline.callBuffer(...this.readArgs(count, from, false)).exec()) ?? [];
    } catch (error) {
      this.carriedFailed(carried, error);
      throw error;
    }
    const [acked, read] = [replies[0], replies.at(-1)];
    if (!acked || !read) {
      const error = new Error("a pipeline of an XACK and a read answered otherwise");
      this.carriedFailed(carried, error);
      throw error;
    }
    if (acked[0]) this.carriedFailed(carried, acked[0]);
    else for (const pending of carried) pending.written(undefined);
    if (read[0]) throw read[0];
    const entries = parseStreams(read[1]);
    if (entries.length === 0 && from === ">") {
      this.releaseAcks();
      return this.readEntries(count, from, true);
    }
    return messagesOf(entries);
  }

  /** The carried XACK failed: refused (nothing written), or its connection failed (the writer sends it again). */
  private carriedFailed(carried: PendingAck[], error: unknown): void {
    if (isReplyError(error)) {
      for (const pending of carried) pending.written(error);
      return;
    }
    this.pendingAcks.push(...carried);
    this.writeAcksSoon();
  }

  /**
   * `XREADGROUP` of up to `count` entries after `from`: `0` and on reads the own PEL (`last`: where to go on, none
   * once it is empty), `>` new entries, `blocking` up to `blockMs`. An own entry without fields (its payload was
   * deleted) is no message: skipped, the pass drops it.
   */
  private async readEntries(
    count: number,
    from: string,
    blocking: boolean,
  ): Promise<{ messages: Message[]; last: string | undefined }> {
    return messagesOf(parseStreams(await this.readerConn().callBuffer(...this.readArgs(count, from, blocking))));
  }

  /** `readEntries`' command and its arguments. */
  private readArgs(count: number, from: string, blocking: boolean): [string, ...Array<string | number>] {
    const block = blocking ? ["BLOCK", this.blockMs] : [];
    return ["XREADGROUP", "GROUP", this.group, this.consumer, "COUNT", count, ...block, "STREAMS", this.stream, from];
  }

  /**
   * Takes up as many hand-overs as slots are free and starts their handlers; the rest at the next tick. Not before
   * the own PEL was read to its end (that read brings them) nor after the stop.
   */
  private async takeUp(): Promise<void> {
    const free = this.concurrency - this.busy() - this.queued.size;
    if (free <= 0 || !this.ownPelRead || this.stopRequested || !this.handler) return;
    try {
      this.handOut(await this.takeHandedOver(free), this.handler);
    } catch (error) {
      this.log.warn("could not take up hand-overs; retrying at the next tick", {
        ...this.where(),
        error: errorText(error),
      });
    }
  }

  /**
   * Up to `count` entries of the own PEL (its first 100) that are neither in flight nor failed here nor perhaps
   * delivered by the read on its way: handed over by the operator (`strategy: Reassign`). An entry that failed
   * here counts as handed back only when its idle time is shorter than the time since it failed (less a second): a
   * hand-over reset it. Each is taken with `lease.lua` (never a plain XCLAIM, which would take back what the pass
   * gave someone else meanwhile) and read with `XRANGE`.
   */
  private async takeHandedOver(count: number): Promise<Message[]> {
    const writer = this.writerConn();
    // Taken before the server measures idle times: an entry untouched since it failed has been idle this long.
    const askedAt = Date.now();
    const pending = parsePending(
      await writer.call("XPENDING", this.stream, this.group, "-", "+", ID_BATCH, this.consumer),
    );
    if (pending.length < ID_BATCH) {
      // The whole own PEL: what failed here and left it (requeued, reassigned, dead-lettered) is forgotten.
      const listed = new Set(pending.map(({ id }) => id));
      for (const id of this.failedHere.keys()) if (!listed.has(id)) this.failedHere.delete(id);
    }
    const handedBack = (id: string, idleMs: number): boolean => {
      const failedAt = this.failedHere.get(id);
      return failedAt === undefined || idleMs + HAND_OVER_MARGIN_MS <= askedAt - failedAt;
    };
    // Taken after the reply: an entry the read on its way delivered has been idle at most this long (give or take
    // the server's whole milliseconds), delivered once. Taking it would run it twice: here, and when the read's
    // reply is handed out (or after its ACK, which XRANGE does not see). A hand-over raises the count (Reassign's
    // RETRYCOUNT) and is taken at once; one whose count a shutdown's give-back had lowered to 0, like an entry whose
    // read's reply was lost, is taken once it is older than the read on its way.
    const sinceReadMs = this.readSentAt === undefined ? -Infinity : Date.now() - this.readSentAt + 1;
    const perhapsRead = (idleMs: number, deliveries: number): boolean => deliveries === 1 && idleMs <= sinceReadMs;
    const candidates = pending
      .filter(
        ({ id, idleMs, deliveries }) =>
          !this.inFlight.has(id) && !this.queued.has(id) && !perhapsRead(idleMs, deliveries) && handedBack(id, idleMs),
      )
      .slice(0, count)
      .map(({ id }) => id);
    if (candidates.length === 0) return [];
    for (const id of candidates) this.failedHere.delete(id);
    const taken: string[] = [];
    for (const chunk of chunks(candidates, ID_BATCH)) {
      taken.push(...parseIds(await this.lease(chunk)));
    }
    if (taken.length === 0) return [];
    const pipeline = writer.pipeline();
    for (const id of taken) pipeline.xrangeBuffer(this.stream, id, id);
    const ranges = (await pipeline.exec()) ?? [];
    // An entry deleted from the stream while pending has no payload to handle: the pass drops it.
    return ranges.flatMap(([error, reply]) => {
      if (error) throw error;
      return messagesOf(parseEntries(reply)).messages;
    });
  }

  private start(message: Message, handler: Handler): void {
    const entry: InFlight = {
      startedAt: Date.now(),
      abort: undefined,
      finished: Promise.resolve(),
      settled: false,
      acking: false,
      abandoned: false,
      overdue: false,
    };
    this.inFlight.set(message.id, entry);
    this.measure.started();
    entry.finished = this.dispatch(message, handler, entry);
  }

  /** Runs the handler and writes its outcome (the only place that acknowledges), then frees its slot. Never rejects. */
  private async dispatch(message: Message, handler: Handler, entry: InFlight): Promise<void> {
    try {
      await this.handle(message, handler, entry);
    } finally {
      if (this.inFlight.delete(message.id)) {
        if (entry.acking) this.acking--;
        this.measure.landed(1);
      }
      this.wake?.();
    }
  }

  private async handle(message: Message, handler: Handler, entry: InFlight): Promise<void> {
    let outcome: Outcome;
    const startedAt = performance.now();
    const ran = (): number => (performance.now() - startedAt) / 1000;
    try {
      const context = new EntryContext(entry);
      outcome = await processing(this, message, async () => checkOutcome(await handler(message, context)));
    } catch (error) {
      entry.settled = true;
      if (!entry.abandoned) await this.fail(message.id, error, ran());
      return;
    }
    entry.settled = true;
    if (entry.abandoned) return;
    switch (outcome.kind) {
      case "done":
        return this.ack(message, entry, ran());
      case "terminal":
        return this.ackTerminal(message.id, outcome.reason, ran());
      case "retry":
        return this.retry(message.id, ran());
    }
  }

  /**
   * Acknowledges with the handlers that finished together: one `XACK` for them all, with `HDEL errors` for those
   * that may have a last error in the same round trip. The slot is free at once: the read loop's next read carries
   * the XACK when it comes soon, else the writer sends it after a turn of the event loop (which lets the others
   * join). Counted `done` once the XACK is answered.
   */
  private async ack(message: Message, entry: InFlight, seconds: number): Promise<void> {
    const id = message.id;
    // A message that failed before (here, or elsewhere before it was requeued as a copy) may have a last error.
    const clearError = this.errorsRecorded.delete(id) || message.pairs.some(([name]) => name.equals(DELIVERIES));
    const error = await new Promise<unknown>((written) => {
      this.pendingAcks.push({ id, clearError, written });
      if (!this.acksCarried) this.writeAcksSoon();
      entry.acking = true;
      this.acking++;
      this.wake?.();
    });
    if (error === undefined) this.count("done", seconds);
    else this.writeFailed("XACK", id, error, seconds);
  }

  /** No read comes soon (a blocking one is sent, the read loop waits or ends): the writer sends what waits. */
  private releaseAcks(): void {
    this.acksCarried = false;
    if (this.pendingAcks.length > 0) this.writeAcksSoon();
  }

  private writeAcksSoon(): void {
    if (this.ackWriteDue) return;
    this.ackWriteDue = true;
    setImmediate(() => {
      this.ackWriteDue = false;
      void this.writeAcks();
    });
  }

  /** Sends the pending acknowledgements in one round trip and answers each with the error, if any. */
  private async writeAcks(): Promise<void> {
    const batch = this.pendingAcks;
    if (batch.length === 0) return;
    this.pendingAcks = [];
    const writer = this.writerConn();
    let error: unknown;
    try {
      const replies = await this.ackCommands(writer.pipeline(), batch).exec();
      error = replies?.[0]?.[0] ?? undefined;
    } catch (failure) {
      error = failure;
    }
    for (const pending of batch) pending.written(error);
  }

  /** Adds the XACK of `batch` to `pipeline`, and the HDEL of the last errors of those that may have one. */
  private ackCommands(pipeline: ChainableCommander, batch: readonly PendingAck[]): ChainableCommander {
    pipeline.xack(this.stream, this.group, ...batch.map((pending) => pending.id));
    const cleared = batch.filter((pending) => pending.clearError).map((pending) => pending.id);
    if (cleared.length > 0) pipeline.hdel(this.errorsKey(), ...cleared);
    return pipeline;
  }

  private async ackTerminal(id: string, reason: string, seconds: number): Promise<void> {
    this.log.warn("message ended as terminal", { ...this.where(), entryId: id, reason });
    this.errorsRecorded.delete(id);
    try {
      await this.writerConn().pelicanTerminalAck(
        this.stream,
        terminalKey(this.stream, this.group),
        this.errorsKey(),
        this.group,
        id,
        reason,
      );
      this.count("terminal", seconds);
    } catch (error) {
      this.writeFailed("terminal ACK", id, error, seconds);
    }
  }

  /** `give_back.lua` with the group's `minIdleMs`, the delivery counted: the pass retries it under the backoff. */
  private async retry(id: string, seconds: number): Promise<void> {
    // Not re-read here: the give-back makes it look idle, not handed over. It looks untouched since `idleMs` ago: a
    // hand-over back to this worker (the only live one) may come within a second, and is told by its idle all the same.
    while (this.leasing) await this.leasing;
    // No lease tick gathers it from here on (it is settled), and this give-back is sent in this turn.
    const idleMs = this.settings?.minIdleMs ?? UNPUBLISHED_IDLE_MS;
    this.failedHere.set(id, Date.now() - idleMs);
    try {
      await this.writerConn().pelicanGiveBack(this.stream, this.group, this.consumer, idleMs, 0, id);
    } catch (error) {
      this.log.warn("could not give the message back for a retry: it is retried after minIdle", {
        ...this.where(),
        entryId: id,
        error: errorText(error),
      });
      // Not given back: untouched since it failed here, never since `idleMs` ago.
      this.failedHere.set(id, Date.now());
    }
    this.count("retried", seconds);
  }

  /** A failure: no ACK, the error's text recorded as the entry's last error, the entry left to the pass. */
  private async fail(id: string, error: unknown, seconds: number): Promise<void> {
    const text = cutUtf8(errorText(error), ERROR_TEXT_MAX);
    this.log.warn("handler failed; the message stays pending for the operator's retry", {
      ...this.where(),
      entryId: id,
      error: text,
    });
    this.failedHere.set(id, Date.now());
    try {
      await this.writerConn().hset(this.errorsKey(), id, text);
      // A requeued message comes back under a new id, so its old id is never ACKed here: bounded, not growing
      // with every failure (a field whose ACK then skips the HDEL is removed by the operator's passes).
      if (this.errorsRecorded.size >= ERRORS_REMEMBERED) this.errorsRecorded.clear();
      this.errorsRecorded.add(id);
    } catch (recordError) {
      this.log.warn("could not record the message's last error", {
        ...this.where(),
        entryId: id,
        error: errorText(recordError),
      });
    }
    // A thrown `undefined` is a handler's error too (its `error.type` is `_OTHER`).
    this.count("failed", seconds, error ?? null);
  }

  private writeFailed(what: string, id: string, error: unknown, seconds: number): void {
    // A server's error reply means nothing was written (the scripts check everything before their first write);
    // a broken connection leaves it open.
    const message = isReplyError(error)
      ? `${what} refused; the message stays pending`
      : `${what} outcome unknown (the connection failed): the message may be acknowledged, or stays pending`;
    this.log.warn(message, { ...this.where(), entryId: id, error: errorText(error) });
    // Left pending for the pass: this worker takes it up again only once it is handed back.
    this.failedHere.set(id, Date.now());
    this.count("failed", seconds);
  }

  /** Counts a handler run that took `seconds` as `ended`, in the stats and their metrics (`handlerError`: thrown). */
  private count(ended: Ended, seconds: number, handlerError?: unknown): void {
    this.counters[ended]++;
    this.measure.ended(ended, seconds, handlerError);
  }

  private scheduleLease(): void {
    if (this.closed) return;
    this.leaseTimer = setTimeout(() => {
      void this.leaseTick().finally(() => this.scheduleLease());
    }, leaseIntervalMs(this.settings));
  }

  /**
   * One lease tick: re-read the settings (a lowered `minIdle` is leased at its new pace before it counts), extend
   * every entry in flight for less than `maxHandlingMs` (the call is the worker's heartbeat, made also with no
   * ids), then take up the hand-overs. An entry handled longer is no longer extended, said once. An unknown
   * contract version shuts the worker down, as `stop()` does, and `run` then rejects with it.
   */
  private async leaseTick(): Promise<void> {
    try {
      await this.readSettings();
    } catch (error) {
      if (!(error instanceof ContractVersionError)) {
        this.sayOnce("settings", "could not re-read the group's settings; the last ones stay", error);
      } else if (!this.fatal) {
        this.fatal = error;
        this.log.error(`${error.message}; shutting down`, this.where());
        this.requestStop();
      }
    }
    this.leasing = this.leaseAndTakeUp();
    try {
      await this.leasing;
    } finally {
      this.leasing = undefined;
    }
  }

  /** A lease tick's lease of what is in flight and queued, then its take-up of the hand-overs (never rejects). */
  private async leaseAndTakeUp(): Promise<void> {
    // When this lease is sent, every chunk of it.
    const now = Date.now();
    const ids: string[] = [...this.queued.keys()];
    for (const [id, entry] of this.inFlight) {
      // A settled entry's outcome is being written: a lease after its give-back would undo the give-back's idle.
      if (entry.settled) continue;
      if (now - entry.startedAt < this.maxHandlingMs) ids.push(id);
      else if (!entry.overdue) {
        entry.overdue = true;
        this.log.warn(
          "handler still running after maxHandlingMs: its lease is no longer extended, and the " +
            "operator's pass may retry the message",
          { ...this.where(), entryId: id, maxHandlingMs: this.maxHandlingMs },
        );
      }
    }
    // Every chunk at once, in this turn: one round trip for the tick, however many entries are in flight.
    await Promise.all((ids.length > 0 ? chunks(ids, ID_BATCH) : [[]]).map((chunk) => this.leaseChunk(chunk, now)));
    await this.takeUp();
  }

  /** One chunk of a lease tick sent at `sent`: says which entries the pass took, corrects what failed meanwhile. */
  private async leaseChunk(chunk: readonly string[], sent: number): Promise<void> {
    try {
      const kept = new Set(parseIds(await this.lease(chunk)));
      for (const id of chunk) {
        const entry = this.inFlight.get(id);
        // Not ours any more while its handler runs: the pass took it (the handler may be slower than a lowered
        // minIdle, or the process stalled). Said, never acknowledged twice by this worker's doing.
        if (!kept.has(id) && entry && !entry.settled) {
          this.log.warn("a message being handled was taken by the operator's pass: it may be handled twice", {
            ...this.where(),
            entryId: id,
          });
        }
      }
    } catch (error) {
      this.log.warn("could not extend the leases of the messages being handled; retrying", {
        ...this.where(),
        error: errorText(error),
      });
    }
    // A handler that failed while this lease was on its way (a paused server answers late): the lease may have
    // reset the entry's idle time after the failure, so the entry looks untouched since now, not since it failed;
    // else the own-PEL check would take it for a hand-over and run it again here. (A retry's time is set back by
    // `minIdleMs`: its give-back waits for this lease, see `leasing`.)
    const answered = Date.now();
    for (const id of chunk) {
      const failedAt = this.failedHere.get(id);
      if (failedAt !== undefined && failedAt >= sent) this.failedHere.set(id, answered);
    }
  }

  /** `lease.lua` for `ids` (at most 100; none: the heartbeat alone); replies the ids still this consumer's. */
  private lease(ids: readonly string[]): Promise<unknown> {
    const consumers = consumersKey(this.stream, this.group);
    return this.writerConn().pelicanLease(this.stream, consumers, this.group, this.consumer, ...ids);
  }

  /**
   * After the read loop: handlers finish within the grace (leases go on meanwhile); what is still running then is
   * given back uncounted, its handler's signal aborted. The give-back is made also when nothing is left: it is how
   * the worker leaves the group.
   */
  private async finishInFlight(): Promise<void> {
    let timer: NodeJS.Timeout | undefined;
    const graceOver = new Promise<boolean>(
      (resolve) => (timer = setTimeout(() => resolve(true), this.shutdownGraceMs)),
    );
    const allFinished = Promise.all([...this.inFlight.values()].map((e) => e.finished)).then(() => false);
    const cut = await Promise.race([allFinished, graceOver]);
    clearTimeout(timer);
    // Read (or handed over) and never started: given back with what the grace cut off.
    const left: string[] = [...this.queued.keys()];
    this.queued.clear();
    const writing: Promise<void>[] = [];
    for (const [id, entry] of cut ? this.inFlight : []) {
      if (entry.settled) {
        writing.push(entry.finished);
        continue;
      }
      entry.abandoned = true;
      entry.abort?.abort(new Error(GIVEN_BACK));
      // No longer this worker's, though its handler may still run: neither leased nor counted in flight.
      this.inFlight.delete(id);
      this.measure.landed(1);
      left.push(id);
    }
    // Outcomes already being written finish first (each bounded by the writer's command timeout), so that the
    // consumer owns nothing they would still remove when the give-back looks.
    await Promise.all(writing);
    await this.giveBackOnShutdown(left);
  }

  /**
   * `give_back.lua` with the group's `retryAfterMs` and ARGV[4] = 1: each entry uncounted and left without an
   * owner, taken by the next pass whatever its idle time; and the consumer deleted once it owns nothing (called
   * with no ids when nothing is left), so `strategy: Reassign` never hands work to a worker that left.
   */
  private async giveBackOnShutdown(ids: string[]): Promise<void> {
    const idleMs = this.settings?.retryAfterMs ?? UNPUBLISHED_IDLE_MS;
    try {
      for (const chunk of ids.length > 0 ? chunks(ids, ID_BATCH) : [[]]) {
        const given = await this.writerConn().pelicanGiveBack(
          this.stream,
          this.group,
          this.consumer,
          idleMs,
          1,
          ...chunk,
        );
        // Only what the give-back released: an entry acknowledged (or taken by the pass) meanwhile was not.
        this.counters.abandoned += Number(given);
        this.measure.abandoned(Number(given));
      }
    } catch (error) {
      this.log.warn("shutdown: could not give back (and leave the group): what is left is retried after minIdle", {
        ...this.where(),
        left: ids.length,
        error: errorText(error),
      });
    }
    this.log.info("shutdown: messages given back for the next pass, their delivery not counted", {
      ...this.where(),
      given: this.counters.abandoned,
    });
  }

  private errorsKey(): string {
    return errorsKey(this.stream, this.group);
  }

  private where(): Record<string, unknown> {
    return { stream: this.stream, group: this.group, consumer: this.consumer };
  }

  private readerConn(): Connection {
    if (!this.reader) throw new Error("the worker is not running");
    return this.reader;
  }

  private writerConn(): Connection & ScriptCommands {
    if (!this.writer) throw new Error("the worker is not running");
    return this.writer;
  }
}

/** Cuts `text` to at most `max` UTF-8 bytes, at a character boundary. */
export function cutUtf8(text: string, max: number): string {
  const bytes = Buffer.from(text, "utf8");
  if (bytes.length <= max) return text;
  let end = max;
  // A continuation byte (10xxxxxx) is inside a character: step back to the character's first byte.
  while (end > 0 && (bytes.readUInt8(end) & 0xc0) === 0x80) end--;
  return bytes.subarray(0, end).toString("utf8");
}

export function chunks<T>(items: readonly T[], size: number): T[][] {
  const out: T[][] = [];
  for (let i = 0; i < items.length; i += size) out.push(items.slice(i, i + size));
  return out;
}

type Entry = [id: string, pairs: Array<[Buffer, Buffer]> | null];

/** A read's entries as messages (an entry without fields has no payload: skipped), and the last entry's id. */
function messagesOf(entries: Entry[]): { messages: Message[]; last: string | undefined } {
  const messages: Message[] = [];
  for (const [id, pairs] of entries) if (pairs) messages.push(new Message(id, pairs));
  return { messages, last: entries.at(-1)?.[0] };
}

/** `XREADGROUP`'s `[[stream, entries]]`, or nil, as entries. */
export function parseStreams(reply: unknown): Entry[] {
  if (!Array.isArray(reply)) return [];
  const entries: Entry[] = [];
  for (const stream of reply as unknown[]) if (Array.isArray(stream)) parseEntries(stream[1], entries);
  return entries;
}

/** `[[id, [field, value, ...] | nil], ...]` as entries (added to `into`); nil fields for a deleted payload. */
function parseEntries(reply: unknown, into: Entry[] = []): Entry[] {
  if (!Array.isArray(reply)) return into;
  for (const item of reply as unknown[]) {
    if (!Array.isArray(item)) continue;
    const [id, flat] = item as [unknown, unknown];
    if (!Buffer.isBuffer(id)) continue;
    if (!Array.isArray(flat)) {
      into.push([id.toString(), null]);
      continue;
    }
    const pairs: Array<[Buffer, Buffer]> = [];
    for (let i = 0; i + 1 < flat.length; i += 2) pairs.push([toBuffer(flat[i]), toBuffer(flat[i + 1])]);
    into.push([id.toString(), pairs]);
  }
  return into;
}

function toBuffer(value: unknown): Buffer {
  return Buffer.isBuffer(value) ? value : Buffer.from(String(value));
}

/** `XPENDING`'s extended form: `[[id, consumer, idle ms, deliveries], ...]`. */
function parsePending(reply: unknown): Array<{ id: string; idleMs: number; deliveries: number }> {
  if (!Array.isArray(reply)) return [];
  return reply.flatMap((row: unknown) =>
    Array.isArray(row) && row.length >= 4
      ? [{ id: String(row[0]), idleMs: Number(row[2]), deliveries: Number(row[3]) }]
      : [],
  );
}

function parseIds(reply: unknown): string[] {
  return Array.isArray(reply) ? reply.map(String) : [];
}
