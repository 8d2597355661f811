package io.pelican.worker;

import static io.pelican.worker.Support.GROUP;
import static io.pelican.worker.Support.STREAM;
import static io.pelican.worker.Support.eventually;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.RedisClient;
import io.lettuce.core.RedisURI;
import io.lettuce.core.XGroupCreateArgs;
import io.lettuce.core.XReadArgs.StreamOffset;
import io.lettuce.core.api.sync.RedisCommands;
import io.lettuce.core.sentinel.api.sync.RedisSentinelCommands;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.net.InetSocketAddress;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import org.junit.jupiter.api.Test;

/**
 * Through Sentinel: a primary, its replica and one sentinel on loopback ports. A worker and a producer that name the
 * sentinel follow a {@code SENTINEL FAILOVER}: what is published after it is handled.
 */
class SentinelTest {
    private static final String MASTER = "pelican";

    @Test
    void aWorkerAndAProducerFollowAFailover() throws Exception {
        String binary = RedisServer.binary();
        // Directories of their own: a replica writes the primary's snapshot as dump.rdb where it runs.
        RedisServer primary = RedisServer.start(binary, "--dir", Files.createTempDirectory("pelican-primary-").toString());
        RedisServer replica = RedisServer.start(binary, "--replicaof", "127.0.0.1", Integer.toString(primary.port),
                "--dir", Files.createTempDirectory("pelican-replica-").toString());
        RedisServer sentinel = RedisServer.startSentinel(binary, sentinelConfig(primary.port));
        RedisClient admin = RedisClient.create(primary.uri());
        RedisClient sentinels = RedisClient.create(sentinel.uri());
        RedisURI through = RedisURI.Builder.sentinel("127.0.0.1", sentinel.port, MASTER).build();
        Set<String> handled = ConcurrentHashMap.newKeySet();
        try {
            RedisCommands<String, String> r = admin.connect().sync();
            r.xgroupCreate(StreamOffset.from(STREAM, "0"), GROUP, XGroupCreateArgs.Builder.mkstream());
            r.hset(Keys.settings(STREAM, GROUP), Map.of("minIdleMs", "30000", "retryAfterMs", "30000"));
            RedisClient replicaClient = RedisClient.create(replica.uri());
            RedisCommands<String, String> onReplica = replicaClient.connect().sync();
            eventually(() -> onReplica.exists(Keys.settings(STREAM, GROUP)) == 1, Duration.ofSeconds(20),
                    "the replica in sync");
            RedisSentinelCommands<String, String> s = sentinels.connectSentinel().sync();
            eventually(() -> s.replicas(MASTER).size() == 1, Duration.ofSeconds(20), "the sentinel knowing the replica");
            try (Producer producer = Producer.builder(through).stream(STREAM).timeout(Duration.ofSeconds(2)).build();
                    Worker worker = Worker.builder(through).stream(STREAM).group(GROUP).consumer("worker-1")
                            .block(Duration.ofMillis(200)).handler(message -> {
                                handled.add(message.text("n"));
                                return Outcome.done();
                            }).build()) {
                worker.start();
                producer.publish(Map.of("n", "before"));
                eventually(() -> handled.contains("before"), "the message before the failover handled");
                s.failover(MASTER);
                eventually(() -> port(s.getMasterAddrByName(MASTER)) == replica.port, Duration.ofSeconds(20),
                        "the replica promoted");
                eventually(() -> r.role().get(0).equals("slave"), Duration.ofSeconds(20), "the old primary demoted");
                // Published until the producer reaches the new primary: a publish meanwhile may find no server.
                eventually(() -> {
                    try {
                        producer.publish(Map.of("n", "after"));
                        return true;
                    } catch (PublishUnavailableException | PublishOutcomeUnknownException e) {
                        return false;
                    } catch (PublishException e) {
                        throw new IllegalStateException(e);
                    }
                }, Duration.ofSeconds(20), "a publish to the new primary");
                eventually(() -> handled.contains("after"), Duration.ofSeconds(20),
                        "the message published after the failover handled");
            }
            assertTrue(onReplica.xlen(STREAM) >= 2, "both messages on the new primary");
            assertEquals(0, onReplica.xpending(STREAM, GROUP).getCount(), "acknowledged on the new primary");
            replicaClient.shutdown();
        } finally {
            admin.shutdown();
            sentinels.shutdown();
        }
    }

    private static int port(java.net.SocketAddress address) {
        return ((InetSocketAddress) address).getPort();
    }

    /** A sentinel's config (it rewrites the file): the primary, down after 1 s, one sentinel agreeing. */
    private static Path sentinelConfig(int primaryPort) {
        try {
            Path config = Files.createTempFile("pelican-sentinel-", ".conf");
            Files.writeString(config, "sentinel monitor " + MASTER + " 127.0.0.1 " + primaryPort + " 1\n"
                    + "sentinel down-after-milliseconds " + MASTER + " 1000\n"
                    + "sentinel failover-timeout " + MASTER + " 10000\n");
            return config;
        } catch (IOException e) {
            throw new UncheckedIOException(e);
        }
    }
}
