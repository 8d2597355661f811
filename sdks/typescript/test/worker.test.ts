/** The worker against a real redis-server: every assertion is on the server's state (PEL, hashes) or the handler. */
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { after, before, test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";
import type { Redis } from "ioredis";
import * as promClient from "prom-client";

import {
  ContractVersionError,
  Worker,
  consumersKey,
  done,
  errorsKey,
  retry,
  settingsKey,
  terminal,
  terminalKey,
  type Handler,
  type WorkerOptions,
} from "../src/index.js";
import { registerWorkerMetrics } from "../src/metrics.js";
import { startProxy } from "./support/proxy.js";
import { startRedis, type RedisServer } from "./support/server.js";
import { aclUser, createGroup, freshStream, pending, recordingLogger, waitFor } from "./support/helpers.js";

let server: RedisServer;
let admin: Redis;
const group = "workers";

before(async () => {
  server = await startRedis();
  admin = server.admin;
});
after(() => server.stop());

function workerFor(stream: string, options: Partial<WorkerOptions> = {}): Worker {
  return new Worker({
    redis: server.url,
    stream,
    group,
    consumer: "w1",
    blockMs: 200,
    logger: recordingLogger(),
    ...options,
  });
}

/** Runs `handler` until the test is over; `stop()` is the test's. */
function start(worker: Worker, handler: Handler): Promise<unknown> {
  const running = worker.run(handler);
  running.catch(() => undefined);
  return running;
}

/** The give-back's script as the package ships it, and its SHA1 (what `EVALSHA` names). */
const GIVE_BACK_LUA = readFileSync(new URL("../../scripts/give_back.lua", import.meta.url), "utf8");
const GIVE_BACK_SHA = createHash("sha1").update(GIVE_BACK_LUA).digest("hex");
const SETTINGS = { minIdleMs: 60_000, retryAfterMs: 60_000, maxDeliveries: 5 };

test("done acknowledges; the last error of a retried copy goes with its ACK", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, SETTINGS);
  const first = await admin.xadd(stream, "*", "n", "1");
  const copy = await admin.xadd(stream, "*", "n", "2", "pelican-origin-id", "0-1", "pelican-deliveries", "1");
  assert.ok(first && copy);
  await admin.hset(errorsKey(stream, group), copy, "an earlier failure", "0-1", "another entry's");
  const seen: string[] = [];
  const worker = workerFor(stream);
  start(worker, async (message) => {
    seen.push(message.id);
    assert.equal(message.field("pelican-deliveries"), message.id === copy ? "1" : undefined);
    return done();
  });
  await waitFor("two ACKs", () => worker.stats().done === 2);
  const stats = await worker.stop();
  assert.deepEqual(seen, [first, copy]);
  assert.deepEqual(await pending(admin, stream, group), []);
  assert.deepEqual(await admin.hgetall(errorsKey(stream, group)), { "0-1": "another entry's" });
  assert.deepEqual(stats, { done: 2, terminal: 0, failed: 0, retried: 0, abandoned: 0, inFlight: 0 });
});

test("terminal acknowledges and counts by reason; an invalid reason fails the message instead", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, SETTINGS);
  await admin.xadd(stream, "*", "reason", "RecordNotFound");
  const invalid = await admin.xadd(stream, "*", "reason", "record not found");
  const worker = workerFor(stream);
  start(worker, async (message) => terminal(message.field("reason") ?? ""));
  await waitFor("both handled", () => worker.stats().terminal + worker.stats().failed === 2);
  await worker.stop();
  assert.deepEqual(await admin.hgetall(terminalKey(stream, group)), { RecordNotFound: "1" });
  const left = await pending(admin, stream, group);
  assert.deepEqual(
    left.map((e) => e.id),
    [invalid],
  );
  const text = await admin.hget(errorsKey(stream, group), invalid ?? "");
  assert.match(
    text ?? "",
    /^InvalidReasonError: invalid terminal reason "record not found": a reason must be CamelCase/,
  );
});

test("a failure records the error, leaves the entry pending, and is not read again here", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, SETTINGS);
  const id = await admin.xadd(stream, "*", "n", "1");
  await admin.hset(settingsKey(stream, group), "minIdleMs", 600); // a lease tick, and a look for hand-overs, every 200 ms
  let calls = 0;
  const worker = workerFor(stream);
  start(worker, async () => {
    calls++;
    throw new Error("the database is down");
  });
  await waitFor("the failure", () => worker.stats().failed === 1);
  await sleep(1500); // several looks at the own PEL
  const stats = await worker.stop();
  assert.equal(calls, 1);
  assert.equal(stats.failed, 1);
  const [entry, ...rest] = await pending(admin, stream, group);
  assert.deepEqual(rest, []);
  assert.deepEqual([entry?.id, entry?.consumer, entry?.deliveries], [id, "w1", 1]);
  assert.ok((entry?.idleMs ?? 0) >= 1400, `idle ${entry?.idleMs}: nobody touched it`);
  assert.equal(await admin.hget(errorsKey(stream, group), id ?? ""), "Error: the database is down");
});

