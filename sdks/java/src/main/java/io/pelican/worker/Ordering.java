package io.pelican.worker;

/** How a topic's entries are handled: its settings' {@code ordering}. */
public enum Ordering {
    /** As on a stream: up to the concurrency at once, failures retried by the operator's pass. */
    NONE,
    /**
     * The entries of one key one at a time, in id order; a failure or a retry runs again in place after the backoff,
     * and its key waits (contract/README.md, "Order per key").
     */
    PER_KEY
}
