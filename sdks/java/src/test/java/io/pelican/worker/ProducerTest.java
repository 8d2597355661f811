package io.pelican.worker;

import static io.pelican.worker.Support.GROUP;
import static io.pelican.worker.Support.STREAM;
import static io.pelican.worker.Support.fresh;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.RedisClient;
import io.lettuce.core.RedisCommandExecutionException;
import io.lettuce.core.RedisCommandTimeoutException;
import io.lettuce.core.RedisException;
import io.lettuce.core.RedisURI;
import io.lettuce.core.ScriptOutputType;
import io.lettuce.core.StreamMessage;
import io.lettuce.core.XGroupCreateArgs;
import io.lettuce.core.XReadArgs.StreamOffset;
import io.lettuce.core.api.sync.RedisCommands;
import io.lettuce.core.codec.ByteArrayCodec;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import org.junit.jupiter.api.Test;

/** Producers against a real server: refused, failed, unavailable, no resend after a lost reply, idempotence. */
class ProducerTest {
    private static Producer producer(RedisURI uri) {
        return Producer.builder(uri).stream(STREAM).timeout(Duration.ofSeconds(5)).build();
    }

    private static void bounded(RedisCommands<String, String> r, long maxLength, int backlog) {
        r.xgroupCreate(StreamOffset.from(STREAM, "$"), GROUP, XGroupCreateArgs.Builder.mkstream());
        r.hset(Keys.bounds(STREAM), GROUP, Long.toString(maxLength));
        for (int i = 0; i < backlog; i++) {
            r.xadd(STREAM, "n", Integer.toString(i));
        }
    }

    @Test
    void publishAddsTheFieldsInOrder() throws PublishException {
        RedisCommands<String, String> r = fresh();
        Map<String, Object> fields = new LinkedHashMap<>();
        fields.put("job", "42");
        fields.put("path", "/in/a.txt".getBytes(StandardCharsets.UTF_8));
        fields.put("size", 7);
        String id;
        try (Producer producer = producer(Support.server().uri())) {
            id = producer.publish(fields);
        }
        List<StreamMessage<String, String>> rows = r.xrange(STREAM, io.lettuce.core.Range.unbounded());
        assertEquals(1, rows.size());
        assertEquals(id, rows.get(0).getId());
        assertEquals(List.of("job", "path", "size"), List.copyOf(rows.get(0).getBody().keySet()));
        assertEquals(List.of("42", "/in/a.txt", "7"), List.copyOf(rows.get(0).getBody().values()));
    }

    @Test
    void aFullBacklogRefusesAndWritesNothing() {
        RedisCommands<String, String> r = fresh();
        bounded(r, 2, 2);
        PublishRefusedException refused;
        try (Producer producer = producer(Support.server().uri())) {
            refused = assertThrows(PublishRefusedException.class, () -> producer.publish(Map.of("n", "over")));
        }
        assertEquals(List.of(GROUP, 2L, 2L), List.of(refused.group(), refused.backlog(), refused.max()));
        assertTrue(refused.certainlyNotWritten());
        assertEquals(2, r.xlen(STREAM));
        assertEquals(Map.of(GROUP, "1"), r.hgetall(Keys.rejected(STREAM)));
    }

    @Test
    void aBatchWritesWhatTheBoundHasRoomFor() throws PublishException {
        RedisCommands<String, String> r = fresh();
        bounded(r, 3, 1);
        Published published;
        try (Producer producer = producer(Support.server().uri())) {
            published = producer.publishBatch(List.of(Map.of("n", "0"), Map.of("n", "1"), Map.of("n", "2"),
                    Map.of("n", "3")));
        }
        assertEquals(2, published.ids().size());
        assertEquals(Optional.of(new Published.Refusal(GROUP, 1, 3)), published.refusal());
        assertEquals(List.of("0", "0", "1"), r.xrange(STREAM, io.lettuce.core.Range.unbounded()).stream()
                .map(m -> m.getBody().get("n")).toList());
        assertEquals(Map.of(GROUP, "2"), r.hgetall(Keys.rejected(STREAM)));
    }