test("an error text is cut to 1,024 bytes at a character boundary", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, SETTINGS);
  const id = await admin.xadd(stream, "*", "n", "1");
  const worker = workerFor(stream);
  start(worker, async () => {
    throw new Error("é".repeat(1000));
  });
  await waitFor("the failure", () => worker.stats().failed === 1);
  await worker.stop();
  const text = await admin.hgetBuffer(errorsKey(stream, group), id ?? "");
  assert.equal(text?.length, 1023); // "Error: " is 7 bytes, then 508 two-byte characters
  assert.ok(text?.toString("utf8").endsWith("é"));
});

test("retry gives the entry back counted, idle minIdleMs, for the pass", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, { ...SETTINGS, minIdleMs: 45_000 });
  const id = await admin.xadd(stream, "*", "n", "1");
  let calls = 0;
  const worker = workerFor(stream);
  start(worker, async () => {
    calls++;
    return retry();
  });
  await waitFor("the retry", () => worker.stats().retried === 1);
  await worker.stop();
  assert.equal(calls, 1);
  const [entry] = await pending(admin, stream, group);
  assert.deepEqual([entry?.id, entry?.consumer, entry?.deliveries], [id, "w1", 1]);
  assert.ok((entry?.idleMs ?? 0) >= 45_000 && (entry?.idleMs ?? 0) < 50_000, `idle ${entry?.idleMs}`);
});

test("the own PEL is read first; an entry whose payload was deleted is skipped", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, SETTINGS);
  const before = await admin.xadd(stream, "*", "n", "before a restart");
  const deleted = await admin.xadd(stream, "*", "n", "deleted");
  await admin.xreadgroup("GROUP", group, "w1", "COUNT", 2, "STREAMS", stream, ">");
  await admin.xdel(stream, deleted ?? "");
  const fresh = await admin.xadd(stream, "*", "n", "new");
  const seen: string[] = [];
  const worker = workerFor(stream, { concurrency: 1 });
  start(worker, async (message) => {
    seen.push(message.id);
    return done();
  });
  await waitFor("two handled", () => worker.stats().done === 2);
  await worker.stop();
  assert.deepEqual(seen, [before, fresh]);
  // The stale reference stays for the pass to drop.
  assert.deepEqual(
    (await pending(admin, stream, group)).map((e) => e.id),
    [deleted],
  );
});

test("concurrency bounds the handlers running at once", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, SETTINGS);
  for (let i = 0; i < 20; i++) await admin.xadd(stream, "*", "n", String(i));
  let running = 0;
  let most = 0;
  const worker = workerFor(stream, { concurrency: 4 });
  start(worker, async () => {
    most = Math.max(most, ++running);
    await sleep(50);
    running--;
    return done();
  });
  await waitFor("20 handled", () => worker.stats().done === 20);
  await worker.stop();
  assert.equal(most, 4);
});

test("the acknowledgements ride on the next read, and a read fetches for every slot its handlers freed", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, SETTINGS);
  for (let i = 0; i < 64; i++) await admin.xadd(stream, "*", "n", String(i));
  const seen: Array<{ source: string; args: string[] }> = [];
  const monitor = await admin.monitor();
  monitor.on("monitor", (_time: string, args: string[], source: string) => {
    if (args[1] === stream || args.includes(stream)) seen.push({ source, args });
  });
  try {
    const worker = workerFor(stream, { concurrency: 16 });
    start(worker, async (message) => {
      // Handlers that end a few turns apart, without waiting for anything outside the process.
      for (let i = Number(message.field("n")) % 8; i > 0; i--) await Promise.resolve();
      return done();
    });
    await waitFor("64 handled", () => worker.stats().done === 64);
    await worker.stop();
  } finally {
    monitor.disconnect();
  }
  const reads = seen.filter(({ args }) => args[0]?.toUpperCase() === "XREADGROUP" && args.at(-1) === ">");
  const acks = seen.filter(({ args }) => args[0]?.toUpperCase() === "XACK");
  assert.ok(reads.length > 0);
  // Every read of new entries asks for all 16 slots: the handlers a read started have ended before the next counts.
  assert.deepEqual(new Set(reads.map(({ args }) => args[args.indexOf("COUNT") + 1])), new Set(["16"]));
  // One XACK a read's batch, sent by the reading connection with the next read: one round trip for both.
  assert.equal(acks.length, 4);
  assert.ok(acks.every(({ source }) => source === reads[0]?.source));
  assert.deepEqual(await pending(admin, stream, group), []);
});

