package io.pelican.worker;

import static io.pelican.worker.Support.GROUP;
import static io.pelican.worker.Support.STREAM;
import static io.pelican.worker.Support.add;
import static io.pelican.worker.Support.createGroup;
import static io.pelican.worker.Support.fresh;
import static io.pelican.worker.Support.pending;
import static io.pelican.worker.Support.writeSettings;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.sun.net.httpserver.HttpServer;
import io.lettuce.core.api.sync.RedisCommands;
import io.pelican.worker.Support.Pending;
import java.io.BufferedReader;
import java.io.IOException;
import java.io.InputStreamReader;
import java.net.InetSocketAddress;
import java.nio.charset.StandardCharsets;
import java.nio.file.Path;
import java.time.Duration;
import java.util.HashMap;
import java.util.List;
import java.util.HexFormat;
import java.util.Map;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.TimeUnit;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import org.junit.jupiter.api.Test;

/** The conformance worker as a process of its own, as the cross-language suite runs it. */
class ConformanceWorkerTest {
    private static final Pattern LINE = Pattern.compile(
            "\\{\"id\": \"([^\"]+)\", \"consumer\": \"([^\"]+)\", \"outcome\": \"([a-z]+)\", \"ms\": (\\d+)}");

    private static Process start(Map<String, String> extra) throws IOException {
        return start(Support.server().url(), extra);
    }

    private static Process start(String url, Map<String, String> extra) throws IOException {
        // Surefire's class path (the JVM's own may be a manifest-only jar): target/classes and the dependencies.
        String classPath = System.getProperty("surefire.test.class.path", System.getProperty("java.class.path"));
        ProcessBuilder builder = new ProcessBuilder(
                Path.of(System.getProperty("java.home"), "bin", "java").toString(), "-cp", classPath,
                "io.pelican.worker.conformance.ConformanceWorker");
        builder.environment().putAll(Map.of("REDIS_URL", url, "STREAM", STREAM, "GROUP", GROUP,
                "CONSUMER", "conformance-1"));
        builder.environment().putAll(extra);
        // Its logs, for a failure to be read: target/conformance-worker.log.
        builder.redirectError(ProcessBuilder.Redirect.appendTo(new java.io.File("target/conformance-worker.log")));
        return builder.start();
    }

    /** Reads {@code count} run lines: id -> [outcome, ms], checking each line's form and consumer. */
    private static Map<String, List<String>> runs(BufferedReader out, int count) throws IOException {
        Map<String, List<String>> runs = new HashMap<>();
        while (runs.size() < count) {
            String line = out.readLine();
            if (line == null) {
                break;
            }
            Matcher m = LINE.matcher(line);
            assertTrue(m.matches(), line);
            assertEquals("conformance-1", m.group(2));
            runs.put(m.group(1), List.of(m.group(3), m.group(4)));
        }
        return runs;
    }

    private static int terminate(Process process) throws InterruptedException {
        process.toHandle().destroy(); // SIGTERM
        assertTrue(process.waitFor(30, TimeUnit.SECONDS), "no exit 30 s after SIGTERM");
        return process.exitValue();
    }

    @Test
    void itObeysEachMessageAndExits0OnSigterm() throws Exception {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        writeSettings(r, 60_000, 5000);
        String done = add(r, "handle", "done", "ms", "30");
        String terminal = add(r, "handle", "terminal:RecordNotFound");
        String failed = add(r, "handle", "fail");
        String retried = add(r, "handle", "retry");
        String invalid = add(r, "handle", "terminal:not camel");
        Process process = start(Map.of());
        Map<String, List<String>> runs;
        try (BufferedReader out = new BufferedReader(new InputStreamReader(process.getInputStream(), StandardCharsets.UTF_8))) {
            runs = runs(out, 5);
            assertEquals(0, terminate(process));
        } finally {
            process.destroyForcibly();
        }
        assertEquals(Map.of(done, List.of("done", "30"), terminal, List.of("terminal", "0"), failed, List.of("fail", "0"),
                retried, List.of("retry", "0"), invalid, List.of("fail", "0")), runs);
        assertEquals(Map.of("RecordNotFound", "1"), r.hgetall(Keys.terminal(STREAM, GROUP)));
        Map<String, Pending> left = new HashMap<>();
        pending(r).forEach(p -> left.put(p.id(), p));
        assertEquals(java.util.Set.of(failed, retried, invalid), left.keySet());
        assertTrue(left.get(retried).idleMs() >= 60_000, "given back with an idle of minIdle");
        assertEquals("IllegalStateException: the message asked the conformance worker to fail",
                r.hget(Keys.errors(STREAM, GROUP), failed));
    }

