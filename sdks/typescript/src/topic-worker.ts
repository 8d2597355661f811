/**
 * A topic's worker (contract/README.md, "Topics (contract version 2)"): a member of the topic's group that owns the
 * partitions `membership.lua` assigns it, and runs a worker on each one it owns: its pending list taken over first,
 * then new entries. Released partitions are finished and given back (as on SIGTERM), lost ones are dropped at once
 * with no outcome written. On an `ordering: PerKey` topic each partition runs in order per key instead.
 */

import { connect, errorText, podName, type Connection } from "./connection.js";
import { TOPIC_CONTRACT_VERSION, epochsKey, membersKey, ownersKey, partitionStream, settingsKey } from "./keys.js";
import type { Message } from "./message.js";
import type { Outcome } from "./outcome.js";
import { InOrderPartition, type Spacing } from "./in-order.js";
import { PartitionWorker, type PartitionRunner } from "./partition.js";
import { withScripts, type ScriptCommands } from "./scripts.js";
import { ContractVersionError } from "./settings.js";
import { MAX_PARTITIONS, NotATopic, TopicError, TopicUnavailable, UnknownTopicContract } from "./topic.js";
import {
  stderrLogger,
  type Handler,
  type HandlerContext,
  type Logger,
  type RunOptions,
  type WorkerOptions,
  type WorkerStats,
} from "./worker.js";

export interface TopicWorkerOptions extends Omit<WorkerOptions, "stream"> {
  /** The topic: the policy's `spec.stream`, whose partitions are `{T:0}` .. `{T:N-1}`. */
  topic: string;
  /**
   * How long the membership lives without a heartbeat, in ms: 1,000 .. 86,400,000 (a day); a heartbeat every third
   * of it. A member that cannot beat for that long stops every partition it had. Default 10,000 ms. Keep it well
   * above the pauses the process can have (garbage collection, a stopped container).
   */
  ttlMs?: number;
}

/** What a topic's handler knows of a message besides its entry: where it was read. */
export interface TopicHandlerContext extends HandlerContext {
  readonly topic: string;
  /** The partition the entry was read from: `{topic:partition}`. */
  readonly partition: number;
}

/** A topic's handler: as a `Handler`, its context naming the partition. */
export type TopicHandler = (message: Message, context: TopicHandlerContext) => Promise<Outcome>;

/** How a topic orders its messages: `PerKey` runs the entries of one key one at a time, in order. */
export type Ordering = "None" | "PerKey";

/** The topic's settings name an `ordering` this library does not know. */
export class UnknownOrdering extends TopicError {
  override readonly name = "UnknownOrdering";
  constructor(
    topic: string,
    readonly ordering: string,
  ) {
    super(
      topic,
      `topic ${JSON.stringify(topic)} has ordering ${JSON.stringify(ordering)}, which this library does not know ` +
        "(None, PerKey): upgrade the library (@pelican-io/worker)",
    );
  }
}

/** The membership's default ttl. */
export const DEFAULT_TTL_MS = 10_000;
const MIN_TTL_MS = 1000;
const MAX_TTL_MS = 86_400_000;

/** What a topic's settings say a worker needs. */
export interface TopicDescription {
  partitions: number;
  ordering: Ordering;
  /** How retries in place are spaced (`PerKey`). */
  spacing: Spacing;
}

/**
 * The topic's settings (`{T}:pelican:T:<group>:settings`) as a worker reads them, or the refusal: the contract
 * version first (2), then `partitions` (1 .. 1024), then `ordering`.
 */
export function describeTopicSettings(topic: string, hash: Readonly<Record<string, string>>): TopicDescription {
  const version = hash["contractVersion"];
  if (version !== String(TOPIC_CONTRACT_VERSION)) {
    if (hash["partitions"] === undefined) throw new NotATopic(topic, "run a Worker");
    throw new UnknownTopicContract(topic, version ?? "");
  }
  const text = hash["partitions"] ?? "";
  const partitions = /^\d{1,4}$/.test(text) ? Number(text) : 0;
  if (partitions < 1 || partitions > MAX_PARTITIONS) throw new NotATopic(topic, "run a Worker");
  const ordering = hash["ordering"] ?? "None";
  if (ordering !== "None" && ordering !== "PerKey") throw new UnknownOrdering(topic, ordering);
  const whole = (name: string, fallback: number): number => {
    const value = hash[name];
    return value !== undefined && /^\d+$/.test(value) ? Number(value) : fallback;
  };
  return {
    partitions,
    ordering,
    spacing: { factor: Math.max(1, whole("backoffFactor", 1)), maxMs: whole("backoffMaxMs", 0) },
  };
}

