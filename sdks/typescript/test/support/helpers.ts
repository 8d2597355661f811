import { existsSync, readFileSync } from "node:fs";
import { setTimeout as sleep } from "node:timers/promises";
import type { Redis } from "ioredis";

import { hashTag, settingsKey, type Logger } from "../../src/index.js";

let streams = 0;

/** A stream name no other test uses. */
export function freshStream(prefix = "jobs"): string {
  return `${prefix}-${process.pid}-${++streams}`;
}

/** Polls `check` until it holds (or fails after `timeoutMs`). */
export async function waitFor(
  what: string,
  check: () => boolean | Promise<boolean>,
  timeoutMs = 10_000,
): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(25);
  }
}

export interface PendingEntry {
  id: string;
  consumer: string;
  idleMs: number;
  deliveries: number;
}

/** The group's PEL, as `XPENDING <stream> <group> - + 1000`. */
export async function pending(admin: Redis, stream: string, group: string): Promise<PendingEntry[]> {
  const rows = (await admin.call("XPENDING", stream, group, "-", "+", 1000)) as Array<[string, string, number, number]>;
  return rows.map(([id, consumer, idleMs, deliveries]) => ({ id, consumer, idleMs, deliveries }));
}

/** The group (from the stream's start) and, when given, the settings the operator would publish. */
export async function createGroup(
  admin: Redis,
  stream: string,
  group: string,
  settings?: Record<string, number>,
): Promise<void> {
  await admin.xgroup("CREATE", stream, group, "0", "MKSTREAM");
  if (settings) await admin.hset(settingsKey(stream, group), settings);
}

/** A logger that keeps what it was told. */
export function recordingLogger(): Logger & { lines: string[] } {
  const lines: string[] = [];
  return {
    lines,
    info: (message, fields) => lines.push(`${message} ${JSON.stringify(fields ?? {})}`),
    warn: (message, fields) => lines.push(`${message} ${JSON.stringify(fields ?? {})}`),
    error: (message, fields) => lines.push(`${message} ${JSON.stringify(fields ?? {})}`),
  };
}

/**
 * Creates the user an ACL file of the repository (examples/acl/<file>) describes, for `stream` and `group`, and
 * returns a URL that logs in as it; undefined outside the Pelican repository (the package tested alone).
 */
export async function aclUser(
  admin: Redis,
  url: string,
  file: string,
  stream: string,
  group = "",
): Promise<string | undefined> {
  const path = new URL(`../../../../../examples/acl/${file}`, import.meta.url);
  if (!existsSync(path)) return undefined;
  const text = readFileSync(path, "utf8");
  const line = text.split("\n").find((l) => l.startsWith("user "));
  if (!line) throw new Error(`no user line in ${file}`);
  const [, , ...rules] = line
    .replaceAll("{T}", `{${hashTag(stream)}}`)
    .replaceAll("STREAM", stream)
    .replaceAll("GROUP", group)
    .replaceAll(">CHANGE-ME", ">secret")
    .split(" ");
  const name = `${file.replace(".acl", "")}-${stream}`;
  await admin.call("ACL", "SETUSER", name, "reset", ...rules);
  return url.replace("redis://", `redis://${name}:secret@`);
}