    /** One request an OTLP/HTTP collector received. */
    private record Export(String path, String contentType, byte[] body) {}

    @Test
    void withAnOtlpEndpointTheRunsSpanIsExportedBeforeTheExitAfterSigterm() throws Exception {
        LinkedBlockingQueue<Export> exports = new LinkedBlockingQueue<>();
        HttpServer collector = HttpServer.create(new InetSocketAddress("127.0.0.1", 0), 0);
        collector.createContext("/", exchange -> {
            exports.add(new Export(exchange.getRequestURI().getPath(),
                    exchange.getRequestHeaders().getFirst("Content-Type"), exchange.getRequestBody().readAllBytes()));
            exchange.sendResponseHeaders(200, -1);
            exchange.close();
        });
        collector.start();
        try {
            RedisCommands<String, String> r = fresh();
            createGroup(r);
            String traceId = "0af7651916cd43dd8448eb211c80319c";
            String entry = add(r, "handle", "done", "traceparent", "00-" + traceId + "-b7ad6b7169203331-01");
            // The batch processor's first export is 5 s away: only the flush at the exit can send the span in time.
            Process process = start(Map.of("OTEL_EXPORTER_OTLP_ENDPOINT",
                    "http://127.0.0.1:" + collector.getAddress().getPort()));
            try (BufferedReader out = new BufferedReader(new InputStreamReader(process.getInputStream(), StandardCharsets.UTF_8))) {
                assertEquals(List.of("done", "0"), runs(out, 1).get(entry));
                assertEquals(0, terminate(process));
            } finally {
                process.destroyForcibly();
            }
            Export export = exports.poll();
            assertTrue(export != null, "the worker exited without exporting its spans");
            assertEquals(List.of("/v1/traces", "application/x-protobuf"), List.of(export.path(), export.contentType()));
            // The protobuf holds the trace id as its 16 bytes, the names as text.
            String body = new String(export.body(), StandardCharsets.ISO_8859_1);
            for (byte[] wanted : List.of(HexFormat.of().parseHex(traceId), ("process " + STREAM).getBytes(StandardCharsets.UTF_8),
                    "pelican-conformance-java".getBytes(StandardCharsets.UTF_8))) {
                assertTrue(body.contains(new String(wanted, StandardCharsets.ISO_8859_1)),
                        "the export (" + export.body().length + " bytes) lacks " + HexFormat.of().formatHex(wanted));
            }
        } finally {
            collector.stop(0);
        }
    }

    @Test
    void itGivesBackOnSigtermWithinItsGraceAndPrintsNothingForTheRunCutOff() throws Exception {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        String entry = add(r, "handle", "done", "ms", "60000");
        Process process = start(Map.of("SHUTDOWN_GRACE_MS", "200"));
        try {
            Support.eventually(() -> !pending(r).isEmpty(), Duration.ofSeconds(15), "the message read");
            process.toHandle().destroy(); // SIGTERM, leaving the pipes open (Process.destroy closes them)
            assertEquals("", new String(process.getInputStream().readAllBytes(), StandardCharsets.UTF_8));
            assertTrue(process.waitFor(30, TimeUnit.SECONDS), "no exit 30 s after SIGTERM");
            assertEquals(0, process.exitValue());
        } finally {
            process.destroyForcibly();
        }
        Pending p = pending(r).get(0);
        assertEquals(List.of(entry, "", 0L), List.of(p.id(), p.consumer(), p.deliveries()));
    }

    @Test
    void itExitsWith3AtOnce() throws Exception {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        String entry = add(r, "handle", "exit");
        Process process = start(Map.of());
        try {
            assertEquals("{\"id\": \"" + entry + "\", \"consumer\": \"conformance-1\", \"outcome\": \"exit\", \"ms\": 0}\n",
                    new String(process.getInputStream().readAllBytes(), StandardCharsets.UTF_8));
            assertTrue(process.waitFor(30, TimeUnit.SECONDS));
            assertEquals(3, process.exitValue());
        } finally {
            process.destroyForcibly();
        }
        assertEquals(1, pending(r).size()); // nothing acknowledged
    }

