/** The conformance worker, run from the repository root as the suite runs it: its lines, its exits, its writes. */
import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { fileURLToPath } from "node:url";
import { after, before, test } from "node:test";
import { Cluster } from "ioredis";

import {
  TopicProducer,
  errorsKey,
  membersKey,
  partitionOf,
  partitionStream,
  settingsKey,
  terminalKey,
  topicKey,
} from "../src/index.js";
import { createGroup, freshStream, pending, waitFor } from "./support/helpers.js";
import { startCluster, startRedis, type RedisServer } from "./support/server.js";

const program = fileURLToPath(new URL("../conformance/worker.js", import.meta.url));
const group = "conformance";

let server: RedisServer;
before(async () => (server = await startRedis()));
after(() => server.stop());

interface Line {
  id: string;
  consumer: string;
  outcome: string;
  ms: number;
  partition?: number;
  key?: string | null;
  startedAt?: number;
  endedAt?: number;
}

/** The program on `stream` (or, with `env` saying `TOPIC`, on a topic). */
function startWorker(
  stream: string,
  consumer: string,
  env: Record<string, string> = { STREAM: stream },
): { child: ChildProcess; lines: Line[]; exited: Promise<number | null> } {
  const child = spawn(process.execPath, [program], {
    env: {
      ...process.env,
      REDIS_URL: server.url,
      REDIS_CLUSTER: "",
      GROUP: group,
      CONSUMER: consumer,
      SHUTDOWN_GRACE_MS: "500",
      ...env,
    },
    stdio: ["ignore", "pipe", "ignore"],
  });
  const lines: Line[] = [];
  let buffered = "";
  child.stdout?.on("data", (data: Buffer) => {
    buffered += data.toString();
    const complete = buffered.split("\n");
    buffered = complete.pop() ?? "";
    for (const line of complete) lines.push(JSON.parse(line) as Line);
  });
  const exited = new Promise<number | null>((resolve) => child.once("exit", (code) => resolve(code)));
  return { child, lines, exited };
}

test("each outcome as the message asks, one JSON line per run; SIGTERM gives back and exits 0", async () => {
  const admin = server.admin;
  const stream = freshStream();
  await createGroup(admin, stream, group, { minIdleMs: 60_000, retryAfterMs: 45_000, maxDeliveries: 5 });
  const asked = ["done", "retry", "fail", "terminal:RecordNotFound"];
  const ids: string[] = [];
  for (const handle of asked) ids.push((await admin.xadd(stream, "*", "handle", handle, "ms", "20")) ?? "");
  const { child, lines, exited } = startWorker(stream, "c1");
  await waitFor("four lines", () => lines.length === 4);
  const outcomes = ["done", "retry", "fail", "terminal"];
  assert.deepEqual(
    [...lines].sort((a, b) => ids.indexOf(a.id) - ids.indexOf(b.id)),
    ids.map((id, i) => ({ id, consumer: "c1", outcome: outcomes[i], ms: 20 })),
  );
  await waitFor("the outcomes written", async () => (await pending(admin, stream, group)).length === 2);
  assert.deepEqual(await admin.hgetall(terminalKey(stream, group)), { RecordNotFound: "1" });
  assert.deepEqual(Object.keys(await admin.hgetall(errorsKey(stream, group))), [ids[2]]);

  const slow = (await admin.xadd(stream, "*", "handle", "done", "ms", "10000")) ?? "";
  await waitFor("the slow message in flight", async () =>
    (await pending(admin, stream, group)).some((e) => e.id === slow),
  );
  const signalled = Date.now();
  child.kill("SIGTERM");
  assert.equal(await exited, 0);
  assert.ok(Date.now() - signalled < 5000, `exited ${Date.now() - signalled} ms after SIGTERM`);
  const given = (await pending(admin, stream, group)).find((e) => e.id === slow);
  assert.deepEqual([given?.consumer, given?.deliveries], ["", 0]);
  assert.ok((given?.idleMs ?? 0) >= 45_000);
});

