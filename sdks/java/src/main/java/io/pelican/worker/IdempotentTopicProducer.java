package io.pelican.worker;

import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;

/**
 * A {@link TopicProducer} whose every publish carries {@code IDMP <producer id> <message id>}, as an
 * {@link IdempotentProducer} does into a stream. A message without a key goes to the partition of its message id
 * rather than round robin, so that publishing it again reaches the partition that has it. Made by
 * {@link TopicProducer#idempotent()}; it publishes on that producer's connection, closed with it.
 */
public final class IdempotentTopicProducer {
    private final TopicProducer producer;
    private final String producerId;
    /** The trace fields of publishes whose outcome was unknown, sent again by the next attempt. */
    private final Carried carried = new Carried();

    IdempotentTopicProducer(TopicProducer producer, String producerId) {
        this.producer = producer;
        this.producerId = producerId;
    }

    public String producerId() {
        return producerId;
    }

    public String topic() {
        return producer.topic();
    }

    public int partitions() {
        return producer.partitions();
    }

    /** Adds the message {@code messageId} once within the window, to the partition of {@code messageId}. */
    public TopicPublished publish(String messageId, Map<String, ?> fields) throws PublishException {
        return publish(Partitions.of(messageId, partitions()), messageId, null, List.of(), fields);
    }

    /** Adds the message {@code messageId} once within the window, to the partition of {@code key}, the key first. */
    public TopicPublished publishKeyed(String messageId, String key, Map<String, ?> fields) throws PublishException {
        byte[] raw = key.getBytes(StandardCharsets.UTF_8);
        return publish(Partitions.of(raw, partitions()), messageId, key, TopicProducer.keyField(raw), fields);
    }

    private TopicPublished publish(int partition, String messageId, String key, List<byte[]> first,
            Map<String, ?> fields) throws PublishException {
        List<byte[]> prefix = new ArrayList<>(List.of(Worker.bytes("IDMP"), Worker.bytes(producerId),
                Worker.bytes(messageId)));
        prefix.addAll(first);
        String id = producer.partition(partition).publishArguments(Producer.arguments(prefix, fields),
                new Tracing.Send(key, messageId, 0), carried);
        return new TopicPublished(partition, id);
    }
}
