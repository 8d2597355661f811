package io.pelican.worker;

import static io.pelican.worker.Support.GROUP;
import static io.pelican.worker.Support.STREAM;
import static io.pelican.worker.Support.eventually;
import static io.pelican.worker.TopicSupport.TOPIC;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.XGroupCreateArgs;
import io.lettuce.core.XReadArgs.StreamOffset;
import io.lettuce.core.cluster.RedisClusterClient;
import io.lettuce.core.cluster.api.sync.RedisAdvancedClusterCommands;
import java.time.Duration;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import org.junit.jupiter.api.Test;

/** A Redis Cluster of three primaries: a plain stream, and a topic whose partitions it spreads over its shards. */
class ClusterTest {
    @Test
    void aProducerAndAWorkerOnAClusterPublishAndHandleAStream() throws PublishException {
        RedisCluster cluster = RedisCluster.shared();
        RedisAdvancedClusterCommands<String, String> r = cluster.fresh();
        r.xgroupCreate(StreamOffset.from(STREAM, "0"), GROUP, XGroupCreateArgs.Builder.mkstream());
        r.hset(Keys.settings(STREAM, GROUP), Map.of("minIdleMs", "30000", "retryAfterMs", "30000"));
        Set<String> handled = ConcurrentHashMap.newKeySet();
        RedisClusterClient client = cluster.client();
        try (Producer producer = Producer.builder(cluster.uri()).stream(STREAM).cluster(true).build();
                Worker worker = Worker.builder(client).stream(STREAM).group(GROUP).consumer("worker-1")
                        .block(Duration.ofMillis(100)).handler(message -> {
                            handled.add(message.text("n"));
                            return Outcome.done();
                        }).build()) {
            worker.start();
            for (int i = 0; i < 10; i++) {
                producer.publish(Map.of("n", i));
            }
            eventually(() -> handled.size() == 10, "every message handled");
            eventually(() -> r.xpending(STREAM, GROUP).getCount() == 0, "every message acknowledged");
        } finally {
            client.shutdown();
        }
    }

    @Test
    void aTopicsPartitionsSpreadOverTheShardsAndItsMembersHandleEveryKeyedMessage() throws PublishException {
        RedisCluster cluster = RedisCluster.shared();
        RedisAdvancedClusterCommands<String, String> r = cluster.fresh();
        TopicSupport.writeTopic(r, 4, 30_000);
        Set<Integer> shards = new HashSet<>();
        for (int p = 0; p < 4; p++) {
            shards.add(cluster.nodeOf(Keys.partitionStream(TOPIC, p)));
        }
        assertTrue(shards.size() >= 2, "the partitions live on " + shards.size() + " shard(s)");
        Map<String, Integer> handled = new ConcurrentHashMap<>();
        RedisClusterClient client = cluster.client();
        Handler handler = message -> {
            handled.put(message.text("n"), message.partition().getAsInt());
            return Outcome.done();
        };
        try (TopicWorker a = TopicWorker.builder(client).topic(TOPIC).group(GROUP).consumer("member-a")
                        .membershipTtl(Duration.ofSeconds(3)).block(Duration.ofMillis(100)).handler(handler).build();
                TopicWorker b = TopicWorker.builder(client).topic(TOPIC).group(GROUP).consumer("member-b")
                        .membershipTtl(Duration.ofSeconds(3)).block(Duration.ofMillis(100)).handler(handler).build();
                TopicProducer producer = TopicProducer.builder(cluster.uri()).topic(TOPIC).cluster(true).build()) {
            a.start();
            b.start();
            eventually(() -> a.owned().size() == 2 && b.owned().size() == 2, Duration.ofSeconds(10), "a balanced group");
            for (int i = 0; i < 20; i++) {
                producer.publishKeyed("key-" + i, Map.of("n", i));
            }
            eventually(() -> handled.size() == 20, "every message handled");
        } finally {
            client.shutdown();
        }
        for (int i = 0; i < 20; i++) {
            assertEquals(Partitions.of("key-" + i, 4), handled.get(Integer.toString(i)));
        }
        long pending = 0;
        for (int p = 0; p < 4; p++) {
            pending += r.xpending(Keys.partitionStream(TOPIC, p), GROUP).getCount();
        }
        assertEquals(0, pending);
        assertEquals(List.of(), List.copyOf(r.hkeys(Keys.members(TOPIC, GROUP))), "both left the group");
    }
}
