package io.pelican.worker;

import static io.pelican.worker.Support.CONSUMER;
import static io.pelican.worker.Support.GROUP;
import static io.pelican.worker.Support.STREAM;
import static io.pelican.worker.Support.createGroup;
import static io.pelican.worker.Support.eventually;
import static io.pelican.worker.Support.fresh;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertSame;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.Range;
import io.lettuce.core.RedisClient;
import io.lettuce.core.RedisURI;
import io.lettuce.core.api.sync.RedisCommands;
import io.opentelemetry.api.GlobalOpenTelemetry;
import io.opentelemetry.api.common.AttributeKey;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.api.trace.SpanContext;
import io.opentelemetry.api.trace.SpanKind;
import io.opentelemetry.api.trace.StatusCode;
import io.opentelemetry.api.trace.propagation.W3CTraceContextPropagator;
import io.opentelemetry.context.Scope;
import io.opentelemetry.context.propagation.ContextPropagators;
import io.opentelemetry.sdk.OpenTelemetrySdk;
import io.opentelemetry.sdk.testing.exporter.InMemorySpanExporter;
import io.opentelemetry.sdk.trace.SdkTracerProvider;
import io.opentelemetry.sdk.trace.data.SpanData;
import io.opentelemetry.sdk.trace.export.SimpleSpanProcessor;
import java.lang.reflect.Field;
import java.net.URL;
import java.net.URLClassLoader;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.regex.Pattern;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.params.ParameterizedTest;
import org.junit.jupiter.params.provider.ValueSource;

/**
 * A message's trace through the stream (SPEC 23, contract/README.md "Trace context") against a real redis-server,
 * with the OpenTelemetry SDK's in-memory exporter and the W3C propagator installed as an application would: what the
 * entry carries, and the spans of each publish and handler run, one trace from the application's request to every
 * run. The global OpenTelemetry is reset around each test.
 */
class TraceTest {
    @BeforeEach
    @AfterEach
    void noSdk() {
        GlobalOpenTelemetry.resetForTest();
    }

    /** Installs an SDK recording every span in memory, and the W3C propagator, as an application does at start. */
    private static InMemorySpanExporter installSdk() {
        InMemorySpanExporter exporter = InMemorySpanExporter.create();
        OpenTelemetrySdk.builder()
                .setTracerProvider(SdkTracerProvider.builder().addSpanProcessor(SimpleSpanProcessor.create(exporter)).build())
                .setPropagators(ContextPropagators.create(W3CTraceContextPropagator.getInstance()))
                .buildAndRegisterGlobal();
        return exporter;
    }

    /** Work that may fail with a publish's error. */
    @FunctionalInterface
    private interface Work<T> {
        T run() throws PublishException;
    }

    /** What {@link #inSpan} ran: the application's span and what the work answered. */
    private record Ran<T>(SpanContext span, T value) {}

    /** Runs {@code work} inside a new span of the application's, {@code name}, ended after it. */
    private static <T> Ran<T> inSpan(String name, Work<T> work) throws PublishException {
        Span span = GlobalOpenTelemetry.getTracer("shop").spanBuilder(name).startSpan();
        Scope scope = span.makeCurrent();
        try {
            return new Ran<>(span.getSpanContext(), work.run());
        } finally {
            scope.close();
            span.end();
        }
    }

    /** Each entry of {@code stream}: its fields in order, by id. */
    private static Map<String, List<String>> entries(RedisCommands<String, String> r, String stream) {
        Map<String, List<String>> found = new LinkedHashMap<>();
        r.xrange(stream, Range.create("-", "+")).forEach(m -> {
            List<String> fields = new ArrayList<>();
            m.getBody().forEach((name, value) -> {
                fields.add(name);
                fields.add(value);
            });
            found.put(m.getId(), fields);
        });
        return found;
    }

    private static List<SpanData> named(List<SpanData> spans, String name) {
        return spans.stream().filter(s -> s.getName().equals(name)).toList();
    }

    private static String attr(SpanData span, String key) {
        return span.getAttributes().get(AttributeKey.stringKey(key));
    }

    private static SpanData ofMessage(List<SpanData> spans, String id) {
        return spans.stream().filter(s -> id.equals(attr(s, "messaging.message.id"))).findFirst()
                .orElseThrow(() -> new AssertionError("no span of message " + id + " among " + spans.size()));
    }

    /** The W3C field of a span. */
    private static String traceparent(SpanContext span) {
        return "00-" + span.getTraceId() + "-" + span.getSpanId() + "-" + span.getTraceFlags().asHex();
    }

