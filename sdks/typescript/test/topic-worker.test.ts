/**
 * The topic worker against a real redis-server: members sharing a topic's partitions (the owners hash, who ran
 * what), a member leaving or cut off handing its partitions over, order per key (`PerKey`): runs in order, retries in
 * place, the cap left to the pass; and the refusals, each naming what is wrong.
 */
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { Cluster, type Redis } from "ioredis";

import {
  KEY_FIELD,
  NotATopic,
  TopicProducer,
  TopicWorker,
  UnknownOrdering,
  UnknownTopicContract,
  done,
  errorsKey,
  membersKey,
  ownersKey,
  partitionOf,
  partitionStream,
  settingsKey,
  topicKey,
  type Connection,
  type RedisTarget,
  type TopicHandler,
  type TopicWorkerOptions,
} from "../src/index.js";
import { startProxy } from "./support/proxy.js";
import { startCluster, startRedis, type RedisServer } from "./support/server.js";
import { pending, recordingLogger, waitFor } from "./support/helpers.js";

let server: RedisServer;
let admin: Redis;
let topics = 0;
const group = "workers";
/** The shortest membership ttl: a heartbeat every third of a second. */
const TTL_MS = 1000;

before(async () => {
  server = await startRedis();
  admin = server.admin;
});
after(() => server.stop());

function freshTopic(): string {
  return `events-${process.pid}-${++topics}`;
}

/**
 * A topic of `partitions` as the operator makes it: its description, its settings and each partition's (contract
 * version 2), and the group on each partition.
 */
async function makeTopic(
  topic: string,
  partitions: number,
  settings: Record<string, string | number> = {},
  on: Connection = admin,
) {
  const fields = {
    contractVersion: 2,
    partitions,
    ordering: "None",
    backoffFactor: 1,
    backoffMaxMs: 0,
    minIdleMs: 60_000,
    retryAfterMs: 60_000,
    maxDeliveries: 5,
    ...settings,
  };
  await on.hset(topicKey(topic), "partitions", partitions, "contractVersion", 2);
  await on.hset(settingsKey(topic, group), fields);
  for (let p = 0; p < partitions; p++) {
    const stream = partitionStream(topic, p);
    await on.xgroup("CREATE", stream, group, "0", "MKSTREAM");
    await on.hset(settingsKey(stream, group), fields);
  }
}

/** One handler run as a member saw it. */
interface Run {
  member: string;
  id: string;
  partition: number;
  key: string | undefined;
  name: string | undefined;
  startedAt: number;
  endedAt: number;
}

interface Member {
  worker: TopicWorker;
  running: Promise<unknown>;
}

async function member(
  topic: string,
  name: string,
  handler: TopicHandler,
  options: Partial<TopicWorkerOptions> = {},
): Promise<Member> {
  const worker = await TopicWorker.connect({
    redis: server.url,
    topic,
    group,
    consumer: name,
    ttlMs: TTL_MS,
    blockMs: 100,
    shutdownGraceMs: 2000,
    logger: recordingLogger(),
    ...options,
  });
  const running = worker.run(handler);
  running.catch(() => undefined);
  return { worker, running };
}

/** A handler that records each run in `runs` and then runs `body` (done by default). */
function recording(runs: Run[], memberName: string, body: TopicHandler = async () => done()): TopicHandler {
  return async (message, context) => {
    const run: Run = {
      member: memberName,
      id: message.id,
      partition: context.partition,
      key: message.field(KEY_FIELD),
      name: message.field("name"),
      startedAt: performance.now(),
      endedAt: Number.NaN,
    };
    runs.push(run);
    try {
      return await body(message, context);
    } finally {
      run.endedAt = performance.now();
    }
  };
}

async function owners(topic: string, on: Connection = admin): Promise<Record<string, string>> {
  return on.hgetall(ownersKey(topic, group));
}