    @Test
    void aScriptFlushedFromTheServerIsRunBySource() throws PublishException {
        RedisCommands<String, String> r = fresh();
        try (Producer producer = producer(Support.server().uri())) {
            producer.publish(Map.of("n", "1"));
            r.scriptFlush();
            producer.publish(Map.of("n", "2"));
            assertEquals(List.of("n"), List.copyOf(r.xrange(STREAM, io.lettuce.core.Range.unbounded()).get(1)
                    .getBody().keySet()));
            assertTrue(producer.publishBatch(List.of(Map.of("n", "3"))).refusal().isEmpty());
        }
        assertEquals(3, r.xlen(STREAM));
    }

    @Test
    void anotherServerErrorIsFailed() {
        RedisCommands<String, String> r = fresh();
        r.set(STREAM, "not a stream");
        try (Producer producer = producer(Support.server().uri())) {
            PublishFailedException failed = assertThrows(PublishFailedException.class,
                    () -> producer.publish(Map.of("n", "1")));
            assertTrue(failed.getMessage().contains("WRONGTYPE"), failed.getMessage());
            assertTrue(failed.certainlyNotWritten());
        }
    }

    @Test
    void aReadOnlyReplicaIsUnavailable() {
        RedisCommands<String, String> r = fresh();
        // A replica of a primary that is not there: it keeps refusing writes.
        r.replicaof("127.0.0.1", 1);
        try (Producer producer = producer(Support.server().uri())) {
            PublishUnavailableException unavailable = assertThrows(PublishUnavailableException.class,
                    () -> producer.publish(Map.of("n", "1")));
            assertTrue(unavailable.getMessage().contains("READONLY"), unavailable.getMessage());
        } finally {
            r.replicaofNoOne();
        }
        assertEquals(0, r.exists(STREAM));
    }

    @Test
    void aServerThatCannotBeReachedIsUnavailable() {
        int nobody = RedisServer.freePort();
        try (Producer producer = producer(RedisURI.create("redis://127.0.0.1:" + nobody))) {
            assertThrows(PublishUnavailableException.class, () -> producer.publish(Map.of("n", "1")));
        }
    }

    @Test
    void serverErrorsAreClassifiedAsTheContractSays() {
        PublishException refused = Producer.classify(new RedisCommandExecutionException("PELICAN_BACKLOG_FULL my group 5 5"));
        assertInstanceOf(PublishRefusedException.class, refused);
        assertEquals("my group", ((PublishRefusedException) refused).group());
        for (String unavailable : List.of("READONLY You can't write against a read only replica.",
                "LOADING Redis is loading the dataset in memory", "BUSY Redis is busy running a script.",
                "MASTERDOWN Link with MASTER is down", "TRYAGAIN Multiple keys request during rehashing of slot")) {
            assertInstanceOf(PublishUnavailableException.class,
                    Producer.classify(new RedisCommandExecutionException(unavailable)), unavailable);
        }
        assertInstanceOf(PublishUnavailableException.class,
                Producer.classify(new RedisException("Currently not connected. Commands are rejected.")));
        assertInstanceOf(PublishOutcomeUnknownException.class, Producer.classify(
                new RedisCommandExecutionException("PELICAN_PARTIAL 1 of 3 entries written before: OOM")));
        assertInstanceOf(PublishFailedException.class,
                Producer.classify(new RedisCommandExecutionException("ERR bounded publish needs field value pairs")));
        for (RedisException unknown : List.of(new RedisException("Connection disconnected"),
                new RedisCommandTimeoutException("Command timed out after 10 second(s)"))) {
            PublishException classified = Producer.classify(unknown);
            assertInstanceOf(PublishOutcomeUnknownException.class, classified);
            assertFalse(classified.certainlyNotWritten());
        }
    }

    @Test
    void aPublishWhoseReplyWasLostIsOutcomeUnknownAndWrittenOnce() throws Exception {
        RedisCommands<String, String> r = fresh();
        r.scriptLoad(Script.BOUNDED_PUBLISH.source); // so the EVALSHA runs, rather than answering NOSCRIPT
        try (LostReply proxy = new LostReply(Support.server().port);
                Producer producer = producer(RedisURI.create("redis://127.0.0.1:" + proxy.port()))) {
            PublishException lost = assertThrows(PublishOutcomeUnknownException.class,
                    () -> producer.publish(Map.of("n", "once")));
            assertFalse(lost.certainlyNotWritten());
            assertTrue(proxy.cut());
            // Nothing resent after the reconnect, and the producer publishes again once it is back.
            Support.eventually(() -> {
                try {
                    producer.publish(Map.of("n", "next"));
                    return true;
                } catch (PublishUnavailableException e) {
                    return false; // still reconnecting: not sent
                } catch (PublishException e) {
                    throw new AssertionError(e);
                }
            }, "a publish after the reconnect");
        }
        assertEquals(List.of("once", "next"), r.xrange(STREAM, io.lettuce.core.Range.unbounded()).stream()
                .map(m -> m.getBody().get("n")).toList());
    }