/** `membership.lua`'s answer: the partitions owned with their epochs, those to release, the live members. */
export interface Assignment {
  owned: ReadonlyArray<readonly [partition: number, epoch: number]>;
  release: readonly number[];
  members: number;
}

export function parseAssignment(reply: unknown): Assignment {
  const [owned, release, members] = Array.isArray(reply) ? reply : [];
  return {
    owned: (Array.isArray(owned) ? owned : []).flatMap((pair: unknown) =>
      Array.isArray(pair) ? [[Number(pair[0]), Number(pair[1])] as const] : [],
    ),
    release: (Array.isArray(release) ? release : []).map(Number),
    members: Number(members ?? 0),
  };
}

/** A partition this member runs. */
interface Owned {
  readonly epoch: number;
  readonly runner: PartitionRunner;
  /** Told to release: stopping as on SIGTERM, said released once its runner ended. */
  releasing: boolean;
  finished: Promise<void>;
}

/** A partition's handler context: the worker's, with the topic and the partition. */
class PartitionContext implements TopicHandlerContext {
  constructor(
    private readonly base: HandlerContext,
    readonly topic: string,
    readonly partition: number,
  ) {}

  get signal(): AbortSignal {
    return this.base.signal;
  }
}

/**
 * A member of a topic's group. `TopicWorker.connect` reads the topic's settings (refusing a topic it cannot serve),
 * `run` joins the group, beats every `ttlMs / 3` and runs a worker on each partition it owns (`concurrency` handlers
 * each), until `stop()`.
 */
export class TopicWorker {
  readonly topic: string;
  readonly group: string;
  readonly consumer: string;
  readonly partitions: number;
  readonly ordering: Ordering;
  readonly ttlMs: number;
  private readonly log: Logger;
  private readonly owned = new Map<number, Owned>();
  /** Partitions released since the last heartbeat answered. */
  private released: number[] = [];
  private readonly counters = { done: 0, terminal: 0, failed: 0, retried: 0, abandoned: 0 };
  private readonly stopping = new AbortController();
  /** A partition met a contract version this library does not know: the member shuts down, `run` rejects. */
  private fatal: ContractVersionError | undefined;
  /** Ends the wait for the next heartbeat. */
  private wake: (() => void) | undefined;
  private running: Promise<WorkerStats> | undefined;

  private constructor(
    private readonly options: TopicWorkerOptions,
    private readonly conn: Connection & ScriptCommands,
    private readonly description: TopicDescription,
  ) {
    this.topic = options.topic;
    this.group = options.group;
    this.consumer = options.consumer || podName();
    this.partitions = description.partitions;
    this.ordering = description.ordering;
    this.ttlMs = options.ttlMs ?? DEFAULT_TTL_MS;
    this.log = options.logger ?? stderrLogger;
  }

  /**
   * Reads the topic's settings and connects. Throws a `RangeError` for a ttl outside 1 s .. a day, and a
   * `TopicError` for a topic it cannot serve: `NotATopic` (no policy with `spec.partitions` for this topic and
   * group), `UnknownTopicContract`, `UnknownOrdering`, `TopicUnavailable` (the settings could not be read).
   */
  static async connect(options: TopicWorkerOptions): Promise<TopicWorker> {
    const ttlMs = options.ttlMs ?? DEFAULT_TTL_MS;
    if (!Number.isInteger(ttlMs) || ttlMs < MIN_TTL_MS || ttlMs > MAX_TTL_MS) {
      throw new RangeError(`ttlMs must be a whole number of ms, ${MIN_TTL_MS} .. ${MAX_TTL_MS} (a day); got ${ttlMs}`);
    }
    // A heartbeat answered later than a third of the ttl is as good as lost.
    const commandTimeout = Math.min(10_000, Math.floor(ttlMs / 3));
    const conn = withScripts(connect(options.redis, { commandTimeout, enableReadyCheck: false }));
    let last = "";
    conn.on("error", (error: unknown) => {
      const text = errorText(error);
      if (text !== last) (options.logger ?? stderrLogger).warn(`membership connection: ${text}; reconnecting`);
      last = text;
    });
    conn.on("ready", () => (last = ""));
    try {
      const hash = await conn.hgetall(settingsKey(options.topic, options.group)).catch((cause: unknown) => {
        throw new TopicUnavailable(options.topic, { cause });
      });
      return new TopicWorker(options, conn, describeTopicSettings(options.topic, hash));
    } catch (error) {
      conn.disconnect();
      throw error;
    }
  }

