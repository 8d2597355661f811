/**
 * A real redis-server for tests and the benchmark, on a free loopback port: `REDIS_SERVER` names the binary, else
 * `redis-server` from PATH (waited for a while: it may still be being installed).
 */
import { spawn, type ChildProcess } from "node:child_process";
import { accessSync, constants } from "node:fs";
import { connect, createServer } from "node:net";
import { delimiter, join } from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import { Redis } from "ioredis";

export interface RedisServer {
  url: string;
  port: number;
  /** A connection for the test's own reads and writes. */
  admin: Redis;
  stop(): Promise<void>;
}

function onPath(name: string): string | undefined {
  for (const dir of (process.env["PATH"] ?? "").split(delimiter)) {
    const path = join(dir, name);
    try {
      accessSync(path, constants.X_OK);
      return path;
    } catch {
      // not in this folder
    }
  }
  return undefined;
}

function binary(): string {
  const found = process.env["REDIS_SERVER"] || onPath("redis-server");
  if (!found) {
    throw new Error("no redis-server: put one on PATH or name it in REDIS_SERVER (the tests need a real server)");
  }
  return found;
}

async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const address = server.address();
      server.close(() =>
        typeof address === "object" && address ? resolve(address.port) : reject(new Error("no port")),
      );
    });
  });
}

function accepts(port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = connect(port, "127.0.0.1");
    socket.once("connect", () => {
      socket.destroy();
      resolve(true);
    });
    socket.once("error", () => resolve(false));
  });
}

/** A server of `path` (by default `REDIS_SERVER`, else the one on PATH). */
export async function startRedis(extraArgs: string[] = [], path: string = binary()): Promise<RedisServer> {
  const port = await freePort();
  const child: ChildProcess = spawn(
    path,
    ["--port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", ...extraArgs],
    { stdio: ["ignore", "ignore", "inherit"] },
  );
  const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()));
  const url = `redis://127.0.0.1:${port}`;
  for (let tries = 0; !(await accepts(port)); tries++) {
    if (tries > 200) throw new Error(`${path} did not listen on port ${port}`);
    await sleep(50);
  }
  const admin = new Redis(url);
  await admin.ping();
  return {
    url,
    port,
    admin,
    async stop() {
      admin.disconnect();
      child.kill("SIGTERM");
      await exited;
    },
  };
}
