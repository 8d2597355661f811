/** The producer against a real redis-server: what is in the stream and the rejected hash after each outcome. */
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";
import { Redis } from "ioredis";

import {
  IdempotenceUnsupported,
  Producer,
  PublishFailed,
  PublishOutcomeUnknown,
  PublishRefused,
  PublishUnavailable,
  boundsKey,
  rejectedKey,
} from "../src/index.js";
import { commandTokens } from "../src/producer.js";
import { withScripts } from "../src/scripts.js";
import { startProxy } from "./support/proxy.js";
import { startRedis, type RedisServer } from "./support/server.js";
import { aclUser, createGroup, freshStream, waitFor } from "./support/helpers.js";

let server: RedisServer;
let admin: Redis;
/** Whether the server has `XADD ... IDMP` (Redis 8.6+), and its version, for the skip's reason. */
let idmp: boolean;
let version: string;

before(async () => {
  server = await startRedis();
  admin = server.admin;
  idmp = commandTokens(await admin.call("COMMAND", "DOCS", "XADD"), "xadd").has("IDMP");
  version = /redis_version:(\S+)/.exec(await admin.info("server"))?.[1] ?? "unknown";
});
after(() => server.stop());

function producerFor(stream: string, timeoutMs?: number): Producer {
  return new Producer({ redis: server.url, stream, ...(timeoutMs === undefined ? {} : { timeoutMs }) });
}

test("publish adds the entry with its fields in order", async () => {
  const stream = freshStream();
  const producer = producerFor(stream);
  const id = await producer.publish({ job: "42", size: 7, raw: Buffer.from([0xff]) });
  const pairsId = await producer.publish([
    ["a", "1"],
    ["a", "2"],
  ]);
  await producer.close();
  const entries = await admin.xrangeBuffer(stream, "-", "+");
  assert.deepEqual(
    entries.map(([entryId]) => entryId.toString()),
    [id, pairsId],
  );
  assert.deepEqual(entries[0]?.[1], [
    Buffer.from("job"),
    Buffer.from("42"),
    Buffer.from("size"),
    Buffer.from("7"),
    Buffer.from("raw"),
    Buffer.from([0xff]),
  ]);
  assert.deepEqual(entries[1]?.[1].map(String), ["a", "1", "a", "2"]);
});

test("a full backlog is refused: nothing written, counted in the rejected hash", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, "billing");
  await admin.xadd(stream, "*", "n", "1");
  await admin.xadd(stream, "*", "n", "2");
  await admin.hset(boundsKey(stream), "billing", 2);
  const producer = producerFor(stream);
  const error = await producer.publish({ n: "3" }).then(
    () => assert.fail("published past the bound"),
    (e: unknown) => e,
  );
  await producer.close();
  assert.ok(error instanceof PublishRefused, String(error));
  assert.deepEqual([error.group, error.backlog, error.max, error.certainlyNotWritten], ["billing", 2, 2, true]);
  assert.equal(await admin.xlen(stream), 2);
  assert.deepEqual(await admin.hgetall(rejectedKey(stream)), { billing: "1" });
});

test("a batch is written as far as the bound has room, the rest refused", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, "billing");
  await admin.xadd(stream, "*", "n", "0");
  await admin.hset(boundsKey(stream), "billing", 4);
  const producer = producerFor(stream);
  const published = await producer.publishBatch([1, 2, 3, 4, 5].map((n) => ({ n })));
  await producer.close();
  assert.equal(published.ids.length, 3);
  assert.deepEqual(published.refused, { group: "billing", backlog: 1, max: 4 });
  const entries = await admin.xrange(stream, "-", "+");
  assert.deepEqual(
    entries.map(([, fields]) => fields[1]),
    ["0", "1", "2", "3"],
  );
  assert.deepEqual(
    entries.slice(1).map(([id]) => id),
    published.ids,
  );
  assert.deepEqual(await admin.hgetall(rejectedKey(stream)), { billing: "2" });
});

test("a server error is a failure, certainly not written", async () => {
  const stream = freshStream();
  await admin.set(stream, "not a stream");
  const producer = producerFor(stream);
  const error = await producer.publish({ n: "1" }).catch((e: unknown) => e);
  await producer.close();
  assert.ok(error instanceof PublishFailed, String(error));
  assert.match(error.message, /WRONGTYPE/);
  assert.equal(error.certainlyNotWritten, true);
});

test("a replica refuses with READONLY: unavailable, not failed", async () => {
  const replica = await startRedis(["--replicaof", "127.0.0.1", String(server.port)]);
  try {
    const producer = new Producer({ redis: replica.url, stream: freshStream() });
    const error = await producer.publish({ n: "1" }).catch((e: unknown) => e);
    await producer.close();
    assert.ok(error instanceof PublishUnavailable, String(error));
    assert.match(error.message, /READONLY/);
  } finally {
    await replica.stop();
  }
});

test("no server listening: unavailable at once, nothing queued to be sent later", async () => {
  const unused = await startRedis();
  const port = unused.port;
  await unused.stop();
  const producer = new Producer({ redis: `redis://127.0.0.1:${port}`, stream: freshStream() });
  const error = await producer.publish({ n: "1" }).catch((e: unknown) => e);
  await producer.close();
  assert.ok(error instanceof PublishUnavailable, String(error));
});

