/**
 * Pelican's key names, as the worker contract (contract/README.md, "Keys") lists them. Every key lives in the
 * stream's hash slot: `{T}:pelican:...`, with `T` the stream's hash tag.
 */

/**
 * The part of a key Redis Cluster hashes: the content of the first `{...}` when it is not empty, else the whole
 * name (`{orders}:events` -> `orders`, `jobs{}v2` -> `jobs{}v2`).
 */
export function hashTag(key: string): string {
  const open = key.indexOf("{");
  if (open >= 0) {
    const close = key.indexOf("}", open + 1);
    if (close > open + 1) return key.slice(open + 1, close);
  }
  return key;
}

/** `{T}:pelican:<stream>:<group>:settings`: the group's settings, written by the operator, read by workers. */
export function settingsKey(stream: string, group: string): string {
  return `{${hashTag(stream)}}:pelican:${stream}:${group}:settings`;
}

/** `{T}:pelican:<stream>:<group>:terminal`: reason -> messages ended as terminal. */
export function terminalKey(stream: string, group: string): string {
  return `{${hashTag(stream)}}:pelican:${stream}:${group}:terminal`;
}

/** `{T}:pelican:<stream>:<group>:errors`: pending entry id -> the text of its last failure. */
export function errorsKey(stream: string, group: string): string {
  return `{${hashTag(stream)}}:pelican:${stream}:${group}:errors`;
}

/**
 * `{T}:pelican:<stream>:<group>:consumers`: consumer -> its last lease tick (the server's time, ms), written by
 * `lease.lua`: the heartbeat that tells the operator's `strategy: Reassign` the consumer is alive.
 */
export function consumersKey(stream: string, group: string): string {
  return `{${hashTag(stream)}}:pelican:${stream}:${group}:consumers`;
}

/** `{T}:pelican:<stream>:bounds`: group -> `backlog.maxLength`, read by the bounded-publish scripts. */
export function boundsKey(stream: string): string {
  return `{${hashTag(stream)}}:pelican:${stream}:bounds`;
}

/** `{T}:pelican:<stream>:rejected`: group -> publishes refused for it. */
export function rejectedKey(stream: string): string {
  return `{${hashTag(stream)}}:pelican:${stream}:rejected`;
}

/** The field a requeued copy carries: the deliveries before it (a copy is a retry, and may have a last error). */
export const DELIVERIES_FIELD = "pelican-deliveries";

/** The most bytes of a failure's text recorded in the errors hash. */
export const ERROR_TEXT_MAX = 1024;

/**
 * `{T:i}`: partition `i` of the topic `T` (contract/README.md, "Topics"). The whole name is its hash tag, so each
 * partition has a slot of its own; every key of the list above is then named after this stream.
 */
export function partitionStream(topic: string, partition: number): string {
  return `{${topic}:${partition}}`;
}

/**
 * `{T}:pelican:T:topic`: what a producer needs of the topic `T`, whatever the group: `partitions` (N) and
 * `contractVersion`, written by the operator.
 */
export function topicKey(topic: string): string {
  return `{${hashTag(topic)}}:pelican:${topic}:topic`;
}

/**
 * The field a producer adds, first, to an entry it publishes with a key: the key's bytes. Workers of a `PerKey`
 * topic handle the entries of one key in order; an entry without it is a key of its own.
 */
export const KEY_FIELD = "pelican-key";

/** The `contractVersion` of a topic's description this library knows. */
export const TOPIC_CONTRACT_VERSION = 2;

/** `{T}:pelican:T:<group>:members`: member -> its lease deadline (the server's ms), written by `membership.lua`. */
export function membersKey(topic: string, group: string): string {
  return `{${hashTag(topic)}}:pelican:${topic}:${group}:members`;
}

/** `{T}:pelican:T:<group>:owners`: partition index -> the member that owns it, written by `membership.lua`. */
export function ownersKey(topic: string, group: string): string {
  return `{${hashTag(topic)}}:pelican:${topic}:${group}:owners`;
}

/** `{T}:pelican:T:<group>:epochs`: partition index -> its epoch, incremented at every hand-over. */
export function epochsKey(topic: string, group: string): string {
  return `{${hashTag(topic)}}:pelican:${topic}:${group}:epochs`;
}
