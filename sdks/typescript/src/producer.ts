/**
 * The producer side of a bounded stream (contract/README.md, "Producers"): publishes through the bounded-publish
 * scripts and tells a refusal (certainly not written, try later) from an unknown outcome (may have been written).
 */

import { connect, isReplyError, podName, type Connection, type RedisTarget } from "./connection.js";
import { KEY_FIELD, boundsKey, rejectedKey } from "./keys.js";
import { producerMeter, type ProducerMeter, type Sent } from "./meter.js";
import { withScripts, type ScriptCommands } from "./scripts.js";
import { Carried, startSending } from "./trace.js";

/** An entry's fields, in order: an object, or pairs (a name may then repeat). */
export type Fields =
  | Readonly<Record<string, string | Buffer | number>>
  | ReadonlyArray<readonly [string | Buffer, string | Buffer | number]>;

export interface ProducerOptions {
  /** A `redis://` URL or ioredis options; the producer opens one connection of its own. */
  redis: RedisTarget;
  stream: string;
  /** How long a publish waits for its reply before it is `PublishOutcomeUnknown`. Default 10,000 ms. */
  timeoutMs?: number;
}

/** Why a publish did not return an id. `certainlyNotWritten` tells whether publishing it again can duplicate it. */
export abstract class PublishError extends Error {
  abstract readonly certainlyNotWritten: boolean;
}

/**
 * A bounded group's backlog is full: nothing was written. Publish again later, with backoff, jitter and a cap,
 * never in a tight loop.
 */
export class PublishRefused extends PublishError {
  override readonly name = "PublishRefused";
  readonly certainlyNotWritten = true;
  constructor(
    readonly group: string,
    readonly backlog: number,
    readonly max: number,
  ) {
    super(`refused: the backlog of group ${JSON.stringify(group)} is ${backlog}, its bound is ${max}`);
  }
}

/**
 * Nothing was written, and publishing again may succeed: the server is a replica now (`READONLY`, after a
 * failover), loading, busy, or the connection is down right now.
 */
export class PublishUnavailable extends PublishError {
  override readonly name = "PublishUnavailable";
  readonly certainlyNotWritten = true;
  constructor(options: { cause: unknown }) {
    super(`unavailable (not written, try again): ${text(options.cause)}`, options);
  }
}

/** The server refused with another error (a key of the wrong type, an ACL): nothing written; fix the cause. */
export class PublishFailed extends PublishError {
  override readonly name = "PublishFailed";
  readonly certainlyNotWritten = true;
  constructor(options: { cause: unknown }) {
    super(`failed (not written): ${text(options.cause)}`, options);
  }
}

/**
 * The connection broke or timed out after the call may have reached the server: the entry may be in the stream.
 * Publishing again may duplicate it: reconcile first, or publish through an `IdempotentProducer`.
 */
export class PublishOutcomeUnknown extends PublishError {
  override readonly name = "PublishOutcomeUnknown";
  readonly certainlyNotWritten = false;
  constructor(options: { cause: unknown }) {
    super(`outcome unknown (may have been written): ${text(options.cause)}`, options);
  }
}

/** The server has no `XADD ... IDMP` (Redis 8.6 added it). */
export class IdempotenceUnsupported extends Error {
  override readonly name = "IdempotenceUnsupported";
  constructor() {
    super(
      "the server has no XADD ... IDMP (Redis 8.6 or later): a retried publish may duplicate; publish with " +
        "Producer.publish and reconcile by an id of your own in the entry's fields",
    );
  }
}

/** What a batch publish wrote: the first `ids.length` entries, in order. */
export interface Published {
  ids: string[];
  /** Set when the bound had no room for the rest: those entries were certainly not written. */
  refused?: { group: string; backlog: number; max: number };
}

/** What a publish carries besides its fields: a topic's key (its first field), an idempotent publish's ids. */
export interface Invocation {
  key?: string | Buffer;
  idempotent?: { producerId: string; messageId: string; carried: Carried };
}

