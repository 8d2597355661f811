/**
 * The topic producer: the partition of a key (every case of contract/partitions.json), and against a real
 * redis-server each message in its key's partition with the key first, round robin without one, a partition's bound,
 * the refusals that name the topic, and idempotence per partition (Redis 8.6).
 */
import assert from "node:assert/strict";
import { existsSync, readFileSync } from "node:fs";
import { after, before, test } from "node:test";
import type { Redis } from "ioredis";

import {
  KEY_FIELD,
  NotATopic,
  PublishRefused,
  TopicError,
  TopicProducer,
  TopicUnavailable,
  UnknownTopicContract,
  boundsKey,
  partitionOf,
  partitionStream,
  topicKey,
} from "../src/index.js";
import { commandTokens } from "../src/producer.js";
import { describedPartitions } from "../src/topic.js";
import { startRedis, type RedisServer } from "./support/server.js";
import { waitFor } from "./support/helpers.js";

let server: RedisServer;
let admin: Redis;
let topics = 0;

before(async () => {
  server = await startRedis();
  admin = server.admin;
});
after(() => server.stop());

/** A topic name no other test uses. */
function freshTopic(): string {
  return `orders-${process.pid}-${++topics}`;
}

/** A topic of `partitions`, described as the operator describes it. */
async function describe(on: Redis, topic: string, partitions: number): Promise<void> {
  await on.hset(topicKey(topic), "partitions", partitions, "contractVersion", 2);
}

/** Each entry of a stream as its fields, names and values as text. */
async function entries(on: Redis, stream: string): Promise<string[][]> {
  return (await on.xrange(stream, "-", "+")).map(([, fields]) => fields);
}

/** What `promise` rejected with (it must reject). */
async function rejection(promise: Promise<unknown>): Promise<unknown> {
  return promise.then(
    () => assert.fail("it resolved"),
    (error: unknown) => error,
  );
}

/** The connections the server has open (the admin connection among them). */
async function clients(on: Redis): Promise<number> {
  const list = String(await on.call("CLIENT", "LIST"));
  return list.split("\n").filter((line) => line.trim() !== "").length;
}

interface PartitionCase {
  key?: string;
  keyHex?: string;
  crc32: number;
  partitions: number;
  partition: number;
}

/** contract/partitions.json, inside the repository (the package tested alone has no contract/ beside it). */
const VECTOR = new URL("../../../../contract/partitions.json", import.meta.url);

test("the partition of every key of contract/partitions.json", (t) => {
  if (!existsSync(VECTOR)) {
    t.skip("not inside the Pelican repository: no contract/partitions.json to test against");
    return;
  }
  const { cases } = JSON.parse(readFileSync(VECTOR, "utf8")) as { cases: PartitionCase[] };
  assert.ok(cases.length >= 50, `the vector has ${cases.length} cases`);
  for (const { key, keyHex, partitions, partition } of cases) {
    const bytes = key === undefined ? Buffer.from(keyHex ?? "", "hex") : new TextEncoder().encode(key);
    assert.equal(partitionOf(bytes, partitions), partition, `${key ?? keyHex} in ${partitions} (bytes)`);
    if (key !== undefined) assert.equal(partitionOf(key, partitions), partition, `${key} in ${partitions} (text)`);
  }
});

test("the partition of a key is CRC-32/ISO-HDLC modulo N: the check value, the empty key", () => {
  assert.equal(partitionOf("123456789", 1000), 0xcbf43926 % 1000);
  assert.equal(partitionOf("123456789", 1), 0);
  assert.equal(partitionOf("", 1024), 0);
  assert.throws(() => partitionOf("k", 0), RangeError);
});

test("topic keys: each partition its own hash tag, the description in the topic's slot", () => {
  assert.equal(partitionStream("orders", 3), "{orders:3}");
  assert.equal(topicKey("orders"), "{orders}:pelican:orders:topic");
  assert.equal(boundsKey(partitionStream("orders", 3)), "{orders:3}:pelican:{orders:3}:bounds");
});

