import { hostname } from "node:os";
import { Redis, type RedisOptions } from "ioredis";

/** Where to connect: a `redis://` / `rediss://` URL, or ioredis options (a sentinel set-up included). */
export type RedisTarget = string | RedisOptions;

/** Options without `replyMapping`, which only applies to RESP3. */
type ConnectionOptions = Omit<RedisOptions, "replyMapping">;

/**
 * A new connection of the library's own: each purpose (blocking reads, writes, publishes) gets one, so nothing
 * queues behind a blocking read. `protocol: 2` keeps the replies in the shapes the contract documents, whatever
 * the caller's options ask for.
 */
export function connect(target: RedisTarget, overrides: ConnectionOptions): Redis {
  if (typeof target === "string") return new Redis(target, { ...overrides, protocol: 2 });
  const { replyMapping: _replyMapping, ...base }: RedisOptions = target;
  const options: ConnectionOptions = { ...base, ...overrides, protocol: 2 };
  return new Redis(options);
}

/** The consumer (and producer) name by default: the Pod's (`POD_NAME`, else `HOSTNAME`), else the host name. */
export function podName(): string {
  return process.env["POD_NAME"] || process.env["HOSTNAME"] || hostname();
}

/** Whether an error is the server's reply (nothing else went wrong on the way). */
export function isReplyError(error: unknown): error is Error {
  return error instanceof Error && error.name === "ReplyError";
}

/** An error's text (`TypeError: ...`), whatever was thrown. */
export function errorText(error: unknown): string {
  try {
    return String(error);
  } catch {
    return typeof error;
  }
}