    @Test
    void anUnknownContractVersionMetWhileRunningExitsWith4() throws Exception {
        RedisCommands<String, String> r = fresh();
        createGroup(r); // no settings yet: the worker meets the version at a lease tick
        String entry = add(r, "handle", "done");
        Process process = start(Map.of());
        try (BufferedReader out = new BufferedReader(new InputStreamReader(process.getInputStream(), StandardCharsets.UTF_8))) {
            assertEquals(List.of("done", "0"), runs(out, 1).get(entry));
            r.hset(Keys.settings(STREAM, GROUP), "contractVersion", "2");
            assertTrue(process.waitFor(30, TimeUnit.SECONDS), "no exit 30 s after the version was written");
            assertEquals(4, process.exitValue());
        } finally {
            process.destroyForcibly();
        }
    }

    @Test
    void asAProducerItPublishesAgainAfterALostReplyAndEachMessageIsWrittenOnce() throws Exception {
        RedisServer idmp = RedisServer.idmp();
        io.lettuce.core.RedisClient admin = io.lettuce.core.RedisClient.create(idmp.uri());
        try {
            RedisCommands<String, String> r = admin.connect().sync();
            r.flushall();
            r.scriptLoad(Script.BOUNDED_PUBLISH.source); // so the lost reply is the one of a publish written
            String out;
            try (LostReply proxy = new LostReply(idmp.port)) {
                Process process = start("redis://127.0.0.1:" + proxy.port(),
                        Map.of("MODE", "publish", "MESSAGES", "3", "POD_NAME", "producer-java"));
                try {
                    out = new String(process.getInputStream().readAllBytes(), StandardCharsets.UTF_8);
                    assertTrue(process.waitFor(30, TimeUnit.SECONDS));
                    assertEquals(0, process.exitValue());
                } finally {
                    process.destroyForcibly();
                }
                assertTrue(proxy.cut());
            }
            List<String> ids = r.xrange(STREAM, io.lettuce.core.Range.unbounded()).stream()
                    .map(io.lettuce.core.StreamMessage::getId).toList();
            assertEquals(3, ids.size());
            StringBuilder expected = new StringBuilder("{\"message\": \"m-0\", \"outcome\": \"unknown\"}\n");
            for (int n = 0; n < 3; n++) {
                expected.append("{\"message\": \"m-").append(n).append("\", \"outcome\": \"published\", \"id\": \"")
                        .append(ids.get(n)).append("\"}\n");
            }
            assertEquals(expected.toString(), out);
        } finally {
            admin.shutdown();
        }
    }

    /** A topic run line: id, consumer, outcome, ms, then partition, key, startedAt, endedAt. */
    private static final Pattern TOPIC_LINE = Pattern.compile("\\{\"id\": \"([^\"]+)\", \"consumer\": \"conformance-1\", "
            + "\"outcome\": \"done\", \"ms\": (\\d+), \"partition\": (\\d+), \"key\": (null|\"[^\"]*\"), "
            + "\"startedAt\": (\\d+), \"endedAt\": (\\d+)}");

    /**
     * The next {@code count} topic run lines, {@code <partition>/<id>} -> its match (ids repeat across partitions), read within {@code within} (a reader thread, so that a
     * worker that prints nothing fails the test rather than hanging it).
     */
    private static Map<String, Matcher> topicLines(Process process, int count, Duration within) throws Exception {
        java.util.concurrent.BlockingQueue<String> read = new java.util.concurrent.LinkedBlockingQueue<>();
        BufferedReader out = new BufferedReader(new InputStreamReader(process.getInputStream(), StandardCharsets.UTF_8));
        Thread reader = new Thread(() -> {
            try {
                for (String line = out.readLine(); line != null; line = out.readLine()) {
                    read.add(line);
                }
            } catch (IOException e) {
                // the process ended
            }
        }, "conformance-lines");
        reader.setDaemon(true);
        reader.start();
        Map<String, Matcher> lines = new HashMap<>();
        long deadline = System.nanoTime() + within.toNanos();
        while (lines.size() < count) {
            String line = read.poll(Math.max(deadline - System.nanoTime(), 0), TimeUnit.NANOSECONDS);
            assertTrue(line != null, "only " + lines.size() + " of " + count + " lines within " + within + ": " + lines.keySet());
            Matcher m = TOPIC_LINE.matcher(line);
            assertTrue(m.matches(), line);
            lines.put(m.group(3) + "/" + m.group(1), m);
        }
        return lines;
    }