test("with an OTLP endpoint, the run's span is exported before the exit after SIGTERM", async () => {
  const exports: { path: string | undefined; contentType: string | undefined; body: Buffer }[] = [];
  const collector = createServer((request, response) => {
    const chunks: Buffer[] = [];
    request.on("data", (chunk: Buffer) => chunks.push(chunk));
    request.on("end", () => {
      exports.push({ path: request.url, contentType: request.headers["content-type"], body: Buffer.concat(chunks) });
      response.writeHead(200).end();
    });
  });
  await new Promise<void>((resolve) => collector.listen(0, "127.0.0.1", resolve));
  try {
    const admin = server.admin;
    const stream = freshStream();
    await createGroup(admin, stream, group, { minIdleMs: 60_000, retryAfterMs: 45_000, maxDeliveries: 5 });
    const traceId = "0af7651916cd43dd8448eb211c80319c";
    const traceparent = `00-${traceId}-b7ad6b7169203331-01`;
    const id = await admin.xadd(stream, "*", "handle", "done", "traceparent", traceparent);
    // The batch processor's first export is 5 s away: only the flush at the exit can send the span in time.
    const endpoint = `http://127.0.0.1:${(collector.address() as AddressInfo).port}`;
    const { child, lines, exited } = startWorker(stream, "c1", {
      STREAM: stream,
      OTEL_EXPORTER_OTLP_ENDPOINT: endpoint,
      OTEL_SERVICE_NAME: "",
    });
    await waitFor("the run", () => lines.length === 1);
    assert.deepEqual(lines, [{ id, consumer: "c1", outcome: "done", ms: 0 }]);
    child.kill("SIGTERM");
    assert.equal(await exited, 0);
    assert.equal(exports.length, 1, "the worker exited without exporting its spans");
    const [sent] = exports;
    assert.deepEqual([sent?.path, sent?.contentType], ["/v1/traces", "application/x-protobuf"]);
    // The protobuf holds the trace id as its 16 bytes, the names as text.
    for (const wanted of [
      Buffer.from(traceId, "hex"),
      Buffer.from(`process ${stream}`),
      Buffer.from("pelican-conformance-typescript"),
    ]) {
      assert.ok(sent?.body.includes(wanted), `the export (${sent?.body.length} bytes) lacks ${wanted.toString("hex")}`);
    }
  } finally {
    collector.close();
  }
});

test("exit: the line is printed, then the process exits 3 at once, the message left pending", async () => {
  const admin = server.admin;
  const stream = freshStream();
  await createGroup(admin, stream, group, { minIdleMs: 60_000, retryAfterMs: 45_000, maxDeliveries: 5 });
  const id = await admin.xadd(stream, "*", "handle", "exit", "ms", "0");
  const { lines, exited } = startWorker(stream, "c2");
  assert.equal(await exited, 3);
  assert.deepEqual(lines, [{ id, consumer: "c2", outcome: "exit", ms: 0 }]);
  assert.deepEqual(
    (await pending(admin, stream, group)).map((e) => [e.id, e.consumer]),
    [[id, "c2"]],
  );
});

test("an operator speaking an unknown contract version: the process exits 4, nothing handled", async () => {
  const admin = server.admin;
  const stream = freshStream();
  await createGroup(admin, stream, group, { minIdleMs: 60_000, retryAfterMs: 45_000, contractVersion: 2 });
  await admin.xadd(stream, "*", "handle", "done", "ms", "0");
  const { lines, exited } = startWorker(stream, "c3");
  assert.equal(await exited, 4);
  assert.deepEqual(lines, []);
  assert.deepEqual(await pending(admin, stream, group), []);
});

