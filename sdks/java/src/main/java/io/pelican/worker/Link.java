package io.pelican.worker;

import io.lettuce.core.AbstractRedisClient;
import io.lettuce.core.RedisClient;
import io.lettuce.core.api.StatefulConnection;
import io.lettuce.core.api.StatefulRedisConnection;
import io.lettuce.core.cluster.RedisClusterClient;
import io.lettuce.core.cluster.api.StatefulRedisClusterConnection;
import io.lettuce.core.cluster.api.async.RedisClusterAsyncCommands;
import io.lettuce.core.cluster.api.sync.RedisClusterCommands;
import io.lettuce.core.cluster.models.partitions.RedisClusterNode;
import io.lettuce.core.codec.ByteArrayCodec;
import java.time.Duration;

/**
 * A connection to one server or to a Redis Cluster, through the command interfaces both kinds share: every key a call
 * names lives in one slot (the stream's hash tag), so a Cluster connection routes it to the shard that has it.
 */
final class Link implements AutoCloseable {
    private final StatefulConnection<byte[], byte[]> connection;
    final RedisClusterAsyncCommands<byte[], byte[]> async;
    final RedisClusterCommands<byte[], byte[]> sync;

    private Link(StatefulConnection<byte[], byte[]> connection, RedisClusterAsyncCommands<byte[], byte[]> async,
            RedisClusterCommands<byte[], byte[]> sync) {
        this.connection = connection;
        this.async = async;
        this.sync = sync;
    }

    /** A connection of {@code client}: a {@link RedisClient} or a {@link RedisClusterClient}. */
    static Link connect(AbstractRedisClient client) {
        if (client instanceof RedisClusterClient cluster) {
            StatefulRedisClusterConnection<byte[], byte[]> c = cluster.connect(ByteArrayCodec.INSTANCE);
            // Each primary's connection at once: Lettuce makes them lazily, and a client that rejects commands while
            // disconnected (a producer's) would refuse the first call to a shard as "not connected".
            for (RedisClusterNode node : c.getPartitions()) {
                if (node.is(RedisClusterNode.NodeFlag.UPSTREAM)) {
                    c.getConnection(node.getUri().getHost(), node.getUri().getPort());
                }
            }
            return new Link(c, c.async(), c.sync());
        }
        StatefulRedisConnection<byte[], byte[]> c = ((RedisClient) client).connect(ByteArrayCodec.INSTANCE);
        return new Link(c, c.async(), c.sync());
    }

    Duration timeout() {
        return connection.getTimeout();
    }

    @Override
    public void close() {
        connection.close();
    }
}