    @Test
    void inATopicEachLineSaysThePartitionTheKeyAndWhenTheRunBeganAndEnded() throws Exception {
        RedisCommands<String, String> r = fresh();
        TopicSupport.writeTopic(r, 2, 30_000);
        String keyed = r.xadd(Keys.partitionStream(TopicSupport.TOPIC, Partitions.of("order-42", 2)),
                Keys.KEY_FIELD, "order-42", "ms", "40");
        String keyless = r.xadd(Keys.partitionStream(TopicSupport.TOPIC, 1), "handle", "done");
        long before = System.currentTimeMillis();
        Process process = start(Map.of("TOPIC", TopicSupport.TOPIC, "STREAM", "", "MEMBERSHIP_TTL_MS", "3000"));
        Map<String, Matcher> lines;
        try {
            lines = topicLines(process, 2, Duration.ofSeconds(20));
            assertEquals(0, terminate(process));
        } finally {
            process.destroyForcibly();
        }
        Matcher k = lines.get(Partitions.of("order-42", 2) + "/" + keyed);
        assertEquals(List.of(Integer.toString(Partitions.of("order-42", 2)), "\"order-42\""), List.of(k.group(3), k.group(4)));
        long startedAt = Long.parseLong(k.group(5));
        long endedAt = Long.parseLong(k.group(6));
        assertTrue(startedAt >= before && endedAt - startedAt >= 40, k.group(0));
        assertEquals("null", lines.get("1/" + keyless).group(4));
        assertEquals(Map.of(), r.hgetall(Keys.members(TopicSupport.TOPIC, GROUP)), "it left the group on SIGTERM");
    }

    @Test
    void aTopicItRefusesExits4() throws Exception {
        RedisCommands<String, String> r = fresh();
        TopicSupport.writeTopic(r, 2, 30_000, "contractVersion", "3");
        Process process = start(Map.of("TOPIC", TopicSupport.TOPIC, "STREAM", ""));
        try {
            assertTrue(process.waitFor(30, TimeUnit.SECONDS), "no exit 30 s after a refused topic");
            assertEquals(4, process.exitValue());
        } finally {
            process.destroyForcibly();
        }
    }

    @Test
    void withRedisClusterItRunsATopicSpreadOverTheShards() throws Exception {
        RedisCluster cluster = RedisCluster.shared();
        io.lettuce.core.cluster.api.sync.RedisAdvancedClusterCommands<String, String> r = cluster.fresh();
        TopicSupport.writeTopic(r, 4, 30_000);
        java.util.Set<String> added = new java.util.HashSet<>();
        for (int p = 0; p < 4; p++) {
            added.add(p + "/" + r.xadd(Keys.partitionStream(TopicSupport.TOPIC, p), Keys.KEY_FIELD, "k" + p, "handle", "done"));
        }
        Process process = start(cluster.url(), Map.of("TOPIC", TopicSupport.TOPIC, "STREAM", "", "REDIS_CLUSTER", "1"));
        try {
            Map<String, Matcher> lines;
            try {
                lines = topicLines(process, 4, Duration.ofSeconds(20));
            } catch (AssertionError e) {
                StringBuilder state = new StringBuilder(e.getMessage());
                for (int p = 0; p < 4; p++) {
                    String stream = Keys.partitionStream(TopicSupport.TOPIC, p);
                    state.append("\n").append(stream).append(" node ").append(cluster.nodeOf(stream)).append(" ")
                            .append(r.xrange(stream, io.lettuce.core.Range.unbounded())).append(" pending ")
                            .append(r.xpending(stream, GROUP)).append(" groups ").append(r.xinfoGroups(stream));
                }
                throw new AssertionError(state.toString(), e);
            }
            assertEquals(added, lines.keySet());
            assertEquals(0, terminate(process));
        } finally {
            process.destroyForcibly();
        }
    }
}