/** Each member named owns `share` partitions, and runs exactly those. */
async function waitShared(
  topic: string,
  members: Record<string, Member>,
  share: number,
  on: Connection = admin,
): Promise<void> {
  await waitFor(`each member to own ${share} partitions`, async () => {
    const now = await owners(topic, on);
    return Object.entries(members).every(([name, { worker }]) => {
      const owned = Object.entries(now).filter(([, owner]) => owner === name);
      const runs = worker.ownedPartitions();
      return owned.length === share && runs.length === share && runs.every((p) => now[String(p)] === name);
    });
  });
}

async function publishKeyed(
  topic: string,
  keys: readonly string[],
  fields: Record<string, string> = {},
  redis: RedisTarget = server.url,
) {
  const producer = await TopicProducer.connect(redis, topic);
  try {
    for (const key of keys) await producer.publish({ name: key, ...fields }, { key });
  } finally {
    await producer.close();
  }
}

/** The entries pending on every partition of a topic. */
async function pendingAll(topic: string, partitions: number, on: Connection = admin): Promise<number> {
  let count = 0;
  for (let p = 0; p < partitions; p++) {
    const summary = (await on.xpending(partitionStream(topic, p), group)) as [number, ...unknown[]];
    count += summary[0];
  }
  return count;
}

test("two members share 4 partitions, 2 each, and the owner of each partition handles its keyed messages once", async () => {
  const topic = freshTopic();
  await makeTopic(topic, 4);
  const runs: Run[] = [];
  const a = await member(topic, "a", recording(runs, "a"));
  const b = await member(topic, "b", recording(runs, "b"));
  await waitShared(topic, { a, b }, 2);
  const keys = Array.from({ length: 40 }, (_, i) => `customer-${i}`);
  await publishKeyed(topic, keys);
  await waitFor("40 runs, nothing pending", async () => runs.length >= 40 && (await pendingAll(topic, 4)) === 0);
  const now = await owners(topic);
  assert.equal(runs.length, 40);
  assert.deepEqual(new Set(runs.map((run) => run.key)), new Set(keys));
  for (const run of runs) {
    assert.ok(run.key);
    assert.equal(run.partition, partitionOf(run.key, 4), `${run.key} read from the partition of its key`);
    assert.equal(run.member, now[String(run.partition)], `${run.key} handled by its partition's owner`);
  }
  assert.deepEqual(new Set(runs.map((run) => run.member)), new Set(["a", "b"]));
  await Promise.all([a.worker.stop(), b.worker.stop()]);
  assert.deepEqual(await admin.hgetall(membersKey(topic, group)), {}, "both left the group");
});

test("a member that leaves hands its partitions to the other, which handles what follows", async () => {
  const topic = freshTopic();
  await makeTopic(topic, 4);
  const runs: Run[] = [];
  const a = await member(topic, "a", recording(runs, "a"));
  const b = await member(topic, "b", recording(runs, "b"));
  await waitShared(topic, { a, b }, 2);
  const stats = await a.worker.stop();
  assert.equal(stats.done, 0);
  assert.deepEqual(a.worker.ownedPartitions(), []);
  await waitShared(topic, { b }, 4);
  assert.deepEqual(Object.keys(await admin.hgetall(membersKey(topic, group))), ["b"]);
  const keys = Array.from({ length: 20 }, (_, i) => `order-${i}`);
  await publishKeyed(topic, keys);
  await waitFor("20 runs", () => runs.length >= 20);
  assert.equal(runs.length, 20);
  assert.ok(runs.every((run) => run.member === "b"));
  assert.equal(new Set(runs.map((run) => run.partition)).size, 4, "b handles every partition");
  const bStats = await b.worker.stop();
  assert.equal(bStats.done, 20);
});

