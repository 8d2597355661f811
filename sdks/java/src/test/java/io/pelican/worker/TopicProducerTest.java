package io.pelican.worker;

import static io.pelican.worker.TopicSupport.TOPIC;
import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;
import static org.junit.jupiter.api.Assumptions.assumeTrue;

import io.lettuce.core.Range;
import io.lettuce.core.StreamMessage;
import io.lettuce.core.api.sync.RedisCommands;
import java.io.IOException;
import java.io.InputStream;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.HexFormat;
import java.util.List;
import java.util.Map;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import org.junit.jupiter.api.Test;

/** The partition of a key (the contract's test vector) and publishing into a topic's partitions. */
class TopicProducerTest {
    private static final Path CONTRACT = Path.of(System.getProperty("basedir", ".")).resolve("../../contract").normalize();
    /** One case of partitions.json: {"key": ...} or {"keyHex": ...}, then crc32, partitions, partition. */
    private static final Pattern CASE = Pattern.compile(
            "\\{\"(key|keyHex)\": \"((?:[^\"\\\\]|\\\\.)*)\", \"crc32\": (\\d+), \"partitions\": (\\d+), \"partition\": (\\d+)\\}");

    private static byte[] vector() throws IOException {
        try (InputStream in = TopicProducerTest.class.getResourceAsStream("partitions.json")) {
            return in.readAllBytes();
        }
    }

    @Test
    void theVectorIsTheContractsByteForByte() throws IOException {
        assumeTrue(Files.isRegularFile(CONTRACT.resolve("partitions.json")), "built out of the repository");
        assertArrayEquals(Files.readAllBytes(CONTRACT.resolve("partitions.json")), vector(),
                "copy it again: cp ../../contract/partitions.json src/test/resources/io/pelican/worker/");
    }

    @Test
    void everyKeyOfTheVectorGoesToItsPartition() throws IOException {
        String json = new String(vector(), StandardCharsets.UTF_8);
        Matcher matcher = CASE.matcher(json);
        List<String> wrong = new ArrayList<>();
        int cases = 0;
        while (matcher.find()) {
            cases++;
            byte[] key = matcher.group(1).equals("keyHex") ? HexFormat.of().parseHex(matcher.group(2))
                    : unescape(matcher.group(2)).getBytes(StandardCharsets.UTF_8);
            int partitions = Integer.parseInt(matcher.group(4));
            int partition = Partitions.of(key, partitions);
            if (partition != Integer.parseInt(matcher.group(5))) {
                wrong.add(matcher.group(0) + " -> " + partition);
            }
        }
        assertEquals(json.split("\"partitions\":", -1).length - 1, cases, "every case of the vector is read");
        assertTrue(cases > 0);
        assertEquals(List.of(), wrong);
    }

    /** JSON's escapes in a key: \", \\ and \\uXXXX. */
    private static String unescape(String text) {
        StringBuilder out = new StringBuilder();
        for (int i = 0; i < text.length(); i++) {
            char c = text.charAt(i);
            if (c != '\\') {
                out.append(c);
            } else if (text.charAt(i + 1) == 'u') {
                out.append((char) Integer.parseInt(text.substring(i + 2, i + 6), 16));
                i += 5;
            } else {
                out.append(text.charAt(++i));
            }
        }
        return out.toString();
    }

    private static TopicProducer producer() throws PublishException {
        return TopicProducer.builder(Support.server().uri()).topic(TOPIC).build();
    }

    private static List<StreamMessage<String, String>> entries(RedisCommands<String, String> r, int partition) {
        return r.xrange(Keys.partitionStream(TOPIC, partition), Range.unbounded());
    }

    @Test
    void aKeyedMessageGoesToItsKeysPartitionWithTheKeyFirst() throws PublishException {
        RedisCommands<String, String> r = Support.fresh();
        TopicSupport.writeTopic(r, 4, 30_000);
        try (TopicProducer producer = producer()) {
            assertEquals(4, producer.partitions());
            for (String key : List.of("order-42", "user:1000", "")) {
                TopicPublished published = producer.publishKeyed(key, Map.of("n", "1"));
                assertEquals(Partitions.of(key, 4), published.partition());
                List<StreamMessage<String, String>> rows = entries(r, published.partition());
                StreamMessage<String, String> row = rows.get(rows.size() - 1);
                assertEquals(published.id(), row.getId());
                assertEquals(List.of(Keys.KEY_FIELD, "n"), List.copyOf(row.getBody().keySet()));
                assertEquals(key, row.getBody().get(Keys.KEY_FIELD));
            }
        }
    }