/** The entry's idle time every 100 ms from `from` until `until` (ms since the epoch). */
async function idleSamples(stream: string, id: string, from: number, until: number): Promise<number[]> {
  const samples: number[] = [];
  while (Date.now() < until) {
    if (Date.now() >= from) {
      const entry = (await pending(admin, stream, group)).find((e) => e.id === id);
      if (entry) samples.push(entry.idleMs);
    }
    await sleep(100);
  }
  return samples;
}

test("leases keep a handler slower than minIdle from looking idle; it runs once", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, { ...SETTINGS, minIdleMs: 900 });
  const id = (await admin.xadd(stream, "*", "n", "slow")) ?? "";
  let calls = 0;
  const worker = workerFor(stream);
  start(worker, async () => {
    calls++;
    await sleep(3000);
    return done();
  });
  await waitFor("the handler", () => calls === 1);
  const samples = await idleSamples(stream, id, 0, Date.now() + 2700);
  await waitFor("the ACK", () => worker.stats().done === 1);
  await worker.stop();
  assert.ok(samples.length >= 15, `${samples.length} samples`);
  assert.ok(Math.max(...samples) < 900, `idle times ${samples.join(" ")}`);
  assert.equal(calls, 1);
});

test("the settings are re-read at each tick: a lowered minIdle is leased at its new pace", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, { ...SETTINGS, minIdleMs: 3000 }); // a lease every second
  const id = (await admin.xadd(stream, "*", "n", "slow")) ?? "";
  const worker = workerFor(stream);
  let started = 0;
  start(worker, async () => {
    started = Date.now();
    await sleep(4000);
    return done();
  });
  await waitFor("the handler", () => started > 0);
  await admin.hset(settingsKey(stream, group), "minIdleMs", 600); // a lease every 200 ms
  const samples = await idleSamples(stream, id, started + 1600, started + 3800);
  await worker.stop();
  assert.ok(samples.length >= 10, `${samples.length} samples`);
  assert.ok(Math.max(...samples) < 600, `idle times ${samples.join(" ")}`);
});

test("past maxHandlingMs the lease is no longer extended, said once", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, { ...SETTINGS, minIdleMs: 600 });
  const id = (await admin.xadd(stream, "*", "n", "stuck")) ?? "";
  const logger = recordingLogger();
  const worker = workerFor(stream, { maxHandlingMs: 700, logger });
  let started = 0;
  start(worker, async () => {
    started = Date.now();
    await sleep(2500);
    return done();
  });
  await waitFor("the handler", () => started > 0);
  await sleep(2000);
  const [entry] = await pending(admin, stream, group);
  assert.equal(entry?.id, id);
  assert.ok((entry?.idleMs ?? 0) >= 900, `idle ${entry?.idleMs}: still leased`);
  await worker.stop();
  assert.equal(logger.lines.filter((line) => line.includes("after maxHandlingMs")).length, 1);
});

test("stop lets handlers finish within the grace, leasing meanwhile", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, { ...SETTINGS, minIdleMs: 600 });
  await admin.xadd(stream, "*", "n", "1");
  const worker = workerFor(stream, { shutdownGraceMs: 5000 });
  start(worker, async () => {
    await sleep(1500);
    return done();
  });
  await waitFor("the handler", () => worker.stats().inFlight === 1);
  const stats = await worker.stop();
  assert.deepEqual([stats.done, stats.abandoned], [1, 0]);
  assert.deepEqual(await pending(admin, stream, group), []);
});

test("stop gives back what the grace cut off: no owner, the delivery uncounted, idle retryAfterMs", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, { ...SETTINGS, retryAfterMs: 45_000 });
  const id = await admin.xadd(stream, "*", "n", "long");
  const worker = workerFor(stream, { shutdownGraceMs: 300 });
  let aborted = false;
  start(worker, async (_message, { signal }) => {
    await new Promise((resolve) => signal.addEventListener("abort", resolve));
    aborted = true;
    return done(); // too late: not written
  });
  await waitFor("the handler", () => worker.stats().inFlight === 1);
  assert.deepEqual(
    (await pending(admin, stream, group)).map((e) => [e.consumer, e.deliveries]),
    [["w1", 1]],
  );
  const began = Date.now();
  const stats = await worker.stop();
  assert.ok(Date.now() - began < 3000, `stopped in ${Date.now() - began} ms`);
  assert.equal(aborted, true);
  assert.deepEqual([stats.abandoned, stats.done], [1, 0]);
  const [entry] = await pending(admin, stream, group);
  assert.deepEqual([entry?.id, entry?.consumer, entry?.deliveries], [id, "", 0]);
  assert.ok((entry?.idleMs ?? 0) >= 45_000, `idle ${entry?.idleMs}`);
});