test("a member cut off from the server loses its partitions within the ttl; the other runs its pending entry first, delivered twice", async () => {
  const topic = freshTopic();
  await makeTopic(topic, 1);
  const proxy = await startProxy(server.port);
  const runs: Run[] = [];
  let aborted = false;
  const a = await member(
    topic,
    "a",
    recording(runs, "a", async (_message, context) => {
      // Blocks until the member drops the partition.
      await new Promise((resolve) => context.signal.addEventListener("abort", resolve, { once: true }));
      aborted = true;
      return done();
    }),
    { redis: `redis://127.0.0.1:${proxy.port}` },
  );
  await waitFor("a to own the partition", () => a.worker.ownedPartitions().length === 1);
  const deliveries: Record<string, number> = {};
  const b = await member(
    topic,
    "b",
    recording(runs, "b", async (message) => {
      const [entry] = await pending(admin, partitionStream(topic, 0), group).then((rows) =>
        rows.filter((row) => row.id === message.id),
      );
      deliveries[message.field("name") ?? ""] = entry?.deliveries ?? 0;
      return done();
    }),
  );
  await publishKeyed(topic, ["stuck"]);
  await waitFor("a to run the entry", () => runs.some((run) => run.member === "a"));
  const cutAt = performance.now();
  await proxy.close();
  await publishKeyed(topic, ["after"]);
  await waitFor("a to drop its partition", () => a.worker.ownedPartitions().length === 0 && aborted);
  assert.ok(performance.now() - cutAt < TTL_MS + 1000, "dropped within the ttl (and a heartbeat)");
  await waitFor("b to run both", () => runs.filter((run) => run.member === "b").length >= 2);
  const byB = runs.filter((run) => run.member === "b");
  assert.deepEqual(
    byB.map((run) => run.name),
    ["stuck", "after"],
    "the pending list first",
  );
  assert.deepEqual(deliveries, { stuck: 2, after: 1 }, "the take-over counts one delivery, not two");
  await waitFor("nothing pending", async () => (await pendingAll(topic, 1)) === 0);
  assert.deepEqual(await owners(topic), { "0": "b" });
  await Promise.all([a.worker.stop(), b.worker.stop()]);
});

test("PerKey: 5 keys x 6 messages run in order per key, never two of a key at once, keys side by side", async () => {
  const topic = freshTopic();
  await makeTopic(topic, 1, { ordering: "PerKey" });
  const keys = ["k0", "k1", "k2", "k3", "k4"];
  const producer = await TopicProducer.connect(server.url, topic);
  for (let n = 0; n < 6; n++) {
    for (const key of keys) await producer.publish({ n: String(n) }, { key });
  }
  await producer.close();
  const runs: Array<Run & { n: number }> = [];
  const m = await member(
    topic,
    "a",
    async (message, context) => {
      const run = {
        member: "a",
        id: message.id,
        partition: context.partition,
        key: message.field(KEY_FIELD),
        name: undefined,
        n: Number(message.field("n")),
        startedAt: performance.now(),
        endedAt: Number.NaN,
      };
      runs.push(run);
      // Later messages of a key run shorter: a runner that ignored the order would let them overtake.
      await new Promise((resolve) => setTimeout(resolve, 40 - 5 * run.n));
      run.endedAt = performance.now();
      return done();
    },
    { concurrency: 4 },
  );
  await waitFor("30 runs", async () => runs.length >= 30 && (await pendingAll(topic, 1)) === 0);
  assert.equal(runs.length, 30);
  for (const key of keys) {
    const ofKey = runs.filter((run) => run.key === key);
    assert.deepEqual(
      ofKey.map((run) => run.n),
      [0, 1, 2, 3, 4, 5],
      `${key} in order`,
    );
    for (let i = 1; i < ofKey.length; i++) {
      assert.ok(ofKey[i]!.startedAt >= ofKey[i - 1]!.endedAt, `${key}: message ${i} started after ${i - 1} ended`);
    }
  }
  const overlapping = runs.some((x) =>
    runs.some((y) => x.key !== y.key && x.startedAt < y.endedAt && y.startedAt < x.endedAt),
  );
  assert.ok(overlapping, "at least 2 keys ran at once");
  await m.worker.stop();
});

