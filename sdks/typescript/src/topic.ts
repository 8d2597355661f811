/**
 * Publishing into a topic (a policy with `spec.partitions`, contract/README.md "Topics (contract version 2)"): each
 * message goes to the partition of its key, round robin without one, through that partition's bounded-publish
 * script: a `Producer` per partition, all on one connection.
 */
import { crc32 } from "node:zlib";

import { podName, type RedisTarget } from "./connection.js";
import { TOPIC_CONTRACT_VERSION, partitionStream, topicKey } from "./keys.js";
import { Producer, type Fields, type ProducerOptions } from "./producer.js";
import { Carried } from "./trace.js";

/** The most partitions a topic has (the operator's admission refuses more). */
export const MAX_PARTITIONS = 1024;

/** A message's key: text (hashed as its UTF-8 bytes) or bytes. */
export type MessageKey = string | Uint8Array;

/**
 * The partition of `key` in a topic of `partitions`: CRC-32 (ISO-HDLC, zlib's) of its bytes, modulo `partitions`, as
 * every library computes it (`contract/partitions.json`). A language's own string hash would differ between them.
 */
export function partitionOf(key: MessageKey, partitions: number): number {
  if (!Number.isInteger(partitions) || partitions < 1) {
    throw new RangeError(`a topic has 1 or more partitions, not ${partitions}`);
  }
  return crc32(key) % partitions;
}

/** Why a topic producer did not start; `topic` names the topic. */
export abstract class TopicError extends Error {
  constructor(
    readonly topic: string,
    message: string,
    options?: { cause: unknown },
  ) {
    super(message, options);
  }
}

/** No policy describes the topic (yet): `{T}:pelican:T:topic` has no `partitions` (1 .. 1024). */
export class NotATopic extends TopicError {
  override readonly name = "NotATopic";
  /** `instead`: what to do with a plain stream (a producer publishes with a `Producer`, a worker runs a `Worker`). */
  constructor(topic: string, instead = "publish with a Producer") {
    super(
      topic,
      `${JSON.stringify(topic)} is not a topic: no policy with spec.partitions describes it (yet); apply one, or ` +
        `${instead} if it is a plain stream`,
    );
  }
}

/** The topic is described under a contract version this library does not know. */
export class UnknownTopicContract extends TopicError {
  override readonly name = "UnknownTopicContract";
  /** `contractVersion` as the operator wrote it (empty when the description has none). */
  constructor(
    topic: string,
    readonly version: string,
  ) {
    super(
      topic,
      `topic ${JSON.stringify(topic)} is described under worker contract ${JSON.stringify(version)}, this library ` +
        `knows topics of ${TOPIC_CONTRACT_VERSION}: upgrade the library (@pelican-io/worker)`,
    );
  }
}

/** The topic's description could not be read (the server unreachable, an ACL): nothing was published. */
export class TopicUnavailable extends TopicError {
  override readonly name = "TopicUnavailable";
  constructor(topic: string, options: { cause: unknown }) {
    const reason = options.cause instanceof Error ? options.cause.message : String(options.cause);
    super(topic, `could not read the description of topic ${JSON.stringify(topic)}: ${reason}`, options);
  }
}

/**
 * The partitions of `topic` from its description (`HGETALL {T}:pelican:T:topic`), or the refusal. A version this
 * library does not know is refused first, whatever the rest holds: a later version may describe partitions anew.
 */
export function describedPartitions(topic: string, description: Readonly<Record<string, string>>): number {
  const version = description["contractVersion"];
  if (version !== undefined && version !== String(TOPIC_CONTRACT_VERSION)) {
    throw new UnknownTopicContract(topic, version);
  }
  const text = description["partitions"] ?? "";
  const partitions = /^\d{1,4}$/.test(text) ? Number(text) : 0;
  if (partitions < 1 || partitions > MAX_PARTITIONS) throw new NotATopic(topic);
  if (version === undefined) throw new UnknownTopicContract(topic, "");
  return partitions;
}

/** Where a message went: its partition, and its entry id in that partition's stream. */
export interface TopicPublished {
  partition: number;
  id: string;
}

export interface TopicPublishOptions {
  /**
   * The message's key: the message goes to the key's partition, and carries the key as its first field,
   * `pelican-key`. Without one the message goes round robin.
   */
  key?: MessageKey;
}

/**
 * Publishes into the partitions of one topic, on one connection. Made by `TopicProducer.connect`; the round-robin
 * counter is the producer's own.
 */