test("a blocking read in flight when the stop comes is awaited, and what it brought given back unhandled", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, { ...SETTINGS, retryAfterMs: 45_000 });
  let calls = 0;
  const worker = workerFor(stream, { blockMs: 3000 });
  start(worker, async () => {
    calls++;
    return done();
  });
  await sleep(500); // the blocking read is waiting at the server
  const stopped = worker.stop();
  const id = await admin.xadd(stream, "*", "n", "arrives during the stop");
  const stats = await stopped;
  assert.equal(calls, 0);
  assert.equal(stats.abandoned, 1);
  const [entry] = await pending(admin, stream, group);
  assert.deepEqual([entry?.id, entry?.consumer, entry?.deliveries], [id, "", 0]);
  assert.ok((entry?.idleMs ?? 0) >= 45_000, `idle ${entry?.idleMs}`);
});

/** The consumers of the group, by name. */
async function consumers(stream: string): Promise<string[]> {
  const rows = (await admin.xinfo("CONSUMERS", stream, group)) as unknown[][];
  return rows.map((row) => String(row[row.indexOf("name") + 1]));
}

test("a worker that leaves deletes its consumer once it owns nothing; not while it owns a failure", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, SETTINGS);
  await admin.xadd(stream, "*", "n", "ok");
  const first = workerFor(stream);
  start(first, async () => done());
  await waitFor("the ACK", () => first.stats().done === 1);
  assert.deepEqual(await consumers(stream), ["w1"]);
  await first.stop();
  assert.deepEqual(await consumers(stream), []);

  await admin.xadd(stream, "*", "n", "bad");
  const second = workerFor(stream);
  start(second, async () => {
    throw new Error("bad");
  });
  await waitFor("the failure", () => second.stats().failed === 1);
  await second.stop();
  assert.deepEqual(await consumers(stream), ["w1"]);
  assert.equal((await pending(admin, stream, group)).length, 1);
});

test("under the contract's worker ACL (examples/acl/worker.acl) every outcome and the shutdown work", async (t) => {
  const stream = freshStream();
  await createGroup(admin, stream, group, { ...SETTINGS, minIdleMs: 600, retryAfterMs: 45_000 });
  const url = await aclUser(admin, server.url, "worker.acl", stream, group);
  if (url === undefined) {
    t.skip("not inside the Pelican repository: no examples/acl to test against");
    return;
  }
  for (const handle of ["done", "fail", "terminal", "retry", "slow"]) await admin.xadd(stream, "*", "handle", handle);
  const logger = recordingLogger();
  const worker = new Worker({ redis: url, stream, group, consumer: "w1", blockMs: 200, shutdownGraceMs: 1500, logger });
  start(worker, async (message, { signal }) => {
    switch (message.field("handle")) {
      case "done":
        return done();
      case "terminal":
        return terminal("RecordNotFound");
      case "retry":
        return retry();
      case "slow":
        await sleep(5000, undefined, { signal }).catch(() => undefined);
        return done();
      default:
        throw new Error("bad");
    }
  });
  await waitFor("four outcomes", () => {
    const stats = worker.stats();
    return stats.done + stats.failed + stats.terminal + stats.retried === 4;
  });
  await sleep(1000); // leases of the slow one meanwhile
  const stats = await worker.stop();
  assert.deepEqual(
    logger.lines.filter((line) => /NOPERM|could not|refused|cannot/.test(line)),
    [],
  );
  assert.deepEqual([stats.done, stats.failed, stats.terminal, stats.retried, stats.abandoned], [1, 1, 1, 1, 1]);
  assert.deepEqual(await admin.hgetall(terminalKey(stream, group)), { RecordNotFound: "1" });
  const left = await pending(admin, stream, group);
  assert.deepEqual(
    left.map((e) => [e.consumer, e.deliveries]),
    [
      ["w1", 1],
      ["w1", 1],
      ["", 0],
    ],
  );
});

test("a hand-over is taken up: leased, read with XRANGE and handled", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, SETTINGS);
  const id = await admin.xadd(stream, "*", "n", "handed over");
  await admin.xreadgroup("GROUP", group, "other", "COUNT", 1, "STREAMS", stream, ">");
  await admin.hset(settingsKey(stream, group), "minIdleMs", 600); // a lease tick every 200 ms
  const seen: string[] = [];
  // An idle worker: its blocking read (5 s) is not what finds the hand-over.
  const worker = workerFor(stream, { blockMs: 5000 });
  start(worker, async (message) => {
    seen.push(`${message.id} ${message.field("n")}`);
    return done();
  });
  await leaseTicks(stream, 2);
  assert.deepEqual(seen, []);
  // What the operator's Reassign pass does: the entry moves to this worker's name, its delivery counted.
  await admin.xclaim(stream, group, "w1", 0, id ?? "", "RETRYCOUNT", 2);
  const handedAt = Date.now();
  await waitFor("the hand-over", () => worker.stats().done === 1);
  const took = Date.now() - handedAt;
  await worker.stop();
  assert.ok(took < 1000, `taken up ${took} ms after the hand-over: not at the next lease ticks (200 ms)`);
  assert.deepEqual(seen, [`${id} handed over`]);
  assert.deepEqual(await pending(admin, stream, group), []);
});