    @Test
    void messagesWithoutAKeyGoRoundRobin() throws PublishException {
        RedisCommands<String, String> r = Support.fresh();
        TopicSupport.writeTopic(r, 3, 30_000);
        List<Integer> partitions = new ArrayList<>();
        try (TopicProducer producer = producer()) {
            for (int i = 0; i < 6; i++) {
                partitions.add(producer.publish(Map.of("n", i)).partition());
            }
        }
        assertEquals(List.of(0, 1, 2, 0, 1, 2), partitions);
        for (int p = 0; p < 3; p++) {
            assertEquals(2, entries(r, p).size());
            assertFalse(entries(r, p).get(0).getBody().containsKey(Keys.KEY_FIELD));
        }
    }

    @Test
    void aPartitionsBoundRefusesAsAStreamsDoes() throws PublishException {
        RedisCommands<String, String> r = Support.fresh();
        TopicSupport.writeTopic(r, 2, 30_000);
        String key = "order-42";
        String stream = Keys.partitionStream(TOPIC, Partitions.of(key, 2));
        r.hset(Keys.bounds(stream), Support.GROUP, "1");
        try (TopicProducer producer = producer()) {
            producer.publishKeyed(key, Map.of("n", "1"));
            PublishRefusedException refused = assertThrows(PublishRefusedException.class,
                    () -> producer.publishKeyed(key, Map.of("n", "2")));
            assertEquals(Support.GROUP, refused.group());
        }
        assertEquals(1, r.xlen(stream));
    }

    @Test
    void anIdempotentPublishWithoutAKeyGoesToItsMessageIdsPartitionOnce() throws PublishException {
        RedisServer idmp = RedisServer.idmp();
        io.lettuce.core.RedisClient admin = io.lettuce.core.RedisClient.create(idmp.uri());
        try {
            RedisCommands<String, String> r = admin.connect().sync();
            r.flushall();
            r.hset(Keys.topic(TOPIC), Map.of("partitions", "4", "contractVersion", "2"));
            try (TopicProducer producer = TopicProducer.builder(idmp.uri()).topic(TOPIC).build()) {
                IdempotentTopicProducer idempotent = producer.idempotent("producer-0");
                TopicPublished first = idempotent.publish("order-1", Map.of("n", "1"));
                TopicPublished again = idempotent.publish("order-1", Map.of("n", "1"));
                assertEquals(Partitions.of("order-1", 4), first.partition());
                assertEquals(first, again);
                TopicPublished keyed = idempotent.publishKeyed("order-2", "user:1000", Map.of("n", "2"));
                assertEquals(Partitions.of("user:1000", 4), keyed.partition());
            }
            long total = 0;
            for (int p = 0; p < 4; p++) {
                total += r.xlen(Keys.partitionStream(TOPIC, p));
            }
            assertEquals(2, total);
        } finally {
            admin.shutdown();
        }
    }

    @Test
    void noTopicIsRefusedNamingIt() {
        Support.fresh();
        NotATopicException refused = assertThrows(NotATopicException.class, TopicProducerTest::producer);
        assertTrue(refused.getMessage().contains("'orders' is not a topic"), refused.getMessage());
    }

    @Test
    void anotherContractIsRefusedNamingTheTopic() {
        RedisCommands<String, String> r = Support.fresh();
        r.hset(Keys.topic(TOPIC), Map.of("partitions", "4", "contractVersion", "3"));
        TopicContractException refused = assertThrows(TopicContractException.class, TopicProducerTest::producer);
        assertEquals("3", refused.operatorVersion());
        assertTrue(refused.getMessage().contains("topic 'orders'"), refused.getMessage());
    }
}