test("a description is read as its version, then its partitions", () => {
  assert.equal(describedPartitions("t", { partitions: "8", contractVersion: "2" }), 8);
  assert.equal(describedPartitions("t", { partitions: "1024", contractVersion: "2" }), 1024);
  for (const partitions of [undefined, "0", "1025", "8x", ""]) {
    const description = partitions === undefined ? { contractVersion: "2" } : { partitions, contractVersion: "2" };
    assert.throws(() => describedPartitions("t", description), NotATopic, `partitions ${partitions}`);
  }
  assert.throws(() => describedPartitions("t", {}), NotATopic);
  assert.throws(
    () => describedPartitions("t", { partitions: "many", contractVersion: "3" }),
    (error: unknown) => error instanceof UnknownTopicContract && error.version === "3",
  );
  assert.throws(
    () => describedPartitions("t", { partitions: "4" }),
    (error: unknown) => error instanceof UnknownTopicContract && error.version === "",
  );
});

test("keyed messages go to their key's partition, in order, the key their first field", async () => {
  const topic = freshTopic();
  await describe(admin, topic, 8);
  const producer = await TopicProducer.connect(server.url, topic);
  assert.equal(producer.partitions, 8);
  const keys = ["order-1", "order-2", "order-3", "Zürich", "注文-7"];
  for (let n = 0; n < 3; n++) {
    for (const key of keys) {
      const { partition, id } = await producer.publish({ n }, { key });
      assert.equal(partition, partitionOf(key, 8));
      assert.equal(producer.partition(key), partition);
      assert.match(id, /^\d+-\d+$/);
    }
  }
  const bytes = Buffer.from([0xff, 0x00, 0xfe]);
  const bytesKeyed = await producer.publish([["n", "b"]], { key: new Uint8Array(bytes) });
  await producer.close();
  for (const key of keys) {
    const stream = partitionStream(topic, partitionOf(key, 8));
    const ofKey = (await entries(admin, stream)).filter((fields) => fields[1] === key);
    const expected = [0, 1, 2].map((n) => [KEY_FIELD, key, "n", String(n)]);
    assert.deepEqual(ofKey, expected, `${key}: its three messages, in order, the key first, in ${stream}`);
  }
  assert.equal(bytesKeyed.partition, partitionOf(bytes, 8));
  const stream = partitionStream(topic, bytesKeyed.partition);
  const [bytesEntry] = await admin.xrangeBuffer(stream, bytesKeyed.id, bytesKeyed.id);
  assert.deepEqual(bytesEntry?.[1].slice(0, 2), [Buffer.from(KEY_FIELD), bytes], "a key of bytes, as its bytes");
  let total = 0;
  for (let i = 0; i < 8; i++) total += await admin.xlen(partitionStream(topic, i));
  assert.equal(total, 16, "nothing elsewhere");
  assert.equal(await admin.exists(topic), 0, "the stream named like the topic is never written");
});

test("messages without a key go round robin, evenly over every partition, without a key field", async () => {
  const topic = freshTopic();
  await describe(admin, topic, 4);
  const producer = await TopicProducer.connect(server.url, topic);
  const counts = [0, 0, 0, 0];
  for (let n = 0; n < 12; n++) {
    const { partition } = await producer.publish({ n });
    counts[partition] = (counts[partition] ?? 0) + 1;
  }
  await producer.close();
  assert.deepEqual(counts, [3, 3, 3, 3]);
  for (let i = 0; i < 4; i++) {
    const stream = partitionStream(topic, i);
    assert.equal(await admin.xlen(stream), 3, stream);
    assert.deepEqual(
      (await entries(admin, stream)).map((fields) => fields[0]),
      ["n", "n", "n"],
      stream,
    );
  }
});

test("a partition's bound refuses as a stream's does", async () => {
  const topic = freshTopic();
  await describe(admin, topic, 4);
  const key = "customer-7";
  const stream = partitionStream(topic, partitionOf(key, 4));
  await admin.xgroup("CREATE", stream, "g", "$", "MKSTREAM");
  await admin.hset(boundsKey(stream), "g", 1);
  const producer = await TopicProducer.connect(server.url, topic);
  await producer.publish({ n: 1 }, { key });
  const error = await rejection(producer.publish({ n: 2 }, { key }));
  await producer.close();
  assert.ok(error instanceof PublishRefused, String(error));
  assert.deepEqual([error.group, error.backlog, error.max, error.certainlyNotWritten], ["g", 1, 1, true]);
  assert.equal(await admin.xlen(stream), 1);
});