test("a done is acknowledged at once while queued entries take every slot and long handlers run", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, { ...SETTINGS, minIdleMs: 600 }); // a lease tick every 200 ms
  const quick = (await admin.xadd(stream, "*", "n", "handed over, quick")) ?? "";
  const long = (await admin.xadd(stream, "*", "n", "handed over, long")) ?? "";
  await admin.xreadgroup("GROUP", group, "other", "COUNT", 2, "STREAMS", stream, ">");
  const started: string[] = [];
  let endQuick: () => void = () => undefined;
  const quickEnds = new Promise<void>((resolve) => (endQuick = resolve));
  let endAll: () => void = () => undefined;
  const allEnd = new Promise<void>((resolve) => (endAll = resolve));
  // Two slots, and a read of new entries blocking (5 s) while the lease ticks take up hand-overs.
  const worker = workerFor(stream, { concurrency: 2, blockMs: 5000 });
  start(worker, async (message) => {
    started.push(message.id);
    await (message.id === quick ? quickEnds : allEnd);
    return done();
  });
  try {
    await leaseTicks(stream, 1);
    // The hand-overs take both slots; then the blocked read brings a new entry, which waits for a slot.
    await admin.xclaim(stream, group, "w1", 0, quick, long, "RETRYCOUNT", 2);
    await waitFor("the hand-overs running", () => started.length === 2);
    const read = (await admin.xadd(stream, "*", "n", "read, queued")) ?? "";
    await waitFor("the read's delivery", async () => (await pending(admin, stream, group)).length === 3);
    endQuick();
    // Its slot goes to the queued entry: no slot is left for a read, and the XACK does not wait for one.
    await waitFor("the quick one acknowledged", async () =>
      (await pending(admin, stream, group)).every(({ id }) => id !== quick),
    );
    assert.deepEqual(started, [quick, long, read]);
    assert.deepEqual([worker.stats().done, worker.stats().inFlight], [1, 2]);
  } finally {
    endAll();
    await worker.stop();
  }
  assert.equal(worker.stats().done, 3);
  assert.deepEqual(await pending(admin, stream, group), []);
});

test("an entry a read delivered is no hand-over while the read's reply is on its way: it runs once", async () => {
  const proxy = await startProxy(server.port);
  const stream = freshStream();
  await createGroup(admin, stream, group, { ...SETTINGS, minIdleMs: 600 }); // a lease tick every 200 ms
  const runs: string[] = [];
  const worker = workerFor(stream, { redis: `redis://127.0.0.1:${proxy.port}`, blockMs: 5000 });
  const release = proxy.holdReadReply("held by the proxy");
  start(worker, async (message) => {
    runs.push(message.id);
    return done();
  });
  const id = await admin.xadd(stream, "*", "n", "held by the proxy");
  await waitFor("the read's delivery", async () => (await pending(admin, stream, group)).length === 1);
  // The entry is in the worker's PEL, the reply that brings it held back: the lease ticks look at the PEL meanwhile.
  await leaseTicks(stream, 3);
  const readsBefore = proxy.reads();
  release();
  // The next read is sent once what the held one brought was handled.
  await waitFor("the next read", () => proxy.reads() > readsBefore);
  await worker.stop();
  await proxy.close();
  assert.deepEqual(runs, [id]);
  assert.equal(worker.stats().done, 1);
  assert.deepEqual(await pending(admin, stream, group), []);
});

test("an entry that failed here is handled again once it is handed back", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, SETTINGS);
  const id = (await admin.xadd(stream, "*", "n", "1")) ?? "";
  await admin.hset(settingsKey(stream, group), "minIdleMs", 900); // a lease tick every 300 ms
  let calls = 0;
  const worker = workerFor(stream);
  start(worker, async () => {
    if (++calls === 1) throw new Error("first try fails");
    return done();
  });
  await waitFor("the failure", () => worker.stats().failed === 1);
  await sleep(1500);
  assert.equal(calls, 1, "not re-read while it waits for the pass");
  await admin.xclaim(stream, group, "w1", 0, id); // handed back: its idle starts again
  await waitFor("the second try", () => worker.stats().done === 1);
  await worker.stop();
  assert.equal(calls, 2);
  assert.deepEqual(await pending(admin, stream, group), []);
  assert.equal(await admin.hexists(errorsKey(stream, group), id), 0);
});

