package io.pelican.worker;

import io.lettuce.core.RedisURI;
import java.io.File;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.io.UncheckedIOException;
import java.net.ServerSocket;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.List;
import org.junit.jupiter.api.Assertions;
import org.junit.jupiter.api.Assumptions;

/**
 * A real redis-server on a free loopback port, started once per test JVM and stopped when it exits: the one named by
 * {@code REDIS_SERVER}, else the one on {@code PATH}; and, for idempotent publishes, a Redis 8.6+ named by
 * {@code IDMP_REDIS_SERVER}.
 */
public final class RedisServer {
    private static RedisServer shared;
    private static RedisServer idmp;

    public final int port;
    private RedisServer(int port) {
        this.port = port;
    }

    /** The server the tests share. */
    public static synchronized RedisServer shared() {
        if (shared == null) {
            shared = start(binary());
        }
        return shared;
    }

    /**
     * A server with {@code XADD ... IDMP}. Without one the tests that need it are aborted, saying why, unless
     * {@code IDMP_REQUIRED=1}: then they fail.
     */
    public static synchronized RedisServer idmp() {
        if (idmp == null) {
            String binary = System.getenv("IDMP_REDIS_SERVER");
            if (binary == null || binary.isEmpty()) {
                if ("1".equals(System.getenv("IDMP_REQUIRED"))) {
                    Assertions.fail("IDMP_REQUIRED=1 but no IDMP_REDIS_SERVER (a Redis 8.6+ redis-server) is named");
                }
                Assumptions.abort("no IDMP_REDIS_SERVER (a Redis 8.6+ redis-server): idempotent publishes are not tested");
            }
            idmp = start(binary);
        }
        return idmp;
    }

    public RedisURI uri() {
        return RedisURI.create("redis://127.0.0.1:" + port);
    }

    public String url() {
        return "redis://127.0.0.1:" + port;
    }

    /** The redis-server the tests start: {@code REDIS_SERVER}, else the one on {@code PATH}. */
    static String binary() {
        String binary = System.getenv("REDIS_SERVER");
        if (binary == null || binary.isEmpty()) {
            binary = onPath("redis-server");
        }
        if (binary == null) {
            Assertions.fail("no redis-server: put one on PATH or name it in REDIS_SERVER");
        }
        return binary;
    }

    /**
     * {@code binary} on a free loopback port below 55,000 (a Cluster node's bus is its port + 10,000), with
     * {@code extra} arguments; stopped when the test JVM exits.
     */
    static RedisServer start(String binary, String... extra) {
        int port = port();
        List<String> command = new java.util.ArrayList<>(List.of(binary, "--port", Integer.toString(port), "--bind",
                "127.0.0.1", "--save", "", "--appendonly", "no"));
        command.addAll(List.of(extra));
        return launch(command, port);
    }

    /** {@code binary} as a sentinel ({@code redis-server <config> --sentinel}: what redis-sentinel runs). */
    static RedisServer startSentinel(String binary, java.nio.file.Path config) {
        int port = port();
        return launch(List.of(binary, config.toString(), "--sentinel", "--port", Integer.toString(port), "--bind",
                "127.0.0.1"), port);
    }

    private static int port() {
        int port = freePort();
        while (port >= 55_000) {
            port = freePort();
        }
        return port;
    }

    private static RedisServer launch(List<String> command, int port) {
        String binary = command.get(0);
        Process process;
        try {
            process = new ProcessBuilder(command)
                    .redirectErrorStream(true)
                    .redirectOutput(ProcessBuilder.Redirect.DISCARD)
                    .start();
        } catch (IOException e) {
            throw new UncheckedIOException("cannot start " + binary, e);
        }
        Runtime.getRuntime().addShutdownHook(new Thread(process::destroy));
        long deadline = System.nanoTime() + Duration.ofSeconds(10).toNanos();
        // Its own answer, not another's: a server of another program may take the port between freePort and the bind.
        while (!pong(port) || processId(port) != process.pid()) {
            if (System.nanoTime() > deadline || !process.isAlive()) {
                process.destroy();
                Assertions.fail(binary + " did not answer PING on port " + port + " (or another server did)");
            }
            sleep(50);
        }
        return new RedisServer(port);
    }

    private static boolean pong(int port) {
        try (Socket socket = new Socket("127.0.0.1", port)) {
            OutputStream out = socket.getOutputStream();
            out.write("PING\r\n".getBytes(StandardCharsets.US_ASCII));
            out.flush();
            InputStream in = socket.getInputStream();
            byte[] reply = new byte[7];
            int read = in.readNBytes(reply, 0, 7);
            return read == 7 && new String(reply, StandardCharsets.US_ASCII).equals("+PONG\r\n");
        } catch (IOException e) {
            return false;
        }
    }

    /** The {@code process_id} the server on {@code port} says ({@code INFO server}); -1 when it cannot be read. */
    private static long processId(int port) {
        try (Socket socket = new Socket("127.0.0.1", port)) {
            socket.setSoTimeout(2000);
            OutputStream out = socket.getOutputStream();
            out.write("INFO server\r\n".getBytes(StandardCharsets.US_ASCII));
            out.flush();
            java.io.BufferedReader in = new java.io.BufferedReader(
                    new java.io.InputStreamReader(socket.getInputStream(), StandardCharsets.US_ASCII));
            for (String line = in.readLine(); line != null; line = in.readLine()) {
                if (line.startsWith("process_id:")) {
                    return Long.parseLong(line.substring("process_id:".length()).trim());
                }
            }
            return -1;
        } catch (IOException | NumberFormatException e) {
            return -1;
        }
    }

    static int freePort() {
        try (ServerSocket socket = new ServerSocket(0, 1, java.net.InetAddress.getLoopbackAddress())) {
            return socket.getLocalPort();
        } catch (IOException e) {
            throw new UncheckedIOException(e);
        }
    }

    static String onPath(String name) {
        for (String dir : System.getenv().getOrDefault("PATH", "").split(File.pathSeparator)) {
            File candidate = new File(dir, name);
            if (candidate.canExecute()) {
                return candidate.getPath();
            }
        }
        return null;
    }

    static void sleep(long millis) {
        try {
            Thread.sleep(millis);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new IllegalStateException(e);
        }
    }
}