  /**
   * Runs until `stop()` (or `signal`): then stops every partition as a `Worker` stops (handlers finish within the
   * grace, the rest is given back), leaves the group, and resolves with the counts of every partition summed.
   * Rejects when the join fails (`PELICAN_TOO_MANY_MEMBERS`, the server unreachable), and with a
   * `ContractVersionError` after the shutdown when a partition's settings change to a contract it does not know.
   */
  run(handler: TopicHandler, options: RunOptions = {}): Promise<WorkerStats> {
    if (this.running) throw new Error("this topic worker already ran: connect a new TopicWorker");
    const { signal } = options;
    const onAbort = (): void => void this.stop();
    signal?.addEventListener("abort", onAbort, { once: true });
    if (signal?.aborted) this.stopping.abort();
    this.running = this.runUntilStopped(handler).finally(() => signal?.removeEventListener("abort", onAbort));
    return this.running;
  }

  /** Asks the member to shut down; resolves (or rejects) as `run()` does, once it left the group. */
  stop(): Promise<WorkerStats> {
    this.requestStop();
    return this.running ?? this.close().then(() => ({ ...this.counters, inFlight: 0 }));
  }

  /** Stops the member on the first of `signals`. Returns a function that removes the handlers. */
  installSignalHandlers(signals: readonly NodeJS.Signals[] = ["SIGTERM", "SIGINT"]): () => void {
    const onSignal = (): void => void this.stop();
    for (const signal of signals) process.once(signal, onSignal);
    return () => signals.forEach((signal) => process.off(signal, onSignal));
  }

  /** The partitions this member runs now, in order. */
  ownedPartitions(): number[] {
    return [...this.owned.keys()].sort((a, b) => a - b);
  }

  private requestStop(): void {
    if (this.stopping.signal.aborted) return;
    this.stopping.abort();
    this.wake?.();
  }

  private async runUntilStopped(handler: TopicHandler): Promise<WorkerStats> {
    // When the last answered heartbeat was sent (monotonic): past the ttl, the partitions may be another's.
    let beatAt: number | undefined;
    try {
      while (!this.stopping.signal.aborted) {
        const sent = performance.now();
        const saying = [...this.released];
        try {
          const assignment = parseAssignment(await this.heartbeat(false, saying));
          this.released = this.released.filter((partition) => !saying.includes(partition));
          beatAt = sent;
          this.follow(assignment, handler);
        } catch (error) {
          if (beatAt === undefined) throw error;
          this.log.warn("membership heartbeat failed; retrying", { ...this.where(), error: errorText(error) });
          if (performance.now() - beatAt >= this.ttlMs && this.owned.size > 0) {
            this.log.warn("no heartbeat answered within the ttl: the partitions may be another's, stopped at once", {
              ...this.where(),
              partitions: this.ownedPartitions(),
            });
            for (const owned of this.owned.values()) owned.runner.lose();
            this.owned.clear();
          }
        }
        await this.untilNextBeat();
      }
      // Every partition stops as a worker does on SIGTERM, then the member leaves.
      const running = [...this.owned.values()];
      for (const owned of running) owned.runner.stop();
      await Promise.all(running.map((owned) => owned.finished));
      try {
        await this.heartbeat(true, []);
        this.log.info("left the topic's group", this.where());
      } catch (error) {
        this.log.warn("could not leave the group: its partitions move when the membership expires", {
          ...this.where(),
          error: errorText(error),
        });
      }
    } finally {
      await this.close();
    }
    if (this.fatal) throw this.fatal;
    return { ...this.counters, inFlight: 0 };
  }