test("TOPIC: a member of the topic's group; each line says the partition, the key and when the handler ran", async () => {
  const admin = server.admin;
  const topic = freshStream("topic");
  const settings = { contractVersion: 2, partitions: 2, minIdleMs: 60_000, retryAfterMs: 45_000, maxDeliveries: 5 };
  await admin.hset(topicKey(topic), "partitions", 2, "contractVersion", 2);
  await admin.hset(settingsKey(topic, group), settings);
  for (const p of [0, 1]) {
    await createGroup(admin, partitionStream(topic, p), group, settings);
  }
  const producer = await TopicProducer.connect(server.url, topic);
  const keys = ["a", "b", "c", "d"];
  const before = Date.now();
  // Entries of two partitions may have the same id: each is known by both.
  const where = (partition: number | undefined, id: string): string => `${partition}/${id}`;
  const published = new Map<string, string>();
  for (const key of keys) {
    const { partition, id } = await producer.publish({ handle: "done", ms: "30" }, { key });
    published.set(where(partition, id), key);
  }
  const unkeyed = await producer.publish({ handle: "done", ms: "0" });
  await producer.close();
  const { child, lines, exited } = startWorker("", "m1", { TOPIC: topic, MEMBERSHIP_TTL_MS: "1000" });
  await waitFor("five lines", () => lines.length === 5);
  for (const line of lines) {
    const key = published.get(where(line.partition, line.id)) ?? null;
    const partition = key === null ? unkeyed.partition : partitionOf(key, 2);
    if (key === null) assert.equal(line.id, unkeyed.id);
    assert.deepEqual(
      { ...line, startedAt: 0, endedAt: 0 },
      {
        id: line.id,
        consumer: "m1",
        outcome: "done",
        ms: key === null ? 0 : 30,
        partition,
        key,
        startedAt: 0,
        endedAt: 0,
      },
    );
    const { startedAt = 0, endedAt = 0 } = line;
    // A timer may fire a millisecond before the wall clock moved on by its whole delay.
    assert.ok(before <= startedAt && startedAt + line.ms - 1 <= endedAt && endedAt <= Date.now(), JSON.stringify(line));
  }
  child.kill("SIGTERM");
  assert.equal(await exited, 0);
  assert.deepEqual(await admin.hgetall(membersKey(topic, group)), {}, "it left the group");
});

test("TOPIC: a topic it refuses (no policy describes it) exits 4", async () => {
  const { lines, exited } = startWorker("", "m2", { TOPIC: freshStream("nothing") });
  assert.equal(await exited, 4);
  assert.deepEqual(lines, []);
});

test("REDIS_CLUSTER=1 TOPIC: a member through the library's Cluster connections", async () => {
  const cluster = await startCluster();
  const node = { host: "127.0.0.1", port: cluster.ports[0]! };
  const on = new Cluster([node]);
  try {
    const topic = freshStream("topic");
    const settings = { contractVersion: 2, partitions: 3, minIdleMs: 60_000, retryAfterMs: 45_000, maxDeliveries: 5 };
    await on.hset(topicKey(topic), "partitions", 3, "contractVersion", 2);
    await on.hset(settingsKey(topic, group), settings);
    for (const p of [0, 1, 2]) {
      await on.xgroup("CREATE", partitionStream(topic, p), group, "0", "MKSTREAM");
      await on.hset(settingsKey(partitionStream(topic, p), group), settings);
    }
    const producer = await TopicProducer.connect({ cluster: [node] }, topic);
    for (const key of ["x", "y", "z"]) await producer.publish({ handle: "done", ms: "0" }, { key });
    await producer.close();
    const { child, lines, exited } = startWorker("", "m3", {
      TOPIC: topic,
      REDIS_URL: `redis://127.0.0.1:${node.port}`,
      REDIS_CLUSTER: "1",
    });
    await waitFor("three lines", () => lines.length === 3);
    assert.deepEqual(
      lines.map((line) => [line.key, line.partition, line.outcome]).sort(),
      ["x", "y", "z"].map((key) => [key, partitionOf(key, 3), "done"]),
    );
    child.kill("SIGTERM");
    assert.equal(await exited, 0);
  } finally {
    on.disconnect();
    await cluster.stop();
  }
});