test("under the contract's producer ACL (examples/acl/producer.acl): publish, refusal, IDMP detection", async (t) => {
  const stream = freshStream();
  await createGroup(admin, stream, "billing");
  await admin.hset(boundsKey(stream), "billing", 1);
  const url = await aclUser(admin, server.url, "producer.acl", stream);
  if (url === undefined) {
    t.skip("not inside the Pelican repository: no examples/acl to test against");
    return;
  }
  const producer = new Producer({ redis: url, stream });
  await producer.publish({ n: "1" });
  await assert.rejects(producer.publish({ n: "2" }), PublishRefused);
  await admin.hset(boundsKey(stream), "billing", 10);
  await producer.publishBatch([{ n: "2" }, { n: "3" }]);
  if (idmp) await producer.idempotent("p1");
  else await assert.rejects(producer.idempotent("p1"), IdempotenceUnsupported);
  await producer.close();
  assert.equal(await admin.xlen(stream), 3);
  assert.deepEqual(await admin.hgetall(rejectedKey(stream)), { billing: "1" });
});

test("a publish that timed out is an unknown outcome: it may be written (here it is, once)", async () => {
  const stream = freshStream();
  const producer = producerFor(stream, 300);
  await producer.publish({ n: "warm-up" }); // connected, script loaded
  await admin.call("CLIENT", "PAUSE", "1500", "WRITE");
  const error = await producer.publish({ n: "paused" }).catch((e: unknown) => e);
  assert.ok(error instanceof PublishOutcomeUnknown, String(error));
  assert.equal(error.certainlyNotWritten, false);
  await waitFor("the paused publish to run", async () => (await admin.xlen(stream)) === 2, 5000);
  await sleep(500);
  await producer.close();
  assert.equal(await admin.xlen(stream), 2);
});

test("a publish whose reply was lost is written once: the client never resends it", async () => {
  const proxy = await startProxy(server.port);
  try {
    const stream = freshStream();
    const producer = new Producer({ redis: `redis://127.0.0.1:${proxy.port}`, stream });
    await producer.publish({ n: "warm-up" });
    proxy.loseNextReply();
    const error = await producer.publish({ n: "lost reply" }).catch((e: unknown) => e);
    assert.ok(error instanceof PublishOutcomeUnknown, String(error));
    await sleep(1500); // time for a reconnect, and for any resend
    assert.deepEqual(
      (await admin.xrange(stream, "-", "+")).map(([, f]) => f[1]),
      ["warm-up", "lost reply"],
    );
    // The next publish goes through the reconnected connection.
    await producer.publish({ n: "after" });
    await producer.close();

    // The same loss with ioredis' default options writes the entry twice: what the producer's options prevent.
    const naive = withScripts(new Redis(`redis://127.0.0.1:${proxy.port}`));
    const keys = [stream, boundsKey(stream), rejectedKey(stream)];
    await naive.pelicanBoundedPublish(...keys, "n", "naive warm-up");
    proxy.loseNextReply();
    await naive.pelicanBoundedPublish(...keys, "n", "naive lost reply");
    naive.disconnect();
    const naiveEntries = (await admin.xrange(stream, "-", "+"))
      .map(([, f]) => f[1])
      .filter((n) => n?.startsWith("naive"));
    assert.deepEqual(naiveEntries, ["naive warm-up", "naive lost reply", "naive lost reply"]);
  } finally {
    await proxy.close();
  }
});

test("idempotent(): refused clearly on a server without XADD ... IDMP", async (t) => {
  if (idmp) {
    t.skip(`redis-server ${version} has XADD ... IDMP; idempotent publish is tested instead`);
    return;
  }
  const producer = producerFor(freshStream());
  await assert.rejects(producer.idempotent("orders-1"), (error: unknown) => {
    assert.ok(error instanceof IdempotenceUnsupported);
    assert.match(error.message, /Redis 8\.6/);
    return true;
  });
  await producer.close();
});

/**
 * A server with `XADD ... IDMP` (Redis 8.6+): the default one when it has it, else the one `IDMP_REDIS_SERVER` names.
 * Without either the test is skipped, saying so, unless `IDMP_REQUIRED=1` (the repository's scripts/test sets both).
 */
async function idmpServer(): Promise<RedisServer | "default" | undefined> {
  if (idmp) return "default";
  const named = process.env["IDMP_REDIS_SERVER"];
  if (named) return startRedis([], named);
  if (process.env["IDMP_REQUIRED"] === "1") throw new Error("IDMP_REQUIRED=1 but no IDMP_REDIS_SERVER is named");
  return undefined;
}

test("idempotent publish: the same message id is written once and answers the first id", async (t) => {
  const other = await idmpServer();
  if (other === undefined) {
    t.skip(`redis-server ${version} has no XADD ... IDMP (Redis 8.6+) and no IDMP_REDIS_SERVER is named`);
    return;
  }
  const target = other === "default" ? server : other;
  try {
    const stream = freshStream();
    const producer = await new Producer({ redis: target.url, stream }).idempotent("orders-1");
    const first = await producer.publish("order-7", { order: "7" });
    const again = await producer.publish("order-7", { order: "7" });
    const batch = await producer.publishBatch([
      ["order-7", { order: "7" }],
      ["order-8", { order: "8" }],
    ]);
    await producer.close();
    assert.equal(again, first);
    assert.equal(batch.ids[0], first);
    assert.equal(await target.admin.xlen(stream), 2);
  } finally {
    if (other !== "default") await other.stop();
  }
});