    /** The handler the tests run: it obeys the field {@code handle}, and records the span it runs in. */
    private static Handler obey(Map<String, SpanContext> seen) {
        return message -> {
            seen.put(message.id(), Span.current().getSpanContext());
            return switch (String.valueOf(message.text("handle"))) {
                case "fail" -> throw new IllegalStateException("the card was declined");
                case "terminal:Gone" -> Outcome.terminal("Gone");
                case "retry" -> Outcome.retry();
                default -> Outcome.done();
            };
        };
    }

    private static Producer producer(RedisURI uri) {
        return Producer.builder(uri).stream(STREAM).timeout(Duration.ofSeconds(5)).build();
    }

    @Test
    void withoutAnSdkNothingIsAddedToAnEntryAndTheHandlerRunsInNoSpan() throws PublishException {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        String id;
        try (Producer producer = producer(Support.server().uri())) {
            id = inSpan("checkout", () -> producer.publish(Map.of("handle", "done"))).value();
        }
        assertEquals(Map.of(id, List.of("handle", "done")), entries(r, STREAM));
        Map<String, SpanContext> seen = new ConcurrentHashMap<>();
        try (Worker w = Support.worker(obey(seen), b -> b.block(Duration.ofMillis(100)))) {
            w.start();
            eventually(() -> w.stats().done() == 1, "the handler run");
        }
        assertFalse(seen.get(id).isValid(), "the handler ran in span " + seen.get(id));
    }

    @Test
    void aMessageIsOneTraceFromTheRequestsSpanThroughItsPublishToEachHandlerRun() throws PublishException {
        InMemorySpanExporter exporter = installSdk();
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        List<String> handles = List.of("done", "fail", "terminal:Gone", "retry");
        Ran<List<String>> checkout;
        try (Producer producer = producer(Support.server().uri())) {
            checkout = inSpan("checkout", () -> {
                List<String> ids = new ArrayList<>();
                for (String handle : handles) {
                    ids.add(producer.publish(Map.of("handle", handle)));
                }
                return ids;
            });
        }
        List<String> ids = checkout.value();
        Pattern request = Pattern.compile("00-" + checkout.span().getTraceId() + "-[0-9a-f]{16}-[0-9a-f]{2}");
        entries(r, STREAM).forEach((id, fields) -> {
            assertEquals(4, fields.size(), "no tracestate without entries: " + fields);
            assertEquals(List.of("handle", "traceparent"), List.of(fields.get(0), fields.get(2)),
                    "the application's fields first, the context last");
            assertTrue(request.matcher(fields.get(3)).matches(), "the request's trace: " + fields.get(3));
        });

        Map<String, SpanContext> seen = new ConcurrentHashMap<>();
        try (Worker w = Support.worker(obey(seen), b -> b.block(Duration.ofMillis(100)))) {
            w.start();
            eventually(() -> seen.size() == handles.size(), "a handler run of each message");
        }

        List<SpanData> spans = exporter.getFinishedSpanItems();
        List<SpanData> sends = named(spans, "send " + STREAM);
        List<SpanData> runs = named(spans, "process " + STREAM);
        assertEquals(List.of(4, 4), List.of(sends.size(), runs.size()), spans.toString());
        for (String id : ids) {
            SpanData send = ofMessage(sends, id);
            assertEquals(SpanKind.PRODUCER, send.getKind());
            assertEquals(checkout.span().getSpanId(), send.getParentSpanId(), "a publish is a child of the request");
            assertEquals(List.of("redis", STREAM, "send", "publish"), List.of(attr(send, "messaging.system"),
                    attr(send, "messaging.destination.name"), attr(send, "messaging.operation.type"),
                    attr(send, "messaging.operation.name")));
            SpanData run = ofMessage(runs, id);
            assertEquals(SpanKind.CONSUMER, run.getKind());
            assertEquals(checkout.span().getTraceId(), run.getTraceId(), "one trace from the request to the handler");
            assertEquals(send.getSpanId(), run.getParentSpanId(), "each run continues its publish");
            assertEquals(List.of(GROUP, CONSUMER, "process", "process", STREAM), List.of(
                    attr(run, "messaging.consumer.group.name"), attr(run, "messaging.client.id"),
                    attr(run, "messaging.operation.type"), attr(run, "messaging.operation.name"),
                    attr(run, "messaging.destination.name")));
            assertEquals(run.getSpanId(), seen.get(id).getSpanId(), "the handler runs inside its run's span");
        }
        SpanData done = ofMessage(runs, ids.get(0));
        SpanData failed = ofMessage(runs, ids.get(1));
        SpanData terminal = ofMessage(runs, ids.get(2));
        SpanData retried = ofMessage(runs, ids.get(3));
        assertEquals("done", attr(done, "pelican.outcome"));
        assertEquals(StatusCode.UNSET, done.getStatus().getStatusCode());
        assertEquals("fail", attr(failed, "pelican.outcome"));
        assertEquals(StatusCode.ERROR, failed.getStatus().getStatusCode());
        assertEquals("IllegalStateException: the card was declined", failed.getStatus().getDescription());
        assertEquals(r.hget(Keys.errors(STREAM, GROUP), ids.get(1)), failed.getStatus().getDescription(),
                "the status says what the entry's last error says");
        assertEquals(List.of("terminal", "Gone"), List.of(attr(terminal, "pelican.outcome"), attr(terminal, "pelican.reason")));
        assertEquals("retry", attr(retried, "pelican.outcome"));
    }

