package io.pelican.worker.bench;

import io.lettuce.core.RedisClient;
import io.lettuce.core.RedisURI;
import io.lettuce.core.XGroupCreateArgs;
import io.lettuce.core.XReadArgs.StreamOffset;
import io.lettuce.core.api.StatefulRedisConnection;
import io.lettuce.core.api.sync.RedisCommands;
import io.pelican.worker.Keys;
import io.pelican.worker.Outcome;
import io.pelican.worker.Producer;
import io.pelican.worker.PublishException;
import io.pelican.worker.RedisServer;
import io.pelican.worker.TopicProducer;
import io.pelican.worker.TopicWorker;
import io.pelican.worker.Worker;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.concurrent.TimeUnit;
import java.util.function.LongSupplier;

/**
 * A topic beside one plain stream, on one server in one run: the publish rate (one publish after another, a key each of
 * 1,000) and the consume rate (one worker or one member draining the backlog, a no-op handler, concurrency 16) of a
 * plain stream, a topic of 1 partition and one of 8, each topic with {@code ordering: None} and {@code PerKey}; the
 * median of a few interleaved rounds. The settings are written as the operator writes them. {@code mvn -q
 * test-compile exec:java@topic} (REDIS_URL to use a running server,
 * else one is started on a free loopback port; N and ROUNDS to change the count and the rounds).
 */
public final class TopicThroughput {
    private static final int N = Integer.parseInt(System.getenv().getOrDefault("N", "20000"));
    private static final int ROUNDS = Integer.parseInt(System.getenv().getOrDefault("ROUNDS", "3"));
    private static final int KEYS = 1_000;
    private static final int CONCURRENCY = 16;
    private static final String GROUP = "bench";

    /** What is measured: a plain stream ({@code partitions} 0) or a topic of {@code partitions} with an ordering. */
    private record Lane(String name, int partitions, String ordering) {}

    private static final List<Lane> LANES = List.of(new Lane("plain stream", 0, null),
            new Lane("topic, 1 partition, None", 1, "None"), new Lane("topic, 1 partition, PerKey", 1, "PerKey"),
            new Lane("topic, 8 partitions, None", 8, "None"), new Lane("topic, 8 partitions, PerKey", 8, "PerKey"));

    private static int streams;

    private TopicThroughput() {}

    public static void main(String[] args) throws Exception {
        String url = System.getenv("REDIS_URL");
        RedisURI uri = url != null ? RedisURI.create(url) : RedisServer.shared().uri();
        RedisClient client = RedisClient.create(uri);
        try (StatefulRedisConnection<String, String> admin = client.connect()) {
            RedisCommands<String, String> r = admin.sync();
            String version = r.info("server").lines().filter(l -> l.startsWith("redis_version:")).findFirst()
                    .orElse("?").trim();
            System.out.printf("%d messages a run (keys of %d), concurrency %d (a topic's: each partition's), %s, Java %s, "
                    + "Lettuce %s; medians of %d interleaved rounds%n", N, KEYS, CONCURRENCY, version,
                    System.getProperty("java.version"), RedisClient.class.getPackage().getImplementationVersion(), ROUNDS);
            Map<Lane, List<Double>> published = new LinkedHashMap<>();
            Map<Lane, List<Double>> consumed = new LinkedHashMap<>();
            for (int round = 0; round < ROUNDS; round++) {
                for (Lane lane : LANES) {
                    String stream = "bench-" + ProcessHandle.current().pid() + "-" + ++streams;
                    declare(r, stream, lane);
                    published.computeIfAbsent(lane, l -> new ArrayList<>()).add(publish(uri, stream, lane));
                    consumed.computeIfAbsent(lane, l -> new ArrayList<>()).add(consume(client, stream, lane));
                    r.flushall();
                }
            }
            System.out.println("| lane | publish msgs/s | consume msgs/s |");
            System.out.println("| --- | --- | --- |");
            for (Lane lane : LANES) {
                System.out.printf(Locale.ROOT, "| %s | %.0f | %.0f |%n", lane.name, median(published.get(lane)),
                        median(consumed.get(lane)));
            }
        } finally {
            client.shutdown();
        }
    }

