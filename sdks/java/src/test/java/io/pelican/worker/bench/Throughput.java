package io.pelican.worker.bench;

import io.lettuce.core.Consumer;
import io.lettuce.core.RedisClient;
import io.lettuce.core.RedisFuture;
import io.lettuce.core.RedisURI;
import io.lettuce.core.StreamMessage;
import io.lettuce.core.XGroupCreateArgs;
import io.lettuce.core.XReadArgs;
import io.lettuce.core.XReadArgs.StreamOffset;
import io.lettuce.core.api.StatefulRedisConnection;
import io.lettuce.core.api.async.RedisAsyncCommands;
import io.lettuce.core.api.sync.RedisCommands;
import io.lettuce.core.codec.ByteArrayCodec;
import io.pelican.worker.Message;
import io.pelican.worker.Outcome;
import io.pelican.worker.RedisServer;
import io.pelican.worker.Worker;
import io.opentelemetry.api.GlobalOpenTelemetry;
import io.opentelemetry.api.trace.propagation.W3CTraceContextPropagator;
import io.opentelemetry.context.propagation.ContextPropagators;
import io.opentelemetry.sdk.OpenTelemetrySdk;
import io.opentelemetry.sdk.metrics.SdkMeterProvider;
import io.opentelemetry.sdk.testing.exporter.InMemoryMetricReader;
import io.opentelemetry.sdk.testing.exporter.InMemorySpanExporter;
import io.opentelemetry.sdk.trace.SdkTracerProvider;
import io.opentelemetry.sdk.trace.export.SimpleSpanProcessor;
import com.sun.management.OperatingSystemMXBean;
import java.io.IOException;
import java.lang.management.ManagementFactory;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Locale;
import java.util.concurrent.TimeUnit;

/**
 * The library's worker beside a hand-written Lettuce XREADGROUP / XACK loop, on the same server in one run: N messages
 * each (default 20,000), every handler a no-op. {@code mvn -q test-compile exec:java} (REDIS_URL to use a running
 * server, else one is started on a free loopback port; N and ROUNDS to change the count and the rounds). Beside the
 * rates, for the best round of each: this JVM's CPU time and context switches (all its threads, from /proc) per
 * message, which tell where the time goes on a shared machine. Then the worker again with an OpenTelemetry SDK
 * installed, recording a span per handler run, and with a meter provider recording its metrics, beside the worker
 * without one.
 */
