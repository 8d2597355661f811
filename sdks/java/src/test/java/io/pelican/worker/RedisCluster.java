package io.pelican.worker;

import io.lettuce.core.RedisURI;
import io.lettuce.core.cluster.RedisClusterClient;
import io.lettuce.core.cluster.api.sync.RedisAdvancedClusterCommands;
import java.io.File;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Assertions;

/**
 * A Redis Cluster of three primaries on loopback ports ({@code redis-server --cluster-enabled yes}, joined by
 * {@code redis-cli --cluster create}), started once per test JVM, and an admin client of it.
 */
final class RedisCluster {
    private static RedisCluster shared;

    final List<RedisServer> nodes;
    private final RedisClusterClient admin;
    private final RedisAdvancedClusterCommands<String, String> commands;

    private RedisCluster(List<RedisServer> nodes) {
        this.nodes = nodes;
        this.admin = client();
        this.commands = admin.connect().sync();
    }

    static synchronized RedisCluster shared() {
        if (shared == null) {
            shared = new RedisCluster(start(3));
        }
        return shared;
    }

    private static List<RedisServer> start(int count) {
        Path dir;
        try {
            dir = Files.createTempDirectory("pelican-cluster-");
        } catch (IOException e) {
            throw new UncheckedIOException(e);
        }
        String binary = RedisServer.binary();
        List<RedisServer> nodes = new ArrayList<>();
        List<String> create = new ArrayList<>(List.of(cli(binary), "--cluster", "create"));
        for (int i = 0; i < count; i++) {
            RedisServer node = RedisServer.start(binary, "--cluster-enabled", "yes", "--cluster-config-file",
                    dir.resolve("nodes-" + i + ".conf").toString(), "--dir", dir.toString());
            nodes.add(node);
            create.add("127.0.0.1:" + node.port);
        }
        create.addAll(List.of("--cluster-replicas", "0", "--cluster-yes"));
        run(create);
        for (RedisServer node : nodes) {
            long deadline = System.nanoTime() + Duration.ofSeconds(15).toNanos();
            while (!run(List.of(cli(binary), "-p", Integer.toString(node.port), "cluster", "info"))
                    .contains("cluster_state:ok")) {
                if (System.nanoTime() > deadline) {
                    Assertions.fail("the cluster's node " + node.port + " did not say cluster_state:ok");
                }
                RedisServer.sleep(50);
            }
        }
        return nodes;
    }

    /** The redis-cli beside {@code binary}, else the one on PATH. */
    private static String cli(String binary) {
        File beside = new File(new File(binary).getParentFile(), "redis-cli");
        return beside.canExecute() ? beside.getPath() : "redis-cli";
    }

    private static String run(List<String> command) {
        try {
            Process process = new ProcessBuilder(command).redirectErrorStream(true).start();
            String out = new String(process.getInputStream().readAllBytes(), StandardCharsets.UTF_8);
            if (!process.waitFor(30, TimeUnit.SECONDS) || process.exitValue() != 0) {
                Assertions.fail(String.join(" ", command) + " failed: " + out);
            }
            return out;
        } catch (IOException e) {
            throw new UncheckedIOException(e);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new IllegalStateException(e);
        }
    }

    /** The URI of the first node: a client learns the others from it. */
    RedisURI uri() {
        return nodes.get(0).uri();
    }

    String url() {
        return nodes.get(0).url();
    }

    /** A cluster client of the application's kind, to shut down after. */
    RedisClusterClient client() {
        return RedisClusterClient.create(uri());
    }

    /** The admin's commands, every primary emptied first. */
    RedisAdvancedClusterCommands<String, String> fresh() {
        commands.upstream().commands().flushall();
        return commands;
    }

    /** The port of the node that serves {@code key}. */
    int nodeOf(String key) {
        int slot = io.lettuce.core.cluster.SlotHash.getSlot(key);
        return admin.getPartitions().getPartitionBySlot(slot).getUri().getPort();
    }
}
