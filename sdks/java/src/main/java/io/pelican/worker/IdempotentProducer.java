package io.pelican.worker;

import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;

/**
 * A producer whose every publish carries {@code IDMP <producer id> <message id>} (Redis 8.6+, {@code XADD ... IDMP}):
 * within the stream's window a publish of a message id this producer already published writes nothing and answers
 * the first entry's id, so a publish that ended {@link PublishOutcomeUnknownException} is simply published again. The
 * message id is the application's (an order number), never random per attempt. Made by
 * {@link Producer#idempotent()}; it publishes on that producer's connection, closed with it.
 */
public final class IdempotentProducer {
    private final Producer producer;
    private final String producerId;
    /** The trace fields of publishes whose outcome was unknown, sent again by the next attempt. */
    private final Carried carried = new Carried();

    /** Made once the server said its {@code XADD} takes {@code IDMP}: see {@link #check(Producer)}. */
    IdempotentProducer(Producer producer, String producerId) {
        this.producer = producer;
        this.producerId = producerId;
    }

    public String producerId() {
        return producerId;
    }

    public String stream() {
        return producer.stream();
    }

    /**
     * Asks the server whether its {@code XADD} takes {@code IDMP} ({@code COMMAND DOCS XADD}: by the command's
     * arguments, not by the server's version).
     *
     * @throws IdempotenceUnsupportedException when the server has no {@code XADD ... IDMP}
     * @throws PublishException when the server could not be asked (unavailable, or outcome unknown)
     */
    static void check(Producer producer) throws PublishException {
        List<Object> docs;
        try {
            docs = producer.commandDocs("XADD");
        } catch (PublishFailedException e) {
            throw new IdempotenceUnsupportedException("could not ask the server for XADD's arguments: " + e.getMessage(), e);
        }
        if (!hasToken(docs, "IDMP")) {
            throw new IdempotenceUnsupportedException("the server has no XADD ... IDMP (Redis 8.6 or later): a retried "
                    + "publish may duplicate; publish with Producer and reconcile by an id of your own in the entry's "
                    + "fields", null);
        }
    }

    /** Adds the entry unless this producer published {@code messageId} within the window; answers the one entry's id. */
    public String publish(String messageId, Map<String, ?> fields) throws PublishException {
        return producer.publishArguments(Producer.arguments(idmp(messageId), fields),
                new Tracing.Send(null, messageId, 0), carried);
    }

    /**
     * {@link Producer#publishBatch} with a message id per entry: message id -> fields, in the map's iteration order. A
     * batch that ended {@link PublishOutcomeUnknownException} is simply published again whole.
     */
    public Published publishBatch(Map<String, ? extends Map<String, ?>> entries) throws PublishException {
        List<List<byte[]>> flat = new ArrayList<>(entries.size());
        for (Map.Entry<String, ? extends Map<String, ?>> entry : entries.entrySet()) {
            flat.add(Producer.arguments(idmp(entry.getKey()), entry.getValue()));
        }
        return producer.publishBatchArguments(flat);
    }

    private List<byte[]> idmp(String messageId) {
        return List.of(Worker.bytes("IDMP"), Worker.bytes(producerId), Worker.bytes(messageId));
    }

    /** Whether a {@code COMMAND DOCS} reply has an argument whose {@code token} is {@code token}, at any depth. */
    static boolean hasToken(List<?> reply, String token) {
        for (int i = 0; i < reply.size(); i++) {
            Object item = reply.get(i);
            if (is(item, "token") && i + 1 < reply.size() && is(reply.get(i + 1), token)) {
                return true;
            }
            if (item instanceof List<?> child && hasToken(child, token)) {
                return true;
            }
        }
        return false;
    }

    private static boolean is(Object value, String word) {
        String text = value instanceof byte[] raw ? new String(raw, StandardCharsets.UTF_8)
                : value instanceof String s ? s : null;
        return word.equalsIgnoreCase(text);
    }
}