    @Test
    void aBatchIsOneSendSpanWhoseContextEveryEntryCarries() throws PublishException {
        InMemorySpanExporter exporter = installSdk();
        RedisCommands<String, String> r = fresh();
        Published published;
        try (Producer producer = producer(Support.server().uri())) {
            published = inSpan("import", () -> producer.publishBatch(List.of(Map.of("n", "1"), Map.of("n", "2")))).value();
        }
        List<SpanData> sends = named(exporter.getFinishedSpanItems(), "send " + STREAM);
        assertEquals(1, sends.size(), "one send span");
        assertEquals(2L, sends.get(0).getAttributes().get(AttributeKey.longKey("messaging.batch.message_count")));
        String batch = traceparent(sends.get(0).getSpanContext());
        Map<String, List<String>> expected = new LinkedHashMap<>();
        expected.put(published.ids().get(0), List.of("n", "1", "traceparent", batch));
        expected.put(published.ids().get(1), List.of("n", "2", "traceparent", batch));
        assertEquals(expected, entries(r, STREAM));
    }

    @ParameterizedTest
    @ValueSource(strings = {"None", "PerKey"})
    void aTopicsPublishAndHandlerRunNameTheTopicTheKeyAndThePartition(String ordering) throws PublishException {
        InMemorySpanExporter exporter = installSdk();
        RedisCommands<String, String> r = fresh();
        TopicSupport.writeTopic(r, 2, 30_000, "ordering", ordering);
        TopicPublished published;
        try (TopicProducer producer = TopicProducer.builder(Support.server().uri()).topic(TopicSupport.TOPIC).build()) {
            published = inSpan("checkout", () -> producer.publishKeyed("order-42", Map.of("handle", "done"))).value();
        }
        String stream = Keys.partitionStream(TopicSupport.TOPIC, published.partition());
        try (TopicWorker w = TopicWorker.builder(Support.server().uri()).topic(TopicSupport.TOPIC).group(GROUP)
                .consumer("member-1").membershipTtl(Duration.ofSeconds(3)).block(Duration.ofMillis(100))
                .handler(obey(new ConcurrentHashMap<>())).build()) {
            w.start();
            eventually(() -> named(exporter.getFinishedSpanItems(), "process " + stream).size() == 1,
                    Duration.ofSeconds(10), "the run's span");
        }
        List<SpanData> spans = exporter.getFinishedSpanItems();
        SpanData send = ofMessage(named(spans, "send " + stream), published.id());
        SpanData run = ofMessage(named(spans, "process " + stream), published.id());
        for (SpanData span : List.of(send, run)) {
            assertEquals(List.of(TopicSupport.TOPIC, "order-42", stream), List.of(attr(span, "pelican.topic"),
                    attr(span, "pelican.key"), attr(span, "messaging.destination.name")), span.getName());
        }
        assertEquals(send.getSpanId(), run.getParentSpanId(), "the run continues its publish");
        assertEquals("done", attr(run, "pelican.outcome"));
        assertEquals(List.of(Keys.KEY_FIELD, "order-42", "handle", "done", "traceparent", traceparent(send.getSpanContext())),
                entries(r, stream).get(published.id()), "the key first, the context last");
    }