  private heartbeat(leaving: boolean, released: readonly number[]): Promise<unknown> {
    const { topic, group } = this;
    return this.conn.pelicanMembership(
      membersKey(topic, group),
      ownersKey(topic, group),
      epochsKey(topic, group),
      this.consumer,
      this.ttlMs,
      this.partitions,
      leaving ? 1 : 0,
      ...released,
    );
  }

  /** A third of the ttl, ended early by `stop()` or a partition released. */
  private async untilNextBeat(): Promise<void> {
    if (this.stopping.signal.aborted || this.released.length > 0) return;
    let timer: NodeJS.Timeout | undefined;
    await new Promise<void>((resolve) => {
      this.wake = resolve;
      timer = setTimeout(resolve, Math.floor(this.ttlMs / 3));
    });
    clearTimeout(timer);
  }

  /**
   * Starts a worker on each partition newly owned (or owned under a new epoch: it was lost and came back), drops
   * the ones lost at once, and stops the ones to release as on SIGTERM.
   */
  private follow(assignment: Assignment, handler: TopicHandler): void {
    const epochs = new Map(assignment.owned);
    for (const [partition, owned] of this.owned) {
      if (epochs.get(partition) === owned.epoch) continue;
      this.log.warn("partition lost (its membership expired): stopped at once", { ...this.where(), partition });
      owned.runner.lose();
      this.owned.delete(partition);
    }
    for (const [partition, epoch] of assignment.owned) {
      if (!this.owned.has(partition)) this.start(partition, epoch, handler);
    }
    for (const partition of assignment.release) {
      const owned = this.owned.get(partition);
      if (!owned || owned.releasing) continue;
      this.log.info("releasing the partition: its messages in flight finish first", { ...this.where(), partition });
      owned.releasing = true;
      owned.runner.stop();
    }
  }

  private start(partition: number, epoch: number, handler: TopicHandler): void {
    const stream = partitionStream(this.topic, partition);
    const { topic: _topic, ttlMs: _ttlMs, ...options } = this.options;
    const runner: PartitionRunner =
      this.ordering === "PerKey"
        ? new InOrderPartition({
            redis: options.redis,
            stream,
            group: this.group,
            consumer: this.consumer,
            concurrency: Math.max(1, options.concurrency ?? 16),
            blockMs: options.blockMs ?? 1000,
            shutdownGraceMs: options.shutdownGraceMs ?? 20_000,
            logger: this.log,
            spacing: this.description.spacing,
          })
        : new PartitionWorker({ ...options, stream, consumer: this.consumer, logger: this.log });
    const perPartition: Handler = (message, context) =>
      handler(message, new PartitionContext(context, this.topic, partition));
    const owned: Owned = { epoch, runner, releasing: false, finished: Promise.resolve() };
    owned.finished = runner
      .run(perPartition)
      .then(
        (stats) => this.add(stats),
        (error: unknown) => {
          if (error instanceof ContractVersionError) {
            this.fatal ??= error;
            this.requestStop();
          } else {
            this.log.warn("the partition's worker could not run; started again at the next heartbeat", {
              ...this.where(),
              partition,
              error: errorText(error),
            });
          }
        },
      )
      .then(() => {
        // Lost meanwhile: it is no longer this member's to say released.
        if (this.owned.get(partition) !== owned) return;
        this.owned.delete(partition);
        if (owned.releasing) {
          this.released.push(partition);
          this.wake?.();
        }
      });
    this.log.info("partition taken", { ...this.where(), partition, epoch });
    this.owned.set(partition, owned);
  }

  private add(stats: WorkerStats): void {
    this.counters.done += stats.done;
    this.counters.terminal += stats.terminal;
    this.counters.failed += stats.failed;
    this.counters.retried += stats.retried;
    this.counters.abandoned += stats.abandoned;
  }

  private async close(): Promise<void> {
    await this.conn.quit().catch(() => this.conn.disconnect());
  }

  private where(): Record<string, unknown> {
    return { topic: this.topic, group: this.group, member: this.consumer };
  }
}