public final class Throughput {
    private static final int N = Integer.parseInt(System.getenv().getOrDefault("N", "20000"));
    private static final int ROUNDS = Integer.parseInt(System.getenv().getOrDefault("ROUNDS", "5"));
    private static final byte[] GROUP = bytes("bench");
    private static final byte[] CONSUMER = bytes("bench");
    /** The context a traced producer writes into each entry (contract/README.md, "Trace context"). */
    private static final byte[] TRACEPARENT = bytes("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    private static final OperatingSystemMXBean OS = (OperatingSystemMXBean) ManagementFactory.getOperatingSystemMXBean();

    /** A run's rate, and its CPU time and context switches per message. */
    private record Run(double rate, double cpuMicros, double switches) {
        Run better(Run other) {
            return other.rate > rate ? other : this;
        }

        String costs() {
            return String.format(Locale.ROOT, "%.1f µs, %.2f", cpuMicros, switches);
        }
    }

    /** What a run costs this JVM: its CPU time and its threads' context switches so far. */
    private static final class Meter {
        private final long began = System.nanoTime();
        private final long cpu = OS.getProcessCpuTime();
        private final long switches = switches();

        Run stop() {
            double seconds = (System.nanoTime() - began) / 1e9;
            return new Run(N / seconds, (OS.getProcessCpuTime() - cpu) / 1000.0 / N, (switches() - switches) / (double) N);
        }

        private static long switches() {
            long total = 0;
            try (var tasks = Files.list(Path.of("/proc/self/task"))) {
                for (Path task : (Iterable<Path>) tasks::iterator) {
                    try {
                        for (String line : Files.readAllLines(task.resolve("status"))) {
                            if (line.contains("ctxt_switches:")) { // voluntary and nonvoluntary
                                total += Long.parseLong(line.replaceAll("[^0-9]", ""));
                            }
                        }
                    } catch (IOException e) {
                        // the thread ended meanwhile
                    }
                }
            } catch (IOException e) {
                return 0; // no /proc: not Linux
            }
            return total;
        }
    }

    private static int runs;
    /** The spans the SDK recorded, in every traced run. */
    private static int recorded;

    private Throughput() {}

    public static void main(String[] args) throws Exception {
        String url = System.getenv("REDIS_URL");
        RedisURI uri = url != null ? RedisURI.create(url) : RedisServer.shared().uri();
        RedisClient client = RedisClient.create(uri);
        try (StatefulRedisConnection<byte[], byte[]> admin = client.connect(ByteArrayCodec.INSTANCE)) {
            String version = admin.sync().info("server").lines().filter(l -> l.startsWith("redis_version:"))
                    .findFirst().orElse("?").trim();
            System.out.printf("%d messages a run, %s, Java %s, Lettuce %s; best of %d interleaved rounds%n", N, version,
                    System.getProperty("java.version"), RedisClient.class.getPackage().getImplementationVersion(), ROUNDS);
            System.out.println("| hand-written loop | library worker | hand-written msgs/s | library msgs/s "
                    + "| library / hand-written | hand-written CPU, switches per msg | library CPU, switches per msg |");
            System.out.println("| --- | --- | --- | --- | --- | --- | --- |");
            List<String> tracing = new ArrayList<>();
            List<String> metrics = new ArrayList<>();
            for (int[] pair : new int[][] {{1, 1}, {16, 16}}) {
                int concurrency = pair[0];
                int count = pair[1];
                Run hand = new Run(0, 0, 0);
                Run library = new Run(0, 0, 0);
                Run traced = new Run(0, 0, 0);
                Run metered = new Run(0, 0, 0);
                for (int round = 0; round < ROUNDS; round++) {
                    hand = hand.better(handWritten(client, admin.sync(), count));
                    library = library.better(library(client, admin.sync(), concurrency));
                    traced = traced.better(traced(client, admin.sync(), concurrency));
                    metered = metered.better(metered(client, admin.sync(), concurrency));
                }
                System.out.printf(Locale.ROOT, "| COUNT %d%s | concurrency %d | %.0f | %.0f | %.2f | %s | %s |%n", count,
                        count > 1 ? ", one XACK of the batch" : "", concurrency, hand.rate, library.rate,
                        library.rate / hand.rate, hand.costs(), library.costs());
                tracing.add(String.format(Locale.ROOT, "| concurrency %d | %.0f | %.0f | %.2f | %s | %s |", concurrency,
                        library.rate, traced.rate, traced.rate / library.rate, library.costs(), traced.costs()));
                metrics.add(String.format(Locale.ROOT, "| concurrency %d | %.0f | %.0f | %.2f | %s | %s |", concurrency,
                        library.rate, metered.rate, metered.rate / library.rate, library.costs(), metered.costs()));
            }
            System.out.printf("%ntracing: the library worker without an SDK and with one recording a span per handler "
                    + "run (%d spans)%n", recorded);
            System.out.println("| library worker | no SDK msgs/s | SDK msgs/s | SDK / no SDK | no SDK CPU, switches per msg "
                    + "| SDK CPU, switches per msg |");
            System.out.println("| --- | --- | --- | --- | --- | --- |");
            tracing.forEach(System.out::println);
            System.out.printf("%nmetrics: the library worker without an SDK and with a meter provider recording its "
                    + "metrics%n");
            System.out.println("| library worker | no SDK msgs/s | SDK msgs/s | SDK / no SDK | no SDK CPU, switches per msg "
                    + "| SDK CPU, switches per msg |");
            System.out.println("| --- | --- | --- | --- | --- | --- |");
            metrics.forEach(System.out::println);
            admin.sync().flushall();
        } finally {
            client.shutdown();
        }
    }

    /** A new stream holding N entries, and its group at the start. */
    private static byte[] fill(RedisClient client, RedisCommands<byte[], byte[]> admin) {
        byte[] stream = bytes("bench-" + ProcessHandle.current().pid() + "-" + ++runs);
        admin.xgroupCreate(StreamOffset.from(stream, "0"), GROUP, XGroupCreateArgs.Builder.mkstream());
        byte[] payload = bytes("x".repeat(100));
        try (StatefulRedisConnection<byte[], byte[]> conn = client.connect(ByteArrayCodec.INSTANCE)) {
            RedisAsyncCommands<byte[], byte[]> async = conn.async();
            for (int i = 0; i < N; i += 1000) {
                List<RedisFuture<String>> adds = new ArrayList<>();
                for (int j = i; j < Math.min(N, i + 1000); j++) {
                    adds.add(async.xadd(stream, bytes("n"), bytes(Integer.toString(j)), bytes("payload"), payload,
                            bytes("traceparent"), TRACEPARENT));
                }
                for (RedisFuture<String> add : adds) {
                    add.toCompletableFuture().join();
                }
            }
        }
        return stream;
    }

    private static Run library(RedisClient client, RedisCommands<byte[], byte[]> admin, int concurrency)
            throws InterruptedException {
        String stream = new String(fill(client, admin), StandardCharsets.UTF_8);
        Worker worker = Worker.builder(client).stream(stream).group("bench").consumer("bench").concurrency(concurrency)
                .handler(Throughput::handle).build();
        Meter meter = new Meter();
        worker.start();
        while (worker.stats().done() < N) {
            TimeUnit.MILLISECONDS.sleep(1);
        }
        Run run = meter.stop();
        worker.close();
        return run;
    }

    /**
     * {@link #library} with an OpenTelemetry SDK installed as an application that traces would (the W3C propagator),
     * every span recorded and kept in memory; removed after the run.
     */
    private static Run traced(RedisClient client, RedisCommands<byte[], byte[]> admin, int concurrency)
            throws InterruptedException {
        InMemorySpanExporter exporter = InMemorySpanExporter.create();
        OpenTelemetrySdk sdk = OpenTelemetrySdk.builder()
                .setTracerProvider(SdkTracerProvider.builder().addSpanProcessor(SimpleSpanProcessor.create(exporter)).build())
                .setPropagators(ContextPropagators.create(W3CTraceContextPropagator.getInstance()))
                .buildAndRegisterGlobal();
        try {
            Run run = library(client, admin, concurrency);
            recorded += exporter.getFinishedSpanItems().size();
            return run;
        } finally {
            GlobalOpenTelemetry.resetForTest();
            sdk.close();
        }
    }

    /** {@link #library} with an OpenTelemetry meter provider installed (an in-memory reader); removed after the run. */
    private static Run metered(RedisClient client, RedisCommands<byte[], byte[]> admin, int concurrency)
            throws InterruptedException {
        OpenTelemetrySdk sdk = OpenTelemetrySdk.builder()
                .setMeterProvider(SdkMeterProvider.builder().registerMetricReader(InMemoryMetricReader.create()).build())
                .buildAndRegisterGlobal();
        try {
            return library(client, admin, concurrency);
        } finally {
            GlobalOpenTelemetry.resetForTest();
            sdk.close();
        }
    }

    private static Outcome handle(Message message) {
        return Outcome.done();
    }

    // Lettuce takes the offsets as generic varargs: javac calls the array it makes for one offset unchecked.
    @SuppressWarnings("unchecked")
    private static Run handWritten(RedisClient client, RedisCommands<byte[], byte[]> admin, int count) {
        byte[] stream = fill(client, admin);
        try (StatefulRedisConnection<byte[], byte[]> conn = client.connect(ByteArrayCodec.INSTANCE)) {
            RedisCommands<byte[], byte[]> sync = conn.sync();
            XReadArgs read = XReadArgs.Builder.count(count).block(Duration.ofSeconds(1));
            Meter meter = new Meter();
            for (int acked = 0; acked < N; ) {
                List<StreamMessage<byte[], byte[]>> found =
                        sync.xreadgroup(Consumer.from(GROUP, CONSUMER), read, StreamOffset.lastConsumed(stream));
                String[] ids = new String[found.size()];
                for (int i = 0; i < ids.length; i++) {
                    handle(null);
                    ids[i] = found.get(i).getId();
                }
                if (ids.length > 0) {
                    sync.xack(stream, GROUP, ids);
                }
                acked += ids.length;
            }
            return meter.stop();
        }
    }

    private static byte[] bytes(String text) {
        return text.getBytes(StandardCharsets.UTF_8);
    }
}
