// Seed 000's file-job worker: each message names a job; its record says which file to convert.
import { access } from "node:fs/promises";
import { Worker, done, terminal, type Handler } from "../src/index.js"; // an application: "@pelican-io/worker"

export interface Job {
  file: string;
}
/** Where job records live (a database): `undefined` for a deleted record; throws when the store fails. */
export interface JobStore {
  get(id: string): Promise<Job | undefined>;
}

export function fileJobs(store: JobStore, convert: (file: string) => Promise<void>): Handler {
  return async (message) => {
    const job = await store.get(message.field("job") ?? ""); // a store failure throws: retried by the policy
    if (!job) return terminal("RecordNotFound"); // deleted: no retry will find it
    await access(job.file); // missing file: throws, retried (it may still be uploading), never terminal
    await convert(job.file);
    return done();
  };
}

if (import.meta.filename === process.argv[1]) {
  const jobs = new Map<string, Job>([["1", { file: "/tmp/in.pdf" }]]);
  const redis = process.env["REDIS_URL"] ?? "redis://127.0.0.1:6379";
  const worker = new Worker({ redis, stream: "files", group: "converters" });
  worker.installSignalHandlers(); // SIGTERM: finish or give back within the grace, then resolve
  const convert = async (file: string): Promise<void> => console.log("converted", file);
  console.log(await worker.run(fileJobs({ get: async (id) => jobs.get(id) }, convert)));
}