/** The replies a server's own state explains, where trying again may succeed and nothing was written. */
const UNAVAILABLE = ["READONLY", "LOADING", "MASTERDOWN", "BUSY", "TRYAGAIN"];
/** ioredis' words for a command it never sent: the connection was down and the offline queue is off. */
const NOT_SENT = "enableOfflineQueue options is false";

export class Producer {
  readonly stream: string;
  private readonly conn: Connection & ScriptCommands;
  private readonly keys: [string, string, string];
  private readonly measure: ProducerMeter;
  private ready: Promise<void> | undefined;

  constructor(options: ProducerOptions);
  /** @internal A producer of `options.stream` on another producer's connection (`sibling`). */
  constructor(options: Pick<ProducerOptions, "stream">, shared: Connection & ScriptCommands);
  constructor(options: ProducerOptions | Pick<ProducerOptions, "stream">, shared?: Connection & ScriptCommands) {
    this.stream = options.stream;
    this.keys = [options.stream, boundsKey(options.stream), rejectedKey(options.stream)];
    this.measure = producerMeter(options.stream);
    // Only the internal overload passes `shared`, and only the public one leaves it out.
    this.conn = shared ?? publishConnection(options as ProducerOptions);
  }

  /** Adds one entry and returns its id; throws a `PublishError` subclass otherwise. */
  publish(fields: Fields): Promise<string> {
    return this.invoke(fields);
  }

  /**
   * Adds entries in order, with one backlog check for them all, as many as every bounded group has room for. A
   * thrown `PublishOutcomeUnknown` means any prefix of the batch may be in the stream.
   */
  async publishBatch(entries: readonly Fields[]): Promise<Published> {
    return this.invokeBatch(entries.map((fields) => flatten(fields)));
  }

  /**
   * This producer, its publishes made idempotent under `producerId` (default: the Pod's name), on a server with
   * `XADD ... IDMP`; throws `IdempotenceUnsupported` elsewhere rather than pretend.
   */
  async idempotent(producerId: string = podName()): Promise<IdempotentProducer> {
    if (producerId === "")
      throw new Error("the producer id is empty: give one stable across restarts, e.g. the Pod's name");
    await this.connected();
    const docs = await this.conn.call("COMMAND", "DOCS", "XADD");
    if (!commandTokens(docs, "xadd").has("IDMP")) throw new IdempotenceUnsupported();
    return new IdempotentProducer(this, producerId);
  }

  /** Closes the connection once the publishes sent are answered. */
  async close(): Promise<void> {
    await this.conn.quit().catch(() => this.conn.disconnect());
  }

  /** @internal A producer of `stream` on this producer's connection: a topic's partitions share one. */
  sibling(stream: string): Producer {
    const sibling = new Producer({ stream }, this.conn);
    // The siblings share this producer's wait for the first connection: one listener, not one per partition.
    sibling.ready = this.connected();
    return sibling;
  }

  /** @internal The hash at `key`, read once the connection is up (a topic's description). */
  async readHash(key: string): Promise<Record<string, string>> {
    await this.connected();
    return this.conn.hgetall(key);
  }

  /**
   * @internal One call of the batch script, each entry's arguments already flat (IDMP first when it has one), in one
   * `send` span whose context every entry carries.
   */
  async invokeBatch(entries: ReadonlyArray<ReadonlyArray<string | Buffer>>): Promise<Published> {
    if (entries.length === 0) return { ids: [] };
    const sending = startSending(this.stream, { count: entries.length });
    const traced = sending.fields.flat();
    const args: Array<string | Buffer> = [String(entries.length)];
    for (const entry of entries) args.push(String(entry.length + traced.length), ...entry, ...traced);
    let reply: unknown;
    try {
      reply = await this.call(() => this.conn.pelicanBoundedPublishBatch(...this.keys, ...args));
    } catch (error) {
      this.measure(notSent(error), entries.length);
      sending.failed(error);
      throw error;
    }
    sending.sent();
    const [ids, refusal] = Array.isArray(reply) ? (reply as [unknown, unknown]) : [[], []];
    const published: Published = { ids: Array.isArray(ids) ? ids.map(String) : [] };
    this.measure("sent", published.ids.length);
    this.measure("refused", entries.length - published.ids.length);
    if (Array.isArray(refusal) && refusal.length === 3) {
      published.refused = { group: String(refusal[0]), backlog: Number(refusal[1]), max: Number(refusal[2]) };
    }
    return published;
  }

