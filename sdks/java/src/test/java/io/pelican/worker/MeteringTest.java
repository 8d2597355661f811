package io.pelican.worker;

import static io.pelican.worker.Support.GROUP;
import static io.pelican.worker.Support.STREAM;
import static io.pelican.worker.Support.createGroup;
import static io.pelican.worker.Support.eventually;
import static io.pelican.worker.Support.fresh;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;

import io.lettuce.core.api.sync.RedisCommands;
import io.opentelemetry.api.GlobalOpenTelemetry;
import io.opentelemetry.sdk.OpenTelemetrySdk;
import io.opentelemetry.sdk.metrics.SdkMeterProvider;
import io.opentelemetry.sdk.metrics.data.MetricData;
import io.opentelemetry.sdk.metrics.data.MetricDataType;
import io.opentelemetry.sdk.testing.exporter.InMemoryMetricReader;
import java.time.Duration;
import java.util.HashMap;
import java.util.Map;
import java.util.TreeMap;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;

/**
 * The worker's and the producer's metrics through OpenTelemetry (SPEC 23, docs/src/tracing.md "Metrics") against a
 * real redis-server, with the OpenTelemetry SDK's in-memory reader installed as an application would: the
 * instruments' names, units, attribute sets and values a dashboard reads, and that they agree with the worker's stats
 * (the Prometheus view). The global OpenTelemetry is reset around each test.
 */
class MeteringTest {
    @BeforeEach
    @AfterEach
    void noSdk() {
        GlobalOpenTelemetry.resetForTest();
    }

    /** The handler of the tests: it obeys the field handle; a requeued copy of a retry is done. */
    private static Outcome obey(Message message) throws InterruptedException {
        return switch (message.text("handle")) {
            case "fail" -> throw new IllegalStateException("the card was declined");
            case "terminal" -> Outcome.terminal("Gone");
            case "retry" -> message.bytes(Keys.DELIVERIES_FIELD) == null ? Outcome.retry() : Outcome.done();
            case "slow" -> {
                Thread.sleep(30_000);
                yield Outcome.done();
            }
            default -> Outcome.done();
        };
    }

    private static Producer producer(String stream) {
        return Producer.builder(Support.server().uri()).stream(stream).timeout(Duration.ofSeconds(5)).build();
    }

    /** An attribute set, sorted: name=value, .... */
    private static String key(Map<String, String> attributes) {
        return new TreeMap<>(attributes).toString();
    }

    /** The unit and points of the instrument {@code name} of the meter {@code pelican}: attributes -> value. */
    private static Map.Entry<String, Map<String, Long>> points(InMemoryMetricReader reader, String name) {
        MetricData metric = reader.collectAllMetrics().stream()
                .filter(m -> m.getInstrumentationScopeInfo().getName().equals("pelican") && m.getName().equals(name))
                .findFirst().orElseThrow(() -> new AssertionError("no instrument " + name));
        Map<String, Long> found = new HashMap<>();
        if (metric.getType() == MetricDataType.HISTOGRAM) {
            metric.getHistogramData().getPoints().forEach(p -> found.put(key(text(p.getAttributes().asMap())), p.getCount()));
        } else {
            metric.getLongSumData().getPoints().forEach(p -> found.put(key(text(p.getAttributes().asMap())), p.getValue()));
        }
        return Map.entry(metric.getUnit(), found);
    }

    private static Map<String, String> text(Map<?, Object> attributes) {
        Map<String, String> text = new HashMap<>();
        attributes.forEach((name, value) -> text.put(name.toString(), value.toString()));
        return text;
    }

    private static Map<String, String> with(Map<String, String> attributes, String... more) {
        Map<String, String> all = new HashMap<>(attributes);
        for (int i = 0; i < more.length; i += 2) {
            all.put(more[i], more[i + 1]);
        }
        return all;
    }

