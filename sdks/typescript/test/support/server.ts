/**
 * A real redis-server for tests and the benchmark, on a free loopback port: `REDIS_SERVER` names the binary, else
 * `redis-server` from PATH (waited for a while: it may still be being installed).
 */
import { execFile, spawn, type ChildProcess } from "node:child_process";
import { accessSync, constants, existsSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { connect, createServer } from "node:net";
import { delimiter, dirname, join } from "node:path";
import { promisify } from "node:util";
import { setTimeout as sleep } from "node:timers/promises";
import { Redis } from "ioredis";

const execFileAsync = promisify(execFile);

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

export interface RedisCluster {
  /** The port of each primary. */
  ports: number[];
  stop(): Promise<void>;
}

/**
 * A Redis Cluster of `size` primaries of `path` (no replicas) on loopback ports, its slots spread by `redis-cli
 * --cluster create` (the `redis-cli` beside the server, else on PATH), ready once every node says `cluster_state:ok`.
 */
export async function startCluster(size = 3, path: string = binary()): Promise<RedisCluster> {
  const dir = mkdtempSync(join(tmpdir(), "pelican-cluster-"));
  const servers: RedisServer[] = [];
  const ports: number[] = [];
  try {
    for (let i = 0; i < size; i++) {
      const config = join(dir, `nodes-${i}.conf`);
      const server = await startRedis(["--cluster-enabled", "yes", "--cluster-config-file", config], path);
      servers.push(server);
      ports.push(server.port);
    }
    const cli = [join(dirname(path), "redis-cli"), onPath("redis-cli")].find((p) => p && existsSync(p));
    if (!cli) throw new Error("no redis-cli beside the server nor on PATH: it makes the cluster");
    const nodes = ports.map((port) => `127.0.0.1:${port}`);
    await execFileAsync(cli, ["--cluster", "create", ...nodes, "--cluster-replicas", "0", "--cluster-yes"]);
    for (let tries = 0; ; tries++) {
      const states = await Promise.all(servers.map((s) => s.admin.call("CLUSTER", "INFO")));
      if (states.every((info) => String(info).includes("cluster_state:ok"))) break;
      if (tries > 200) throw new Error("the cluster did not become ready");
      await sleep(50);
    }
  } catch (error) {
    await Promise.all(servers.map((server) => server.stop()));
    rmSync(dir, { recursive: true, force: true });
    throw error;
  }
  return {
    ports,
    async stop() {
      await Promise.all(servers.map((server) => server.stop()));
      rmSync(dir, { recursive: true, force: true });
    },
  };
}