test("a topic no policy describes is refused by name, and so is an unknown contract version", async () => {
  const topic = freshTopic();
  const before = await clients(admin);
  const missing = await rejection(TopicProducer.connect(server.url, topic));
  assert.ok(missing instanceof NotATopic, String(missing));
  assert.equal(missing.topic, topic);
  assert.equal(
    missing.message,
    `"${topic}" is not a topic: no policy with spec.partitions describes it (yet); apply one, or publish with a ` +
      "Producer if it is a plain stream",
  );
  await admin.hset(topicKey(topic), "partitions", 4, "contractVersion", 3);
  const unknown = await rejection(TopicProducer.connect(server.url, topic));
  assert.ok(unknown instanceof UnknownTopicContract, String(unknown));
  assert.equal(unknown.version, "3");
  assert.equal(
    unknown.message,
    `topic "${topic}" is described under worker contract "3", this library knows topics of 2: upgrade the library ` +
      "(@pelican-io/worker)",
  );
  // The refused producer closed its connection: it would otherwise keep the process alive.
  await waitFor("the refused producers' connections closed", async () => (await clients(admin)) === before);
});

test("an unreachable server is TopicUnavailable, naming the topic", async () => {
  const unused = await startRedis();
  const port = unused.port;
  await unused.stop();
  const error = await rejection(TopicProducer.connect(`redis://127.0.0.1:${port}`, "orders"));
  assert.ok(error instanceof TopicUnavailable && error instanceof TopicError, String(error));
  assert.equal(error.topic, "orders");
  assert.match(error.message, /^could not read the description of topic "orders": /);
});

/**
 * A server with `XADD ... IDMP` (Redis 8.6+): the default one when it has it, else the one `IDMP_REDIS_SERVER` names.
 * Without either the test is skipped, saying so, unless `IDMP_REQUIRED=1` (the repository's scripts/test sets both).
 */
async function idmpServer(): Promise<RedisServer | "default" | undefined> {
  if (commandTokens(await admin.call("COMMAND", "DOCS", "XADD"), "xadd").has("IDMP")) return "default";
  const named = process.env["IDMP_REDIS_SERVER"];
  if (named) return startRedis([], named);
  if (process.env["IDMP_REQUIRED"] === "1") throw new Error("IDMP_REQUIRED=1 but no IDMP_REDIS_SERVER is named");
  return undefined;
}

test("an idempotent publish repeated lands once, in one partition, with or without a key", async (t) => {
  const other = await idmpServer();
  if (other === undefined) {
    t.skip("the redis-server has no XADD ... IDMP (Redis 8.6+) and no IDMP_REDIS_SERVER is named");
    return;
  }
  const target = other === "default" ? server : other;
  try {
    const topic = freshTopic();
    await describe(target.admin, topic, 8);
    const producer = await (await TopicProducer.connect(target.url, topic)).idempotent("producer-a");
    const keyed = await producer.publish("m-keyed", { v: 1 }, { key: "order-9" });
    const keyedAgain = await producer.publish("m-keyed", { v: 1 }, { key: "order-9" });
    const keyless = await producer.publish("m-keyless", { v: 1 });
    const keylessAgain = await producer.publish("m-keyless", { v: 1 });
    await producer.close();
    assert.deepEqual(keyedAgain, keyed, "the same partition and entry id");
    assert.deepEqual(keylessAgain, keyless, "the same partition and entry id");
    assert.equal(keyed.partition, partitionOf("order-9", 8));
    assert.equal(keyless.partition, partitionOf("m-keyless", 8), "the partition of its message id");
    let total = 0;
    for (let i = 0; i < 8; i++) total += await target.admin.xlen(partitionStream(topic, i));
    assert.equal(total, 2, "each message once");
    const [keyedEntry] = await entries(target.admin, partitionStream(topic, keyed.partition));
    assert.deepEqual(keyedEntry, [KEY_FIELD, "order-9", "v", "1"]);
  } finally {
    if (other !== "default") await other.stop();
  }
});
