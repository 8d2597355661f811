package io.pelican.worker;

import io.lettuce.core.RedisURI;
import io.lettuce.core.resource.ClientResources;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * Publishes into the partitions of one topic (contract/README.md, "The partition of a key"): a message with a key to
 * the key's partition, the key its first field ({@link Keys#KEY_FIELD}); one without a key round robin, one step per
 * message. Each partition is published to as a {@link Producer} publishes to its stream, on one connection: a
 * partition's bound refuses as a stream's does, and the errors are the same {@link PublishException}s.
 *
 * <pre>{@code
 * try (TopicProducer orders = TopicProducer.builder(RedisURI.create("redis://localhost:6379")).topic("orders").build()) {
 *     orders.publishKeyed("customer-7", Map.of("order", "42"));   // after every earlier message of customer-7
 * }
 * }</pre>
 *
 * <p>Safe for concurrent use.
 */
public final class TopicProducer implements AutoCloseable {
    private final String topic;
    private final List<Producer> producers;
    private final AtomicInteger next = new AtomicInteger();

    private TopicProducer(String topic, List<Producer> producers) {
        this.topic = topic;
        this.producers = producers;
    }

    public static Builder builder(RedisURI uri) {
        return new Builder(Objects.requireNonNull(uri, "uri"));
    }

    public String topic() {
        return topic;
    }

    /** N: the partitions <code>{T:0}</code> .. <code>{T:N-1}</code>. */
    public int partitions() {
        return producers.size();
    }

    /** Adds one entry without a key to the next partition, round robin (fields as {@link Producer#publish}). */
    public TopicPublished publish(Map<String, ?> fields) throws PublishException {
        int partition = Math.floorMod(next.getAndIncrement(), producers.size());
        return new TopicPublished(partition, producers.get(partition).publish(fields));
    }

    /** Adds one entry to the partition of {@code key} (its UTF-8 bytes), with {@code pelican-key} its first field. */
    public TopicPublished publishKeyed(String key, Map<String, ?> fields) throws PublishException {
        return publishKeyed(key.getBytes(StandardCharsets.UTF_8), fields);
    }

    /** Adds one entry to the partition of {@code key}, with {@code pelican-key} (the key's bytes) its first field. */
    public TopicPublished publishKeyed(byte[] key, Map<String, ?> fields) throws PublishException {
        int partition = Partitions.of(key, producers.size());
        String id = producers.get(partition).publishArguments(Producer.arguments(keyField(key), fields),
                Tracing.Send.keyed(new String(key, StandardCharsets.UTF_8)), null);
        return new TopicPublished(partition, id);
    }

    /** This producer's publishes made idempotent under the Pod's name ({@link PodName#get()}). */
    public IdempotentTopicProducer idempotent() throws PublishException {
        return idempotent(PodName.get());
    }

    /**
     * This producer's publishes made idempotent under {@code producerId}, as {@link Producer#idempotent(String)}.
     *
     * @throws IdempotenceUnsupportedException when the server has no {@code XADD ... IDMP}
     * @throws PublishException when the server could not be asked (unavailable, or outcome unknown)
     */
    public IdempotentTopicProducer idempotent(String producerId) throws PublishException {
        // The check is the server's, the same for every partition.
        producers.get(0).idempotent(producerId);
        return new IdempotentTopicProducer(this, producerId);
    }

    /** Closes the connection and the producer's client. */
    @Override
    public void close() {
        producers.get(0).close();
    }

    Producer partition(int partition) {
        return producers.get(partition);
    }

    /** {@code pelican-key <key>}: the arguments a keyed entry starts with. */
    static List<byte[]> keyField(byte[] key) {
        return List.of(Worker.bytes(Keys.KEY_FIELD), key);
    }

    /** The options of a {@link TopicProducer}; {@code topic} is required. */
    public static final class Builder {
        private final RedisURI uri;
        private String topic;
        private Duration timeout = Duration.ofSeconds(10);
        private ClientResources resources;
        private boolean cluster;

        private Builder(RedisURI uri) {
            this.uri = uri;
        }

        /** {@code true}: the URI names a node of a Redis Cluster, as {@link Producer.Builder#cluster}. */
        public Builder cluster(boolean cluster) {
            this.cluster = cluster;
            return this;
        }

        /** The topic: the policy's {@code spec.stream}. */
        public Builder topic(String topic) {
            this.topic = topic;
            return this;
        }

        /** How long a publish waits for its reply, as {@link Producer.Builder#timeout}. Default 10 s. */
        public Builder timeout(Duration timeout) {
            this.timeout = timeout;
            return this;
        }

        /** Lettuce's resources (event loops) to share with the application's clients; default: the client's own. */
        public Builder clientResources(ClientResources resources) {
            this.resources = resources;
            return this;
        }

        /**
         * Connects and reads the topic's description (<code>{T}:pelican:T:topic</code>).
         *
         * @throws NotATopicException when no policy with {@code spec.partitions} describes the topic
         * @throws TopicContractException when it is described under a contract this library does not know
         * @throws PublishException when the description could not be read
         */
        public TopicProducer build() throws PublishException {
            Objects.requireNonNull(topic, "topic");
            if (topic.isEmpty() || topic.contains("{") || topic.contains("}")) {
                throw new IllegalArgumentException("a topic's name is not empty and holds no { or }, got '" + topic + "'");
            }
            Producer.Builder first = Producer.builder(uri).stream(Keys.partitionStream(topic, 0)).timeout(timeout)
                    .cluster(cluster);
            if (resources != null) {
                first.clientResources(resources);
            }
            Producer root = first.build();
            try {
                int n = Partitions.described(topic, null, root.hash(Keys.topic(topic)));
                List<Producer> producers = new ArrayList<>(n);
                producers.add(root);
                for (int i = 1; i < n; i++) {
                    producers.add(new Producer(root, Keys.partitionStream(topic, i)));
                }
                return new TopicProducer(topic, List.copyOf(producers));
            } catch (PublishException | RuntimeException e) {
                root.close();
                throw e;
            }
        }
    }
}