test("PerKey: a failing message runs again in place, its delivery count raised, while its key waits and another key does not", async () => {
  const topic = freshTopic();
  await makeTopic(topic, 1, { ordering: "PerKey", minIdleMs: 200, backoffFactor: 2, backoffMaxMs: 300 });
  const stream = partitionStream(topic, 0);
  const producer = await TopicProducer.connect(server.url, topic);
  const failing = await producer.publish({ name: "a1" }, { key: "a" });
  await producer.publish({ name: "a2" }, { key: "a" });
  await producer.publish({ name: "b1" }, { key: "b" });
  await producer.publish({ name: "b2" }, { key: "b" });
  await producer.close();
  const runs: Run[] = [];
  const deliveries: number[] = [];
  const errors: Array<string | null> = [];
  const m = await member(
    topic,
    "a",
    recording(runs, "a", async (message) => {
      if (message.field("name") !== "a1") return done();
      const [entry] = (await pending(admin, stream, group)).filter((row) => row.id === message.id);
      deliveries.push(entry?.deliveries ?? 0);
      errors.push(await admin.hget(errorsKey(stream, group), message.id));
      if (deliveries.length < 3) throw new Error(`failure ${deliveries.length}`);
      return done();
    }),
    { concurrency: 4 },
  );
  await waitFor("6 runs, nothing pending", async () => runs.length >= 6 && (await pendingAll(topic, 1)) === 0);
  const named = (name: string) => runs.filter((run) => run.name === name);
  const a1 = named("a1");
  assert.equal(a1.length, 3);
  assert.deepEqual(deliveries, [1, 2, 3], "each run in place counted on the server first");
  assert.deepEqual(errors, [null, "Error: failure 1", "Error: failure 2"], "the last error recorded");
  assert.equal(await admin.hget(errorsKey(stream, group), failing.id), null, "removed with the ACK");
  const [first, second, third] = a1 as [Run, Run, Run];
  assert.ok(second.startedAt - first.endedAt >= 190, "the first retry after minIdle");
  assert.ok(third.startedAt - second.endedAt >= 290, "the second after minIdle x 2, at most backoffMaxMs");
  assert.equal(named("a2").length, 1);
  assert.ok(named("a2")[0]!.startedAt >= third.endedAt, "a2 waited for a1");
  for (const name of ["b1", "b2"]) {
    assert.equal(named(name).length, 1);
    assert.ok(named(name)[0]!.endedAt <= second.startedAt, `${name} ran while a1 waited`);
  }
  const stats = await m.worker.stop();
  assert.equal(stats.failed, 2);
  assert.equal(stats.done, 4);
});

test("PerKey: at the cap the entry is no longer leased, and its key goes on once it left the pending list", async () => {
  const topic = freshTopic();
  await makeTopic(topic, 1, { ordering: "PerKey", minIdleMs: 300, maxDeliveries: 2 });
  const stream = partitionStream(topic, 0);
  const producer = await TopicProducer.connect(server.url, topic);
  const capped = await producer.publish({ name: "a1" }, { key: "a" });
  await producer.publish({ name: "a2" }, { key: "a" });
  await producer.close();
  const runs: Run[] = [];
  const m = await member(
    topic,
    "a",
    recording(runs, "a", async (message) => {
      if (message.field("name") === "a1") throw new Error("always");
      return done();
    }),
  );
  await waitFor("a1 to run twice", () => runs.length >= 2);
  // Leased every 100 ms (minIdle / 3) while held: idle past several ticks, it is not any more.
  await waitFor("a1 idle past the lease ticks", async () => {
    const [entry] = (await pending(admin, stream, group)).filter((row) => row.id === capped.id);
    return (entry?.idleMs ?? 0) >= 600;
  });
  assert.deepEqual(
    runs.map((run) => run.name),
    ["a1", "a1"],
    "a2 waits behind the capped a1",
  );
  const [entry] = (await pending(admin, stream, group)).filter((row) => row.id === capped.id);
  assert.equal(entry?.deliveries, 2);
  // The operator's pass dead-letters it: it leaves the pending list.
  await admin.xack(stream, group, capped.id);
  await waitFor("a2 to run", () => runs.some((run) => run.name === "a2"));
  assert.deepEqual(
    runs.map((run) => run.name),
    ["a1", "a1", "a2"],
  );
  await m.worker.stop();
});

