/**
 * A loopback TCP proxy in front of a redis-server that can lose one reply (the reply is read from the server, so the
 * command ran, and the client's connection is cut instead of receiving it) or one request (the client's connection
 * is cut instead of passing it on, so the command never ran), and can hold back a reply (of a read, or any).
 */
import { connect, createServer, type Socket } from "node:net";

export interface Proxy {
  port: number;
  /** The next reply the server sends to any client is lost, with the client's connection. */
  loseNextReply(): void;
  /** The next request any client sends is lost, with the client's connection. */
  loseNextRequest(): void;
  /**
   * Holds back, from a connection that sent `XREADGROUP`, the first reply holding `text` and all after it: the
   * server delivered what the read asked for, the client does not see it. Returns the function that lets them on.
   */
  holdReadReply(text: string): () => void;
  /**
   * Holds back, from any connection, the first reply holding `text` and all after it on that connection. `held`
   * says whether it is; `release` lets them on.
   */
  holdReply(text: string): { held: () => boolean; release: () => void };
  /** How many `XREADGROUP` requests the clients sent. */
  reads(): number;
  /** How many requests holding `text` the clients sent since the first call with it. */
  sent(text: string): number;
  close(): Promise<void>;
}

export async function startProxy(targetPort: number): Promise<Proxy> {
  let armed = false;
  let requestArmed = false;
  let hold: { text: string; readsOnly: boolean; held: () => void } | undefined;
  let reads = 0;
  const watched = new Map<string, number>();
  const releases: Array<() => void> = [];
  const sockets = new Set<Socket>();
  const server = createServer((client) => {
    const upstream = connect(targetPort, "127.0.0.1");
    let reader = false;
    let held: Buffer[] | undefined;
    for (const socket of [client, upstream]) {
      sockets.add(socket);
      socket.on("close", () => {
        sockets.delete(socket);
        client.destroy();
        upstream.destroy();
      });
      socket.on("error", () => socket.destroy());
    }
    client.on("data", (data) => {
      if (requestArmed) {
        requestArmed = false;
        client.destroy();
        return;
      }
      // ioredis writes each command whole: on loopback a command's name comes in one chunk.
      const sent = data.toString("latin1").match(/XREADGROUP/gi)?.length ?? 0;
      reads += sent;
      for (const [text, count] of watched) if (data.includes(text)) watched.set(text, count + 1);
      reader ||= sent > 0;
      upstream.write(data);
    });
    upstream.on("data", (data) => {
      if (armed) {
        armed = false;
        client.destroy();
        return;
      }
      if (!held && hold && (reader || !hold.readsOnly) && data.includes(hold.text)) {
        hold.held();
        hold = undefined;
        const chunks: Buffer[] = [];
        held = chunks;
        releases.push(() => {
          held = undefined;
          for (const chunk of chunks) client.write(chunk);
        });
      }
      if (held) held.push(data);
      else client.write(data);
    });
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const release = (): void => {
    hold = undefined;
    for (const letOn of releases.splice(0)) letOn();
  };
  const address = server.address();
  if (typeof address !== "object" || !address) throw new Error("the proxy has no port");
  return {
    port: address.port,
    loseNextReply: () => (armed = true),
    loseNextRequest: () => (requestArmed = true),
    holdReadReply: (text) => {
      hold = { text, readsOnly: true, held: () => undefined };
      return release;
    },
    holdReply: (text) => {
      let holding = false;
      hold = { text, readsOnly: false, held: () => (holding = true) };
      return { held: () => holding, release };
    },
    reads: () => reads,
    sent: (text) => {
      if (!watched.has(text)) watched.set(text, 0);
      return watched.get(text) ?? 0;
    },
    close: () =>
      new Promise((resolve) => {
        for (const socket of sockets) socket.destroy();
        server.close(() => resolve());
      }),
  };
}