test("a retry while a lease of more than 100 ids is on its way is not run again uncounted", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, { ...SETTINGS, minIdleMs: 3000 }); // a lease tick every second
  const add = async (count: number): Promise<string[]> => {
    const ids: string[] = [];
    for (let i = 0; i < count; i++) ids.push((await admin.xadd(stream, "*", "n", String(i))) ?? "");
    return ids;
  };
  // 50 entries another consumer read, then 100 new ones.
  const handedOver = await add(50);
  await admin.xreadgroup("GROUP", group, "other", "COUNT", 50, "STREAMS", stream, ">");
  await add(100);
  const runs = new Map<string, number>();
  let retryNow: () => void = () => undefined;
  const retrying = new Promise<void>((resolve) => (retryNow = resolve));
  let finishNow: () => void = () => undefined;
  const finishing = new Promise<void>((resolve) => (finishNow = resolve));
  // When the server ran each read of the settings (seconds): a lease tick begins with it.
  const ticks: number[] = [];
  const monitor = await admin.monitor();
  monitor.on("monitor", (time: string, args: string[]) => {
    if (args[0]?.toUpperCase() === "HGETALL" && args[1] === settingsKey(stream, group)) ticks.push(Number(time));
  });
  const worker = workerFor(stream, { concurrency: 150 });
  start(worker, async (message) => {
    const run = (runs.get(message.id) ?? 0) + 1;
    runs.set(message.id, run);
    if (run > 1) return retry();
    const retried = handedOver.includes(message.id);
    await (retried ? retrying : finishing);
    return retried ? retry() : done();
  });
  try {
    await waitFor("the 100 new entries running", () => worker.stats().inFlight === 100);
    // Handed over (the delivery counted): first in the pending list, started after the others, so a lease carries
    // them in its second chunk of 100 ids.
    await admin.xclaim(stream, group, "w1", 0, ...handedOver);
    await waitFor("the hand-overs running", () => worker.stats().inFlight === 150);
    // The pause holds the scripts (the lease's chunks, the give-backs), not the settings' read.
    await admin.call("CLIENT", "PAUSE", 5000, "WRITE");
    const [seconds, micros] = await admin.time();
    const pausedAt = Number(seconds) + Number(micros) / 1e6;
    await waitFor("a lease tick under the pause", () => ticks.some((at) => at > pausedAt));
    // The tick gathered its ids and sent its first chunk: the hand-overs' handlers end with a retry now, their
    // give-backs held by the pause too.
    await sleep(100);
    retryNow();
    await sleep(100);
    await admin.call("CLIENT", "UNPAUSE");
    await waitFor("the 50 retries", () => worker.stats().retried >= 50);
    // The paused tick has ended, its hand-overs taken up, once the one after the next begins.
    const seen = ticks.length;
    await waitFor("two more lease ticks", () => ticks.length >= seen + 2);
  } finally {
    monitor.disconnect();
    await admin.call("CLIENT", "UNPAUSE");
    finishNow();
    await worker.stop();
  }
  // Each retried entry ran once for its one delivery here, and waits for the operator's pass.
  const left = await pending(admin, stream, group);
  assert.deepEqual(
    left.map(({ id, deliveries }) => [id, deliveries, runs.get(id)]),
    handedOver.map((id) => [id, 2, 1]),
  );
  assert.equal(worker.stats().done, 100);
});

test("a retry while a lease is refused with NOSCRIPT and sent again waits for it: not run again uncounted", async () => {
  const proxy = await startProxy(server.port);
  const stream = freshStream();
  await createGroup(admin, stream, group, { ...SETTINGS, minIdleMs: 900 }); // a lease tick every 300 ms
  const id = (await admin.xadd(stream, "*", "n", "1")) ?? "";
  let runs = 0;
  let retryNow: () => void = () => undefined;
  const retrying = new Promise<void>((resolve) => (retryNow = resolve));
  const giveBacks = () => proxy.sent(GIVE_BACK_SHA);
  const worker = workerFor(stream, { redis: `redis://127.0.0.1:${proxy.port}` });
  start(worker, async () => {
    if (++runs === 1) await retrying;
    return retry();
  });
  try {
    await waitFor("the handler running", () => runs === 1);
    await leaseTicks(stream, 2); // the lease's script sent once on this connection: ioredis now sends its EVALSHA
    // The script cache emptied (SCRIPT FLUSH, a failover), the give-back's script loaded again (by another worker,
    // say): the next lease, which gathers the entry, is refused, and ioredis sends it again as EVAL once that reply
    // is in.
    const hold = proxy.holdReply("NOSCRIPT");
    await admin.script("FLUSH");
    await admin.script("LOAD", GIVE_BACK_LUA);
    await waitFor("the lease refused", hold.held);
    retryNow();
    // The give-back would reach the server now, before the lease sent again; it waits for that lease instead.
    const before = giveBacks();
    await waitFor("the give-back sent, or 500 ms", () => giveBacks() > before, 500).catch(() => undefined);
    hold.release();
    await waitFor("the retry", () => worker.stats().retried === 1);
    await leaseTicks(stream, 3);
  } finally {
    retryNow();
    await worker.stop();
    await proxy.close();
  }
  // Were the lease sent again after the give-back, it would reset the idle time the give-back set, and the own
  // PEL's check would take the entry for a hand-over and run it again, its delivery not counted.
  assert.equal(runs, 1);
  const [left] = await pending(admin, stream, group);
  assert.deepEqual([left?.id, left?.deliveries], [id, 1]);
});

