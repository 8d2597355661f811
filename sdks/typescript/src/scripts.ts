/**
 * The contract's scripts, loaded from the package's own `scripts/` folder (byte-for-byte copies of
 * contract/scripts, kept so by `npm run sync-scripts` and checked by a test), and defined on ioredis connections:
 * `defineCommand` runs each by `EVALSHA` and falls back to `EVAL` on `NOSCRIPT`.
 */
import { readFileSync } from "node:fs";
import type { Connection } from "./connection.js";

/** The folder the scripts ship in: `scripts/` at the package's root, beside `dist/`. */
const SCRIPTS_DIR = new URL("../../scripts/", import.meta.url);

function load(name: string): string {
  return readFileSync(new URL(name, SCRIPTS_DIR), "utf8");
}

type Arg = string | Buffer | number;
type Call = (...args: Arg[]) => Promise<unknown>;

/** A connection with the contract's scripts as commands; each takes its KEYS first, then its ARGV. */
export interface ScriptCommands {
  /**
   * KEYS: stream, the group's consumers hash. ARGV: group, consumer, ids (none: the heartbeat alone). Replies the
   * ids still this consumer's.
   */
  pelicanLease: Call;
  /** KEYS: stream. ARGV: group, consumer, idle ms, 1 (shutdown) | 0 (retry), ids. Replies how many. */
  pelicanGiveBack: Call;
  /** KEYS: stream, terminal, errors. ARGV: group, id, reason. Replies 1 when this call acknowledged. */
  pelicanTerminalAck: Call;
  /** KEYS: stream, bounds, rejected. ARGV: [IDMP producer message] field value ... Replies the id. */
  pelicanBoundedPublish: Call;
  /** KEYS: stream, bounds, rejected. ARGV: n, then per entry its count and arguments. Replies {ids, refusal}. */
  pelicanBoundedPublishBatch: Call;
  /**
   * KEYS: a topic's members, owners, epochs. ARGV: member, ttl ms, partitions, 1 (leaving) | 0, released
   * partitions. Replies {owned: {{partition, epoch}, ...}, release: {partition, ...}, live members}.
   */
  pelicanMembership: Call;
}

/** Each command's script text (read once) and its number of KEYS. */
const DEFINITIONS: Record<keyof ScriptCommands, { lua: string; numberOfKeys: number }> = {
  pelicanLease: { lua: load("lease.lua"), numberOfKeys: 2 },
  pelicanGiveBack: { lua: load("give_back.lua"), numberOfKeys: 1 },
  pelicanTerminalAck: { lua: load("terminal_ack.lua"), numberOfKeys: 3 },
  pelicanBoundedPublish: { lua: load("bounded_publish.lua"), numberOfKeys: 3 },
  pelicanBoundedPublishBatch: { lua: load("bounded_publish_batch.lua"), numberOfKeys: 3 },
  pelicanMembership: { lua: load("membership.lua"), numberOfKeys: 3 },
};

/** Defines every script on `conn` and returns it typed with them. */
export function withScripts(conn: Connection): Connection & ScriptCommands {
  for (const [name, definition] of Object.entries(DEFINITIONS)) conn.defineCommand(name, definition);
  return conn as Connection & ScriptCommands;
}