    @Test
    void withoutAnSdkAWorkerAndAProducerRunAsEver() throws PublishException {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        try (Producer producer = producer(STREAM)) {
            producer.publish(Map.of("handle", "done"));
        }
        try (Worker w = Support.worker(MeteringTest::obey, b -> b.block(Duration.ofMillis(50)))) {
            w.start();
            eventually(() -> w.stats().done() == 1, "the handler run");
        }
    }

    @Test
    void aWorkerAndAProducerRecordTheMessagingConventionsInstrumentsAsTheStatsCount() throws PublishException {
        // The application installs an SDK, before it makes its producers and workers.
        InMemoryMetricReader reader = InMemoryMetricReader.create();
        OpenTelemetrySdk.builder().setMeterProvider(SdkMeterProvider.builder().registerMetricReader(reader).build())
                .buildAndRegisterGlobal();
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        String wrongType = "not-a-stream";
        r.set(wrongType, "x");
        Worker w = Support.worker(MeteringTest::obey,
                b -> b.block(Duration.ofMillis(50)).shutdownGrace(Duration.ofMillis(200)));
        try (Producer producer = producer(STREAM)) {
            w.start();
            Map<String, String> ids = new HashMap<>();
            for (String handle : new String[] {"done", "fail", "retry", "terminal"}) {
                ids.put(handle, producer.publish(Map.of("handle", handle)));
            }
            eventually(() -> w.stats().equals(new WorkerStats(1, 1, 1, 1, 0, 0)), "the four runs");
            // The pass retries the failure and the retry (a copy at the end, the original ACKed); the failure's copy
            // fails again (at the cap: dead-letter-bound).
            for (String handle : new String[] {"fail", "retry"}) {
                r.xadd(STREAM, "handle", handle, "pelican-origin-id", ids.get(handle), Keys.DELIVERIES_FIELD, "1");
                r.xack(STREAM, GROUP, ids.get(handle));
            }
            eventually(() -> w.stats().equals(new WorkerStats(2, 1, 2, 1, 0, 0)), "the copies' runs");
            producer.publish(Map.of("handle", "slow"));
            eventually(() -> w.stats().inFlight() == 1, "the slow one in flight");
        } finally {
            w.close();
        }
        try (Producer wrong = producer(wrongType)) {
            assertThrows(PublishFailedException.class, () -> wrong.publish(Map.of("handle", "done")));
        }
        assertEquals(new WorkerStats(2, 1, 2, 1, 1, 0), w.stats());

        Map<String, String> names = Map.of("messaging.destination.name", STREAM, "messaging.consumer.group.name", GROUP);
        Map<String, String> receive = with(names, "messaging.system", "redis", "messaging.operation.name", "receive",
                "messaging.operation.type", "receive");
        Map<String, String> process = with(names, "messaging.system", "redis", "messaging.operation.name", "process",
                "messaging.operation.type", "process");
        assertEquals(Map.entry("{message}", Map.of(key(receive), 7L)),
                points(reader, "messaging.client.consumed.messages"));
        assertEquals(Map.entry("s", Map.of(
                key(with(process, "pelican.outcome", "done")), 2L,
                key(with(process, "pelican.outcome", "failed", "error.type", "java.lang.IllegalStateException")), 2L,
                key(with(process, "pelican.outcome", "retried")), 1L,
                key(with(process, "pelican.outcome", "terminal")), 1L)),
                points(reader, "messaging.process.duration"));
        assertEquals(Map.entry("{message}", Map.of(key(names), 0L)), points(reader, "pelican.worker.in_flight"));
        assertEquals(Map.entry("{message}", Map.of(key(names), 1L)), points(reader, "pelican.worker.abandoned"));
        Map<String, String> publish = Map.of("messaging.system", "redis", "messaging.operation.name", "publish",
                "messaging.operation.type", "send");
        assertEquals(Map.entry("{message}", Map.of(
                key(with(publish, "messaging.destination.name", STREAM)), 5L,
                key(with(publish, "messaging.destination.name", wrongType, "error.type", "failed")), 1L)),
                points(reader, "messaging.client.sent.messages"));
    }
}