test("topics it cannot serve are refused, naming what is wrong", async () => {
  const connectTo = (topic: string, options: Partial<TopicWorkerOptions> = {}) =>
    TopicWorker.connect({ redis: server.url, topic, group, consumer: "a", logger: recordingLogger(), ...options });
  const plain = freshTopic();
  await assert.rejects(connectTo(plain), (error: unknown) => {
    assert.ok(error instanceof NotATopic);
    assert.match(error.message, new RegExp(`"${plain}" is not a topic: .* run a Worker if it is a plain stream`));
    return true;
  });
  await admin.hset(settingsKey(plain, group), "minIdleMs", 1000, "contractVersion", 1);
  await assert.rejects(connectTo(plain), NotATopic);

  const later = freshTopic();
  await admin.hset(settingsKey(later, group), "contractVersion", 3, "partitions", 4);
  await assert.rejects(connectTo(later), (error: unknown) => {
    assert.ok(error instanceof UnknownTopicContract);
    assert.equal(error.version, "3");
    assert.match(error.message, new RegExp(`topic "${later}" is described under worker contract "3"`));
    return true;
  });

  const global = freshTopic();
  await makeTopic(global, 2, { ordering: "Global" });
  await assert.rejects(connectTo(global), (error: unknown) => {
    assert.ok(error instanceof UnknownOrdering);
    assert.match(
      error.message,
      new RegExp(`topic "${global}" has ordering "Global", which this library does not know`),
    );
    return true;
  });

  const fine = freshTopic();
  await makeTopic(fine, 2);
  for (const ttlMs of [999, 86_400_001, 1500.5]) {
    await assert.rejects(connectTo(fine, { ttlMs }), (error: unknown) => {
      assert.ok(error instanceof RangeError);
      assert.match(error.message, new RegExp(`ttlMs must be a whole number of ms, 1000 .. 86400000 .*got ${ttlMs}`));
      return true;
    });
  }
  const worker = await connectTo(fine, { ttlMs: 86_400_000 });
  assert.equal(worker.partitions, 2);
  assert.equal(worker.ordering, "None");
  await worker.stop();
});

test("on a Redis Cluster, two members share the partitions over its shards and each message is handled once", async () => {
  const cluster = await startCluster();
  const redis: RedisTarget = { cluster: [{ host: "127.0.0.1", port: cluster.ports[0]! }] };
  const on = new Cluster([{ host: "127.0.0.1", port: cluster.ports[0]! }]);
  try {
    const topic = freshTopic();
    await makeTopic(topic, 6, {}, on);
    const runs: Run[] = [];
    const a = await member(topic, "a", recording(runs, "a"), { redis });
    const b = await member(topic, "b", recording(runs, "b"), { redis });
    await waitShared(topic, { a, b }, 3, on);
    const keys = Array.from({ length: 30 }, (_, i) => `account-${i}`);
    await publishKeyed(topic, keys, {}, redis);
    await waitFor("30 runs, nothing pending", async () => runs.length >= 30 && (await pendingAll(topic, 6, on)) === 0);
    const now = await owners(topic, on);
    assert.equal(runs.length, 30);
    for (const run of runs) {
      assert.equal(run.partition, partitionOf(run.key ?? "", 6));
      assert.equal(run.member, now[String(run.partition)]);
    }
    const held = await Promise.all(on.nodes("master").map((node) => node.keys(`{${topic}:*}`)));
    assert.ok(held.filter((keys) => keys.length > 0).length >= 2, "the partitions are on more than one shard");
    await Promise.all([a.worker.stop(), b.worker.stop()]);
    assert.deepEqual(await on.hgetall(membersKey(topic, group)), {});
  } finally {
    on.disconnect();
    await cluster.stop();
  }
});
