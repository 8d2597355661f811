package io.pelican.worker;

import io.lettuce.core.XGroupCreateArgs;
import io.lettuce.core.XReadArgs.StreamOffset;
import io.lettuce.core.cluster.api.sync.RedisClusterCommands;
import java.util.LinkedHashMap;
import java.util.Map;

/** A topic as the operator makes it: its description, the settings of the topic and of each partition, the groups. */
final class TopicSupport {
    static final String TOPIC = "orders";

    private TopicSupport() {}

    /** Topic {@link #TOPIC} of {@code partitions} for {@link Support#GROUP}, its settings' {@code extra} fields added. */
    static void writeTopic(RedisClusterCommands<String, String> r, int partitions, long minIdleMs, String... extra) {
        r.hset(Keys.topic(TOPIC), Map.of("partitions", Integer.toString(partitions), "contractVersion", "2"));
        Map<String, String> settings = new LinkedHashMap<>();
        settings.put("contractVersion", "2");
        settings.put("partitions", Integer.toString(partitions));
        settings.put("ordering", "None");
        settings.put("backoffFactor", "1");
        settings.put("backoffMaxMs", "0");
        settings.put("minIdleMs", Long.toString(minIdleMs));
        settings.put("retryAfterMs", Long.toString(minIdleMs));
        settings.put("maxDeliveries", "5");
        for (int i = 0; i + 1 < extra.length; i += 2) {
            settings.put(extra[i], extra[i + 1]);
        }
        r.hset(Keys.settings(TOPIC, Support.GROUP), settings);
        for (int p = 0; p < partitions; p++) {
            String stream = Keys.partitionStream(TOPIC, p);
            r.hset(Keys.settings(stream, Support.GROUP), settings);
            r.xgroupCreate(StreamOffset.from(stream, "0"), Support.GROUP, XGroupCreateArgs.Builder.mkstream());
        }
    }
}