export class TopicProducer {
  private next = 0;

  private constructor(
    readonly topic: string,
    private readonly producers: readonly Producer[],
  ) {}

  /**
   * Reads the topic's description (its partitions) and connects; throws a `TopicError` subclass when the topic is
   * not one this library can publish into (its connection then closed).
   */
  static async connect(
    redis: RedisTarget,
    topic: string,
    options: Pick<ProducerOptions, "timeoutMs"> = {},
  ): Promise<TopicProducer> {
    const first = new Producer({ ...options, redis, stream: partitionStream(topic, 0) });
    try {
      const description = await first.readHash(topicKey(topic)).catch((cause: unknown) => {
        throw new TopicUnavailable(topic, { cause });
      });
      const partitions = describedPartitions(topic, description);
      const producers = [first];
      for (let i = 1; i < partitions; i++) producers.push(first.sibling(partitionStream(topic, i)));
      return new TopicProducer(topic, producers);
    } catch (error) {
      await first.close();
      throw error;
    }
  }

  /** N: `{T:0}` .. `{T:N-1}`. */
  get partitions(): number {
    return this.producers.length;
  }

  /** The partition a message with `key` goes to; without a key, the next one round robin (one step per call). */
  partition(key?: MessageKey): number {
    if (key !== undefined) return partitionOf(key, this.partitions);
    const partition = this.next;
    this.next = (partition + 1) % this.partitions;
    return partition;
  }

  /**
   * Adds one entry to the partition of `options.key` (its first field `pelican-key`, then `fields` in order), or
   * round robin without a key. The errors are a `Producer`'s for that partition's stream: a partition's bound
   * refuses as a stream's does.
   */
  async publish(fields: Fields, options: TopicPublishOptions = {}): Promise<TopicPublished> {
    const partition = this.partition(options.key);
    const id = await this.producerOf(partition).invoke(fields, keyed(options.key));
    return { partition, id };
  }

  /**
   * The same producer, its publishes idempotent under `producerId` (default: the Pod's name) on each partition
   * (`XADD ... IDMP`, Redis 8.6+), as `Producer.idempotent`: throws `IdempotenceUnsupported` on a server without it.
   */
  async idempotent(producerId: string = podName()): Promise<IdempotentTopicProducer> {
    // The check is the server's, the same for every partition.
    await this.producerOf(0).idempotent(producerId);
    return new IdempotentTopicProducer(this, producerId);
  }

  /** Closes the connection once the publishes sent are answered. */
  close(): Promise<void> {
    return this.producerOf(0).close();
  }

  /** @internal The producer of partition `partition`. */
  producerOf(partition: number): Producer {
    const producer = this.producers[partition];
    if (producer === undefined) throw new RangeError(`topic ${this.topic} has no partition ${partition}`);
    return producer;
  }
}

/**
 * A topic producer whose publishes carry an idempotency key, as an `IdempotentProducer`'s do. A message without a
 * key goes to the partition of its message id rather than round robin, so that publishing it again reaches the
 * partition that has it. Made by `TopicProducer.idempotent()`.
 */
export class IdempotentTopicProducer {
  /** The trace fields of publishes whose outcome was unknown, sent again by the next attempt. */
  private readonly carried = new Carried();

  constructor(
    private readonly producer: TopicProducer,
    readonly producerId: string,
  ) {}

  get topic(): string {
    return this.producer.topic;
  }

  get partitions(): number {
    return this.producer.partitions;
  }

  /**
   * Adds the message `messageId` once within the window, to the partition of `options.key` (or of `messageId`);
   * publishing it again answers the first entry's id.
   */
  async publish(messageId: string, fields: Fields, options: TopicPublishOptions = {}): Promise<TopicPublished> {
    const partition = partitionOf(options.key ?? messageId, this.partitions);
    const producer = this.producer.producerOf(partition);
    const idempotent = { producerId: this.producerId, messageId, carried: this.carried };
    const id = await producer.invoke(fields, { ...keyed(options.key), idempotent });
    return { partition, id };
  }

  close(): Promise<void> {
    return this.producer.close();
  }
}

/** The key a publish carries as its first field, when there is one. */
function keyed(key: MessageKey | undefined): { key?: string | Buffer } {
  if (key === undefined) return {};
  return { key: typeof key === "string" ? key : Buffer.from(key) };
}
