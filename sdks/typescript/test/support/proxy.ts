/**
 * A loopback TCP proxy in front of a redis-server that can lose one reply (the reply is read from the server, so the
 * command ran, and the client's connection is cut instead of receiving it) or one request (the client's connection
 * is cut instead of passing it on, so the command never ran).
 */
import { connect, createServer, type Socket } from "node:net";

export interface Proxy {
  port: number;
  /** The next reply the server sends to any client is lost, with the client's connection. */
  loseNextReply(): void;
  /** The next request any client sends is lost, with the client's connection. */
  loseNextRequest(): void;
  close(): Promise<void>;
}

export async function startProxy(targetPort: number): Promise<Proxy> {
  let armed = false;
  let requestArmed = false;
  const sockets = new Set<Socket>();
  const server = createServer((client) => {
    const upstream = connect(targetPort, "127.0.0.1");
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
      upstream.write(data);
    });
    upstream.on("data", (data) => {
      if (armed) {
        armed = false;
        client.destroy();
        return;
      }
      client.write(data);
    });
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const address = server.address();
  if (typeof address !== "object" || !address) throw new Error("the proxy has no port");
  return {
    port: address.port,
    loseNextReply: () => (armed = true),
    loseNextRequest: () => (requestArmed = true),
    close: () =>
      new Promise((resolve) => {
        for (const socket of sockets) socket.destroy();
        server.close(() => resolve());
      }),
  };
}
