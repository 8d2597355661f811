/**
 * A topic beside one stream, on one server: the publish rate (one message after another, a key each of 1,000) and
 * the consume rate (one member, or one worker, at concurrency 16, a handler that does nothing) of a plain stream and
 * of topics of 1 and 8 partitions. `npm run bench:topic` (REDIS_URL to use a running server, else one is started on
 * a free loopback port; N messages a case, ROUNDS rounds, each running every case in turn; the medians are printed).
 *
 * The topic's settings are written here as the operator writes them (the tests' `makeTopic` lives in a test file).
 * Every message carries its number: the consume rate counts the messages a handler saw exactly once, timed from
 * connecting (a member's join included) until each was seen; the messages seen more than once are printed.
 */
import { setTimeout as sleep } from "node:timers/promises";
import { Redis } from "ioredis";

import {
  KEY_FIELD,
  Producer,
  TopicProducer,
  TopicWorker,
  Worker,
  done,
  partitionStream,
  settingsKey,
  topicKey,
  type Message,
  type Ordering,
} from "../src/index.js";
import { startRedis } from "../test/support/server.js";

const N = Number(process.env["N"] ?? 20_000);
const ROUNDS = Number(process.env["ROUNDS"] ?? 3);
const KEYS = 1_000;
const CONCURRENCY = 16;
const GROUP = "g";
/** A case that has not seen every message after this long fails the run. */
const TIMEOUT_MS = 120_000;
const quiet = { info: () => undefined, warn: () => undefined, error: () => undefined };

/** `partitions` undefined: a plain stream. The rates of each round, and the messages seen more than once. */
interface Case {
  label: string;
  partitions: number | undefined;
  ordering: Ordering;
  published: number[];
  consumed: number[];
  seenAgain: number;
}

const cases: Case[] = (
  [
    ["one stream", undefined, "None"],
    ["topic, 1 partition PerKey", 1, "PerKey"],
    ["topic, 8 partitions PerKey", 8, "PerKey"],
    ["topic, 8 partitions None", 8, "None"],
  ] as const
).map(([label, partitions, ordering]) => ({
  label,
  partitions,
  ordering,
  published: [],
  consumed: [],
  seenAgain: 0,
}));

/** The settings the operator writes for the case's stream or topic, and the group on every stream. */
async function declare(admin: Redis, stream: string, { partitions, ordering }: Case): Promise<void> {
  const common = { minIdleMs: 30_000, retryAfterMs: 1000, maxDeliveries: 5 };
  if (partitions === undefined) {
    await admin.hset(settingsKey(stream, GROUP), { ...common, contractVersion: 1 });
    await admin.xgroup("CREATE", stream, GROUP, "0", "MKSTREAM");
    return;
  }
  const fields = { ...common, contractVersion: 2, partitions, ordering, backoffFactor: 1, backoffMaxMs: 0 };
  await admin.hset(settingsKey(stream, GROUP), fields);
  for (let p = 0; p < partitions; p++) {
    await admin.hset(settingsKey(partitionStream(stream, p), GROUP), fields);
    await admin.xgroup("CREATE", partitionStream(stream, p), GROUP, "0", "MKSTREAM");
  }
  await admin.hset(topicKey(stream), "partitions", partitions, "contractVersion", 2);
}

/** Publishes N messages one after another, message n with key n % KEYS; messages per second. */
async function publish(url: string, stream: string, topic: boolean): Promise<number> {
  const began = performance.now();
  if (topic) {
    const producer = await TopicProducer.connect(url, stream);
    for (let n = 0; n < N; n++) await producer.publish({ n }, { key: `key-${n % KEYS}` });
    await producer.close();
  } else {
    const producer = new Producer({ redis: url, stream });
    for (let n = 0; n < N; n++)
      await producer.publish([
        [KEY_FIELD, `key-${n % KEYS}`],
        ["n", n],
      ]);
    await producer.close();
  }
  return N / ((performance.now() - began) / 1000);
}

/**
 * Runs one member (a topic) or one worker (a stream) until a handler saw every message; the messages seen exactly
 * once per second.
 */
async function consume(url: string, stream: string, each: Case): Promise<number> {
  const sights = new Uint32Array(N);
  let seen = 0;
  let allSeen: () => void = () => undefined;
  const everySeen = new Promise<void>((resolve) => (allSeen = resolve));
  const handler = async (message: Message) => {
    const n = Number(message.field("n"));
    sights[n] = (sights[n] ?? 0) + 1;
    if (sights[n] === 1 && ++seen === N) allSeen();
    return done();
  };
  const options = { redis: url, group: GROUP, consumer: "m1", concurrency: CONCURRENCY, blockMs: 50, logger: quiet };
  const began = performance.now();
  const worker =
    each.partitions === undefined
      ? new Worker({ ...options, stream })
      : await TopicWorker.connect({ ...options, topic: stream, ttlMs: 3000 });
  const running = worker.run(handler);
  const timeout = new AbortController();
  await Promise.race([
    everySeen,
    sleep(TIMEOUT_MS, undefined, { signal: timeout.signal }).then(() => {
      throw new Error(`${stream}: ${seen} of ${N} messages seen after ${TIMEOUT_MS} ms`);
    }),
  ]);
  const seconds = (performance.now() - began) / 1000;
  timeout.abort();
  await worker.stop();
  await running;
  const once = sights.filter((count) => count === 1).length;
  each.seenAgain += N - once;
  return once / seconds;
}

function median(values: number[]): number {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.floor(sorted.length / 2)] ?? Number.NaN;
}

const external = process.env["REDIS_URL"];
const server = external ? undefined : await startRedis();
const url = external ?? server?.url ?? "";
const admin = server?.admin ?? new Redis(url);
const version = /redis_version:(\S+)/.exec(await admin.info("server"))?.[1];
console.log(
  `${N} messages a case, ${KEYS} keys, one member / worker at concurrency ${CONCURRENCY}, redis-server ${version}, ` +
    `node ${process.version}; medians of ${ROUNDS} rounds, each running every case in turn`,
);
for (let round = 0; round < ROUNDS; round++) {
  for (const [i, each] of cases.entries()) {
    const stream = `topic-bench-${process.pid}-${round}-${i}`;
    await declare(admin, stream, each);
    each.published.push(await publish(url, stream, each.partitions !== undefined));
    each.consumed.push(await consume(url, stream, each));
  }
}
console.log("| case | publish msgs/s | consume msgs/s | messages seen more than once |");
console.log("| --- | --- | --- | --- |");
for (const each of cases) {
  const [published, consumed] = [median(each.published), median(each.consumed)].map(Math.round);
  console.log(`| ${each.label} | ${published} | ${consumed} | ${each.seenAgain} |`);
}
if (server) await server.stop();
else admin.disconnect();