test("NOGROUP is waited out, said once; the worker never creates the group", async () => {
  const stream = freshStream();
  const logger = recordingLogger();
  const worker = workerFor(stream, { logger });
  start(worker, async () => done());
  await sleep(1500);
  assert.equal(await admin.exists(stream), 0);
  assert.equal(logger.lines.filter((line) => line.includes("does not exist yet")).length, 1);
  await createGroup(admin, stream, group, SETTINGS);
  await admin.xadd(stream, "*", "n", "1");
  await waitFor("the message", () => worker.stats().done === 1, 15_000);
  await worker.stop();
});

test("an operator speaking an unknown contract version: the worker refuses to start and reads nothing", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, { ...SETTINGS, contractVersion: 2 });
  await admin.xadd(stream, "*", "n", "1");
  let calls = 0;
  const worker = workerFor(stream);
  await assert.rejects(
    worker.run(async () => {
      calls++;
      return done();
    }),
    (error: unknown) =>
      error instanceof ContractVersionError &&
      /the operator speaks worker contract 2, this library knows 1: upgrade the library/.test(error.message),
  );
  assert.equal(calls, 0);
  const [info] = (await admin.xinfo("GROUPS", stream)) as unknown[][];
  assert.equal(info?.[info.indexOf("last-delivered-id") + 1], "0-0");
});

test("prom-client: the stats as counters by outcome and a gauge", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, SETTINGS);
  for (const n of ["ok", "ok", "bad"]) await admin.xadd(stream, "*", "n", n);
  const worker = workerFor(stream);
  const registry = new promClient.Registry();
  registerWorkerMetrics(promClient, [worker], { registry });
  start(worker, async (message) => {
    if (message.field("n") === "bad") throw new Error("bad");
    return done();
  });
  await waitFor("three handled", () => worker.stats().done + worker.stats().failed === 3);
  await worker.stop();
  const labels = `stream="${stream}",group="${group}"`;
  for (let scrape = 0; scrape < 2; scrape++) {
    const text = await registry.metrics();
    assert.match(text, new RegExp(`pelican_worker_messages_total\\{${labels},outcome="done"\\} 2\\n`));
    assert.match(text, new RegExp(`pelican_worker_messages_total\\{${labels},outcome="failed"\\} 1\\n`));
    assert.match(text, new RegExp(`pelican_worker_in_flight\\{${labels}\\} 0\\n`));
  }
});

/** `promise`, or a rejection after `ms` saying what did not happen. */
function within<T>(ms: number, promise: Promise<T>, what: string): Promise<T> {
  const timer = sleep(ms, undefined, { ref: false }).then(() =>
    Promise.reject(new Error(`timed out waiting for ${what}`)),
  );
  return Promise.race([promise, timer]);
}

/** The worker's heartbeat in the group's consumers hash (the server's time, ms), or undefined. */
async function heartbeat(stream: string, consumer = "w1"): Promise<number | undefined> {
  const value = await admin.hget(consumersKey(stream, group), consumer);
  return value === null ? undefined : Number(value);
}

/** Waits until the worker's heartbeat changed `count` times: as many lease ticks went by. */
async function leaseTicks(stream: string, count: number): Promise<void> {
  for (let i = 0; i < count; i++) {
    const before = await heartbeat(stream);
    await waitFor("the next lease tick (the heartbeat advancing)", async () => {
      const now = await heartbeat(stream);
      return now !== undefined && now !== before;
    });
  }
}

test("the heartbeat is written at every lease tick, also when idle", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, { ...SETTINGS, minIdleMs: 300 }); // a lease tick every 100 ms
  const worker = workerFor(stream);
  start(worker, async () => done());
  await waitFor("the heartbeat field", async () => (await heartbeat(stream)) !== undefined);
  const first = (await heartbeat(stream)) ?? 0;
  await leaseTicks(stream, 3);
  const last = (await heartbeat(stream)) ?? 0;
  const [seconds] = await admin.time();
  await worker.stop();
  assert.ok(last > first, `${first} then ${last}`);
  assert.ok(Math.abs(last - Number(seconds) * 1000) < 5000, `${last}: the server's time in ms`);
});

