package io.pelican.worker;

import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * The trace fields of idempotent publishes whose outcome was unknown or unavailable, by message id, so that a publish
 * of the same message id sends them again: the entry written, by whichever attempt, carries the first attempt's
 * context (contract/README.md, "Trace context"). The last {@link #KEPT} message ids at most. Safe for concurrent use.
 */
final class Carried {
    /** How many message ids are kept. */
    static final int KEPT = 1024;

    /** In the order they were kept, oldest first. */
    private final Map<String, List<byte[]>> fields = new LinkedHashMap<>();

    /** The fields kept for {@code messageId}, forgotten; {@code null} when there are none. */
    synchronized List<byte[]> take(String messageId) {
        return fields.remove(messageId);
    }

    /** Keeps {@code kept} for {@code messageId} as the newest, forgetting the oldest past {@link #KEPT}. */
    synchronized void keep(String messageId, List<byte[]> kept) {
        fields.remove(messageId);
        fields.put(messageId, kept);
        if (fields.size() > KEPT) {
            Iterator<String> oldest = fields.keySet().iterator();
            oldest.next();
            oldest.remove();
        }
    }
}
