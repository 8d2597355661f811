import { hostname } from "node:os";
import { Cluster, Redis, type ClusterNode, type ClusterOptions, type RedisOptions } from "ioredis";

/**
 * A Redis Cluster: some of its primaries (ioredis finds the others), `options` for the cluster client, whose
 * `redisOptions` apply to each node's connection. Every key of a stream, and of a topic, is in one slot, so each
 * command goes to one node.
 */
export interface ClusterTarget {
  cluster: ClusterNode[];
  options?: Omit<ClusterOptions, "redisOptions"> & { redisOptions?: RedisOptions };
}

/**
 * Where to connect: a `redis://` / `rediss://` URL, ioredis options (a sentinel set-up included), or a Redis
 * Cluster.
 */
export type RedisTarget = string | RedisOptions | ClusterTarget;

/** A connection of the library's own: to one server, or to a Redis Cluster. */
export type Connection = Redis | Cluster;

/** Options without `replyMapping`, which only applies to RESP3. */
type ConnectionOptions = Omit<RedisOptions, "replyMapping">;

/**
 * A new connection of the library's own: each purpose (blocking reads, writes, publishes) gets one, so nothing
 * queues behind a blocking read. `protocol: 2` keeps the replies in the shapes the contract documents, whatever
 * the caller's options ask for.
 */
export function connect(target: RedisTarget, overrides: ConnectionOptions): Connection {
  if (typeof target === "string") return new Redis(target, { ...overrides, protocol: 2 });
  if ("cluster" in target) {
    const { redisOptions = {}, ...cluster } = target.options ?? {};
    const { replyMapping: _nodeReplyMapping, ...node }: RedisOptions = redisOptions;
    const { enableReadyCheck } = overrides;
    return new Cluster(target.cluster, {
      ...cluster,
      ...(enableReadyCheck === undefined ? {} : { enableReadyCheck }),
      redisOptions: { ...node, ...overrides, protocol: 2 },
    });
  }
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