test("a rejection with a value that is not an Error is a failure, its text String(value)", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, SETTINGS);
  const thrown: unknown[] = ["a plain string", undefined, { code: 42 }, 7];
  const ids: string[] = [];
  for (let i = 0; i < thrown.length; i++) ids.push((await admin.xadd(stream, "*", "i", String(i))) ?? "");
  const worker = workerFor(stream);
  start(worker, (message) => Promise.reject(thrown[Number(message.field("i"))]));
  await waitFor("four failures", () => worker.stats().failed === 4);
  const stats = await worker.stop();
  assert.deepEqual([stats.failed, stats.done], [4, 0]);
  const errors = await admin.hgetall(errorsKey(stream, group));
  assert.deepEqual(
    ids.map((id) => errors[id]),
    ["a plain string", "undefined", "[object Object]", "7"],
  );
  assert.equal((await pending(admin, stream, group)).length, 4);
});

test("an unknown contract version met at a lease tick: a graceful shutdown, then run rejects with it", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group); // no settings yet: a lease tick every second
  const slow = (await admin.xadd(stream, "*", "ms", "1500")) ?? "";
  const logger = recordingLogger();
  const worker = workerFor(stream, { logger, shutdownGraceMs: 5000 });
  const handled: string[] = [];
  const running = worker.run(async (message) => {
    handled.push(message.id);
    await sleep(Number(message.field("ms") ?? 0));
    return done();
  });
  running.catch(() => undefined);
  await waitFor("the slow message in flight", () => worker.stats().inFlight === 1);
  await admin.hset(settingsKey(stream, group), "contractVersion", "2");
  await waitFor("the version met at a lease tick", () => logger.lines.some((line) => line.includes("contract 2")));
  // Sent while the worker shuts down: a read on its way may bring it, never to a handler.
  const late = (await admin.xadd(stream, "*", "ms", "0")) ?? "";
  await assert.rejects(
    within(10_000, running, "run to end"),
    (error: unknown) => error instanceof ContractVersionError && error.operatorVersion === "2",
  );
  assert.deepEqual(handled, [slow]); // nothing read after the version is handled
  assert.equal(worker.stats().done, 1); // the message in flight finished within the grace
  const left = await pending(admin, stream, group);
  assert.ok(
    left.every((e) => e.id === late && e.consumer === "" && e.deliveries === 0),
    JSON.stringify(left),
  );
  assert.equal(logger.lines.filter((line) => line.includes("worker contract 2")).length, 1);
});

test("blockMs below 1 ms or not whole is refused when the worker is built, naming the option", () => {
  for (const blockMs of [0, -1, 0.5, Number.NaN]) {
    assert.throws(() => workerFor("jobs", { blockMs }), /^RangeError: blockMs must be a whole number of milliseconds/);
  }
});

test("abandoned counts only what the give-back released, never an entry acknowledged meanwhile", async () => {
  const stream = freshStream();
  await createGroup(admin, stream, group, SETTINGS);
  const id = (await admin.xadd(stream, "*", "n", "1")) ?? "";
  const worker = workerFor(stream, { shutdownGraceMs: 200 });
  start(worker, async (_message, { signal }) => {
    await new Promise((resolve) => signal.addEventListener("abort", resolve));
    return done();
  });
  await waitFor("the handler", () => worker.stats().inFlight === 1);
  // Acknowledged while its handler runs (the operator's pass dead-lettered it, say): no longer this worker's.
  await admin.xack(stream, group, id);
  const stats = await worker.stop();
  assert.equal(stats.abandoned, 0);
  assert.deepEqual(await pending(admin, stream, group), []);
});

test("the default logger writes one line per failure on stderr", async (t) => {
  const stream = freshStream();
  await createGroup(admin, stream, group, SETTINGS);
  const id = (await admin.xadd(stream, "*", "n", "1")) ?? "";
  const written: string[] = [];
  const write = t.mock.method(process.stderr, "write", (chunk: unknown) => {
    written.push(String(chunk));
    return true;
  });
  const worker = new Worker({ redis: server.url, stream, group, consumer: "w1", blockMs: 200 });
  start(worker, async () => {
    throw new Error("the store is down\nsecond line of the message");
  });
  await waitFor("the failure", () => worker.stats().failed === 1);
  await worker.stop();
  write.mock.restore();
  const lines = written
    .join("")
    .split("\n")
    .filter((line) => line.includes(id));
  assert.equal(lines.length, 1, written.join(""));
  assert.match(
    lines[0] ?? "",
    /^pelican worker WARN: handler failed.* entryId=\S+ error="Error: the store is down\\nsecond/,
  );
});