  /**
   * @internal One publish: IDMP's ids first when idempotent, then the key field, `fields`, and the trace context
   * last, in a `send` span of its own. An idempotent publish sends the trace fields of an earlier attempt of its
   * message id whose outcome was unknown or unavailable, and keeps its own when this one's is.
   */
  async invoke(fields: Fields, { key, idempotent }: Invocation = {}): Promise<string> {
    const args = flatten(key === undefined ? fields : withFirstField(KEY_FIELD, key, fields));
    const sending = startSending(
      this.stream,
      { messageId: idempotent?.messageId, key },
      idempotent?.carried.take(idempotent.messageId),
    );
    const idmp = idempotent ? ["IDMP", idempotent.producerId, idempotent.messageId] : [];
    try {
      const id = String(
        await this.call(() =>
          this.conn.pelicanBoundedPublish(...this.keys, ...idmp, ...args, ...sending.fields.flat()),
        ),
      );
      this.measure("sent", 1);
      sending.sent(id);
      return id;
    } catch (error) {
      this.measure(notSent(error), 1);
      if (idempotent && (error instanceof PublishOutcomeUnknown || error instanceof PublishUnavailable)) {
        idempotent.carried.keep(idempotent.messageId, sending.fields);
      }
      sending.failed(error);
      throw error;
    }
  }

  /** Runs a call once the first connection is up, its errors classified. */
  private async call<T>(send: () => Promise<T>): Promise<T> {
    await this.connected();
    try {
      return await send();
    } catch (error) {
      throw classify(error);
    }
  }

  /**
   * Waits for the first connection only (the offline queue is off): later, a publish while reconnecting fails at
   * once as unavailable.
   */
  private connected(): Promise<void> {
    this.ready ??= this.conn.status === "ready" ? Promise.resolve() : this.firstConnection();
    return this.ready;
  }

  private firstConnection(): Promise<void> {
    return new Promise((resolve) => {
      // Whichever comes first: ready, or the connection failing (the publish then fails as unavailable).
      const done = (): void => {
        this.conn.off("ready", done).off("error", done);
        resolve();
      };
      this.conn.once("ready", done).once("error", done);
    });
  }
}

/** The connection of a producer (and of its siblings): it never sends a publish twice. */
function publishConnection(options: ProducerOptions): Connection & ScriptCommands {
  // A publish is never sent twice by the client: whether to publish again is the caller's call, told by the
  // error's class. `maxRetriesPerRequest: 0` and `autoResendUnfulfilledCommands: false`: a call in flight when
  // the connection drops fails (outcome unknown) instead of being resent after the reconnect, which would write
  // the entry twice when the first reply was lost. `enableOfflineQueue: false`: while disconnected a publish
  // fails at once, certainly not sent (unavailable), rather than waiting in a queue whose fate is unknown. No
  // ready check: it needs INFO, which the producer's ACL (examples/acl/producer.acl) does not grant.
  const conn = withScripts(
    connect(options.redis, {
      maxRetriesPerRequest: 0,
      autoResendUnfulfilledCommands: false,
      enableOfflineQueue: false,
      enableReadyCheck: false,
      commandTimeout: options.timeoutMs ?? 10_000,
    }),
  );
  // Connection errors surface through publishes; without a listener ioredis would print each one.
  conn.on("error", () => undefined);
  return conn;
}

/**
 * A producer whose every publish carries an idempotency key (`XADD ... IDMP <producer id> <message id>`, Redis
 * 8.6+): within the stream's window a publish of a (producer id, message id) already published writes nothing and
 * returns the first entry's id, so a publish that ended `PublishOutcomeUnknown` is simply published again with the
 * same message id. The producer id must be stable across restarts and unique among the stream's producers; the
 * message id is the application's (an order number), never random per attempt. Made by `Producer.idempotent()`.
 */