    @Test
    void theLostReplyMakesLettucesDefaultClientWriteTwice() throws Exception {
        // The control of the test above: the same lost reply through a client with Lettuce's default options.
        RedisCommands<String, String> r = fresh();
        r.scriptLoad(Script.BOUNDED_PUBLISH.source);
        try (LostReply proxy = new LostReply(Support.server().port)) {
            RedisClient resending = RedisClient.create("redis://127.0.0.1:" + proxy.port());
            try {
                var commands = resending.connect(ByteArrayCodec.INSTANCE).sync();
                byte[][] keys = {Worker.bytes(STREAM), Worker.bytes(Keys.bounds(STREAM)), Worker.bytes(Keys.rejected(STREAM))};
                commands.evalsha(Script.BOUNDED_PUBLISH.sha, ScriptOutputType.VALUE, keys, Worker.bytes("n"),
                        Worker.bytes("once"));
            } finally {
                resending.shutdown();
            }
            assertTrue(proxy.cut());
        }
        assertEquals(2, r.xlen(STREAM));
    }

    @Test
    void anIdempotentPublishIsWrittenOnce() throws PublishException {
        RedisServer idmp = RedisServer.idmp();
        RedisClient admin = RedisClient.create(idmp.uri());
        try (Producer producer = producer(idmp.uri())) {
            RedisCommands<String, String> r = admin.connect().sync();
            r.flushall();
            IdempotentProducer idempotent = producer.idempotent("producer-0");
            String first = idempotent.publish("order-1", Map.of("n", "1"));
            String again = idempotent.publish("order-1", Map.of("n", "1"));
            Map<String, Map<String, String>> batch = new LinkedHashMap<>();
            batch.put("order-1", Map.of("n", "1"));
            batch.put("order-2", Map.of("n", "2"));
            Published published = idempotent.publishBatch(batch);
            assertEquals(first, again);
            assertEquals(first, published.ids().get(0));
            assertEquals(2, published.ids().size());
            assertEquals(2, r.xlen(STREAM));
        } finally {
            admin.shutdown();
        }
    }

    @Test
    void withoutIdmpAnIdempotentProducerIsRefusedUpFrontClearly() {
        RedisCommands<String, String> r = fresh();
        try (Producer producer = producer(Support.server().uri())) {
            // Before anything is published: the producer is not made.
            IdempotenceUnsupportedException refused = assertThrows(IdempotenceUnsupportedException.class,
                    () -> producer.idempotent("producer-0"),
                    "REDIS_SERVER has XADD ... IDMP: the refusal is for servers without it");
            assertTrue(refused.getMessage().contains("no XADD ... IDMP (Redis 8.6 or later)"), refused.getMessage());
        }
        assertEquals(0, r.exists(STREAM));
    }

    @Test
    void idmpIsDetectedFromTheTokenInCommandDocs() {
        // COMMAND DOCS XADD as Redis 8.6 answers it, abridged; RESP3 maps come flattened the same way.
        List<Object> docs = List.of(b("xadd"), List.of(b("summary"), b("Appends a new message to a stream."),
                b("arguments"), List.of(List.of(b("name"), b("key"), b("type"), b("key")),
                        List.of(b("name"), b("idmp"), b("type"), b("block"), b("token"), b("IDMP"), b("arguments"),
                                List.of(List.of(b("name"), b("pid")))))));
        List<Object> older = List.of(b("xadd"), List.of(b("summary"), b("mentions IDMP only in text"), b("arguments"),
                List.of(List.of(b("name"), b("key"), b("token"), b("MAXLEN")))));
        assertTrue(IdempotentProducer.hasToken(docs, "IDMP"));
        assertFalse(IdempotentProducer.hasToken(older, "IDMP"));
        assertFalse(IdempotentProducer.hasToken(List.of(), "IDMP"));
    }

    private static byte[] b(String text) {
        return text.getBytes(StandardCharsets.UTF_8);
    }
}
