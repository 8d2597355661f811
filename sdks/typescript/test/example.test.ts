/** Seed 000's file-job worker (examples/file-jobs.ts) on a real worker and server. */
import assert from "node:assert/strict";
import { mkdtemp, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { fileJobs, type Job } from "../examples/file-jobs.js";
import { Worker, errorsKey, terminalKey } from "../src/index.js";
import { createGroup, freshStream, pending, recordingLogger, waitFor } from "./support/helpers.js";
import { startRedis, type RedisServer } from "./support/server.js";

let server: RedisServer;
before(async () => (server = await startRedis()));
after(() => server.stop());

test("a deleted job is terminal; a store failure and a missing file are retried", async () => {
  const admin = server.admin;
  const [stream, group] = [freshStream("files"), "converters"];
  await createGroup(admin, stream, group, { minIdleMs: 60_000, retryAfterMs: 60_000, maxDeliveries: 5 });
  const folder = await mkdtemp(join(tmpdir(), "file-jobs-"));
  await writeFile(join(folder, "in.pdf"), "%PDF");
  const jobs = new Map<string, Job>([
    ["ok", { file: join(folder, "in.pdf") }],
    ["uploading", { file: join(folder, "not-yet.pdf") }],
  ]);
  const store = {
    get: async (id: string) => {
      if (id === "db") throw new Error("the job store is down");
      return jobs.get(id);
    },
  };
  const converted: string[] = [];
  const ids = new Map<string, string>();
  for (const job of ["ok", "deleted", "db", "uploading"])
    ids.set(job, (await admin.xadd(stream, "*", "job", job)) ?? "");
  const worker = new Worker({ redis: server.url, stream, group, logger: recordingLogger() });
  void worker.run(fileJobs(store, async (file) => void converted.push(file)));
  await waitFor("four jobs", () => worker.stats().done + worker.stats().terminal + worker.stats().failed === 4);
  const stats = await worker.stop();
  assert.deepEqual([stats.done, stats.terminal, stats.failed], [1, 1, 2]);
  assert.deepEqual(converted, [join(folder, "in.pdf")]);
  assert.deepEqual(await admin.hgetall(terminalKey(stream, group)), { RecordNotFound: "1" });
  assert.deepEqual(
    (await pending(admin, stream, group)).map((e) => e.id),
    [ids.get("db"), ids.get("uploading")],
  );
  const errors = await admin.hgetall(errorsKey(stream, group));
  assert.equal(errors[ids.get("db") ?? ""], "Error: the job store is down");
  assert.match(errors[ids.get("uploading") ?? ""] ?? "", /^Error: ENOENT/);
});