export class IdempotentProducer {
  /** The trace fields of publishes whose outcome was unknown, sent again by the next attempt. */
  private readonly carried = new Carried();

  constructor(
    private readonly producer: Producer,
    readonly producerId: string,
  ) {}

  get stream(): string {
    return this.producer.stream;
  }

  /** Adds the entry unless `messageId` was published by this producer within the window; returns its id. */
  publish(messageId: string, fields: Fields): Promise<string> {
    return this.producer.invoke(fields, {
      idempotent: { producerId: this.producerId, messageId, carried: this.carried },
    });
  }

  /** `Producer.publishBatch` with a message id per entry; a batch that ended unknown is published again whole. */
  publishBatch(entries: ReadonlyArray<readonly [messageId: string, fields: Fields]>): Promise<Published> {
    return this.producer.invokeBatch(
      entries.map(([messageId, fields]) => ["IDMP", this.producerId, messageId, ...flatten(fields)]),
    );
  }

  close(): Promise<void> {
    return this.producer.close();
  }
}

/** An error of a publish as its class: refused, unavailable, failed, or outcome unknown. */
/** A failed publish's `error.type` in `messaging.client.sent.messages`. */
function notSent(error: unknown): Sent {
  if (error instanceof PublishRefused) return "refused";
  if (error instanceof PublishUnavailable) return "unavailable";
  if (error instanceof PublishOutcomeUnknown) return "unknown";
  return "failed";
}

export function classify(error: unknown): PublishError {
  if (isReplyError(error)) {
    const message = error.message;
    const refused = /^PELICAN_BACKLOG_FULL (.*) (\d+) (\d+)$/s.exec(message);
    if (refused) return new PublishRefused(refused[1] ?? "", Number(refused[2]), Number(refused[3]));
    // A batch that failed after its first entries were added.
    if (message.startsWith("PELICAN_PARTIAL")) return new PublishOutcomeUnknown({ cause: error });
    if (UNAVAILABLE.some((code) => message.startsWith(code))) return new PublishUnavailable({ cause: error });
    return new PublishFailed({ cause: error });
  }
  if (error instanceof Error && error.message.includes(NOT_SENT)) return new PublishUnavailable({ cause: error });
  // A broken connection, a timeout, a command flushed by a disconnect: it may have reached the server.
  return new PublishOutcomeUnknown({ cause: error });
}

/** Every `token` of a `COMMAND DOCS` reply's arguments for `command`, at any depth (arguments nest). */
export function commandTokens(docs: unknown, command: string): Set<string> {
  const tokens = new Set<string>();
  const walk = (value: unknown): void => {
    if (!Array.isArray(value)) return;
    value.forEach((item: unknown, i) => {
      if (String(item) === "token" && i + 1 < value.length) tokens.add(String(value[i + 1]).toUpperCase());
      walk(item);
    });
  };
  // `[name, docs, name, docs, ...]`
  if (Array.isArray(docs)) {
    for (let i = 0; i + 1 < docs.length; i += 2) {
      if (String(docs[i]).toLowerCase() === command) walk(docs[i + 1]);
    }
  }
  return tokens;
}

/** `fields` with `[name, value]` before them (a topic's key field). */
function withFirstField(name: string, value: string | Buffer, fields: Fields): Fields {
  return [[name, value], ...pairs(fields)];
}

function pairs(fields: Fields): ReadonlyArray<readonly [string | Buffer, string | Buffer | number]> {
  return Array.isArray(fields)
    ? (fields as ReadonlyArray<readonly [string | Buffer, string | Buffer | number]>)
    : Object.entries(fields as Readonly<Record<string, string | Buffer | number>>);
}

function flatten(fields: Fields): Array<string | Buffer> {
  const all = pairs(fields);
  if (all.length === 0) throw new TypeError("an entry needs at least one field");
  return all.flatMap(([name, value]) => [name, typeof value === "number" ? String(value) : value]);
}

function text(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}