    @Test
    void aRetriedIdempotentPublishWritesTheContextOfItsFirstAttempt() throws Exception {
        RedisServer idmp = RedisServer.idmp();
        InMemorySpanExporter exporter = installSdk();
        RedisClient admin = RedisClient.create(idmp.uri());
        try (LostReply proxy = LostReply.request(idmp.uri().getPort());
                Producer producer = producer(RedisURI.create("redis://127.0.0.1:" + proxy.port()))) {
            RedisCommands<String, String> r = admin.connect().sync();
            r.flushall();
            IdempotentProducer idempotent = producer.idempotent("shop-1");
            // The first attempt never reaches the server: its outcome is unknown to the producer.
            Ran<PublishException> first = inSpan("checkout",
                    () -> assertThrows(PublishException.class, () -> idempotent.publish("order-7", Map.of("order", "7"))));
            assertInstanceOf(PublishOutcomeUnknownException.class, first.value());
            assertTrue(proxy.cut());
            assertEquals(0, r.xlen(STREAM), "the first attempt wrote nothing");
            // The application publishes it again, later, in another span, until it is written (the connection
            // reconnects meanwhile: an attempt before then is unavailable).
            String id = null;
            for (int attempt = 0; id == null && attempt < 100; attempt++) {
                id = inSpan("retry", () -> {
                    try {
                        return idempotent.publish("order-7", Map.of("order", "7"));
                    } catch (PublishUnavailableException e) {
                        RedisServer.sleep(50);
                        return null;
                    }
                }).value();
            }
            assertNotNull(id, "published again");
            List<SpanData> sends = named(exporter.getFinishedSpanItems(), "send " + STREAM);
            SpanData firstSend = sends.get(0);
            assertEquals(first.span().getSpanId(), firstSend.getParentSpanId());
            assertEquals(StatusCode.ERROR, firstSend.getStatus().getStatusCode());
            assertEquals("order-7", attr(firstSend, "pelican.message_id"));
            SpanData written = ofMessage(sends, id);
            assertNotEquals(firstSend.getTraceId(), written.getTraceId(), "published in another trace");
            assertEquals(Map.of(id, List.of("order", "7", "traceparent", traceparent(firstSend.getSpanContext()))),
                    entries(r, STREAM), "the first attempt's context");
        } finally {
            admin.shutdown();
        }
    }

    @Test
    void theCarriedFieldsAreKeptForTheLast1024MessageIdsOnlyEachTakenOnce() {
        Carried carried = new Carried();
        for (int n = 0; n <= Carried.KEPT; n++) {
            carried.keep("m-" + n, List.of(bytes(Integer.toString(n))));
        }
        assertNull(carried.take("m-0"), "the oldest was dropped");
        assertEquals(Integer.toString(Carried.KEPT), text(carried.take("m-" + Carried.KEPT)));
        assertNull(carried.take("m-" + Carried.KEPT), "taken once");
        carried.keep("m-1", List.of(bytes("again")));
        assertEquals("again", text(carried.take("m-1")), "kept again under its id");
    }

    @Test
    void withoutTheApiOnTheClasspathTheLibraryPublishesAndAddsNothing() throws Exception {
        installSdk(); // the application's, which the library cannot see
        RedisCommands<String, String> r = fresh();
        URL classes = Tracing.class.getProtectionDomain().getCodeSource().getLocation();
        try (URLClassLoader withoutApi = new URLClassLoader(new URL[] {classes}, new HidingApiAndLibrary())) {
            Class<?> tracing = withoutApi.loadClass(Tracing.class.getName());
            Field current = tracing.getDeclaredField("CURRENT");
            Field none = tracing.getDeclaredField("NONE");
            current.setAccessible(true);
            none.setAccessible(true);
            assertSame(none.get(null), current.get(null), "nothing traced");

            Class<?> producer = withoutApi.loadClass(Producer.class.getName());
            Object builder = producer.getMethod("builder", RedisURI.class).invoke(null, Support.server().uri());
            builder = builder.getClass().getMethod("stream", String.class).invoke(builder, STREAM);
            try (AutoCloseable built = (AutoCloseable) builder.getClass().getMethod("build").invoke(builder)) {
                String id = (String) producer.getMethod("publish", Map.class).invoke(built, Map.of("n", "1"));
                assertEquals(Map.of(id, List.of("n", "1")), entries(r, STREAM));
            }
        }
    }

    /**
     * The test's class path without OpenTelemetry's API, and without the library's classes, so that the loader
     * above defines them anew, as an application without the API would load them.
     */
    private static final class HidingApiAndLibrary extends ClassLoader {
        HidingApiAndLibrary() {
            super(TraceTest.class.getClassLoader());
        }

        @Override
        protected Class<?> loadClass(String name, boolean resolve) throws ClassNotFoundException {
            if (name.startsWith("io.opentelemetry.") || name.startsWith("io.pelican.worker.")) {
                throw new ClassNotFoundException(name);
            }
            return super.loadClass(name, resolve);
        }
    }

    private static byte[] bytes(String text) {
        return text.getBytes(StandardCharsets.UTF_8);
    }

    private static String text(List<byte[]> fields) {
        return new String(fields.get(0), StandardCharsets.UTF_8);
    }
}