    /**
     * The settings the operator writes for the lane (contract/README.md, "Settings" and "Topics"), and the group on
     * every stream: a plain stream's under contract 1; a topic's description, and the topic's and each partition's
     * settings under contract 2.
     */
    private static void declare(RedisCommands<String, String> r, String stream, Lane lane) {
        Map<String, String> settings = new LinkedHashMap<>();
        settings.put("minIdleMs", "30000");
        settings.put("retryAfterMs", "1000");
        settings.put("maxDeliveries", "5");
        if (lane.partitions == 0) {
            settings.put("contractVersion", "1");
            r.hset(Keys.settings(stream, GROUP), settings);
            r.xgroupCreate(StreamOffset.from(stream, "0"), GROUP, XGroupCreateArgs.Builder.mkstream());
            return;
        }
        settings.put("contractVersion", "2");
        settings.put("partitions", Integer.toString(lane.partitions));
        settings.put("ordering", lane.ordering);
        settings.put("backoffFactor", "1");
        settings.put("backoffMaxMs", "0");
        r.hset(Keys.settings(stream, GROUP), settings);
        for (int p = 0; p < lane.partitions; p++) {
            String partition = Keys.partitionStream(stream, p);
            r.hset(Keys.settings(partition, GROUP), settings);
            r.xgroupCreate(StreamOffset.from(partition, "0"), GROUP, XGroupCreateArgs.Builder.mkstream());
        }
        r.hset(Keys.topic(stream), Map.of("partitions", Integer.toString(lane.partitions), "contractVersion", "2"));
    }

    /** N publishes one after another, each keyed (a topic's by its partition, a stream's in its field); msgs/s. */
    private static double publish(RedisURI uri, String stream, Lane lane) throws PublishException {
        long began;
        if (lane.partitions == 0) {
            try (Producer producer = Producer.builder(uri).stream(stream).build()) {
                began = System.nanoTime();
                for (int n = 0; n < N; n++) {
                    producer.publish(Map.of(Keys.KEY_FIELD, "key-" + n % KEYS, "n", Integer.toString(n)));
                }
            }
        } else {
            try (TopicProducer producer = TopicProducer.builder(uri).topic(stream).build()) {
                began = System.nanoTime();
                for (int n = 0; n < N; n++) {
                    producer.publishKeyed("key-" + n % KEYS, Map.of("n", Integer.toString(n)));
                }
            }
        }
        return N / ((System.nanoTime() - began) / 1e9);
    }

    /** One worker (a stream) or one member (a topic) drains the N messages from its start; msgs/s. */
    private static double consume(RedisClient client, String stream, Lane lane) throws InterruptedException {
        long began = System.nanoTime();
        if (lane.partitions == 0) {
            try (Worker worker = Worker.builder(client).stream(stream).group(GROUP).consumer("m1")
                    .concurrency(CONCURRENCY).block(Duration.ofMillis(50)).handler(message -> Outcome.done()).build()) {
                worker.start();
                awaitDone(() -> worker.stats().done());
                return N / ((System.nanoTime() - began) / 1e9); // before the shutdown
            }
        } else {
            try (TopicWorker member = TopicWorker.builder(client).topic(stream).group(GROUP).consumer("m1")
                    .membershipTtl(Duration.ofSeconds(3)).concurrency(CONCURRENCY).block(Duration.ofMillis(50))
                    .handler(message -> Outcome.done()).build()) {
                member.start();
                awaitDone(() -> member.stats().done());
                return N / ((System.nanoTime() - began) / 1e9);
            }
        }
    }

    /** Until N are done, looking every millisecond; fails past a minute (a run that stalls is no figure). */
    private static void awaitDone(LongSupplier done) throws InterruptedException {
        long deadline = System.nanoTime() + TimeUnit.MINUTES.toNanos(1);
        while (done.getAsLong() < N) {
            if (System.nanoTime() > deadline) {
                throw new IllegalStateException("only " + done.getAsLong() + " of " + N + " done within a minute");
            }
            TimeUnit.MILLISECONDS.sleep(1);
        }
    }

    private static double median(List<Double> rates) {
        List<Double> sorted = new ArrayList<>(rates);
        Collections.sort(sorted);
        int middle = sorted.size() / 2;
        return sorted.size() % 2 == 1 ? sorted.get(middle) : (sorted.get(middle - 1) + sorted.get(middle)) / 2;
    }
}
