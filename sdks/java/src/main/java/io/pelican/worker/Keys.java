package io.pelican.worker;

/**
 * Pelican's Redis key names and entry fields, as the worker contract lists them. Every key lives in the stream's hash
 * slot: {@code {T}:pelican:...} with {@code T} the stream's {@linkplain #hashTag hash tag}.
 */
public final class Keys {
    /** The field a requeued copy carries with the message's deliveries before it. */
    public static final String DELIVERIES_FIELD = "pelican-deliveries";
    /** The field a requeued copy carries with the id the message was first published under. */
    public static final String ORIGIN_ID_FIELD = "pelican-origin-id";
    /** The field a topic's keyed message carries first: its key (contract/README.md, "The partition of a key"). */
    public static final String KEY_FIELD = "pelican-key";
    /** The most bytes of a message's last error a worker writes. */
    public static final int ERROR_TEXT_MAX = 1024;

    private Keys() {}

    /**
     * The content of the first {@code {...}} of {@code stream} when it is not empty, else the whole name: Redis
     * Cluster's rule (the first <code>{</code> and the first <code>}</code> after it).
     */
    public static String hashTag(String stream) {
        int open = stream.indexOf('{');
        if (open >= 0) {
            int close = stream.indexOf('}', open + 1);
            if (close > open + 1) {
                return stream.substring(open + 1, close);
            }
        }
        return stream;
    }

    /** {@code {T}:pelican:<stream>:<group>:settings}: the group's settings, written by the operator. */
    public static String settings(String stream, String group) {
        return prefix(stream) + ":" + group + ":settings";
    }

    /** {@code {T}:pelican:<stream>:<group>:terminal}: reason -> messages ended as terminal. */
    public static String terminal(String stream, String group) {
        return prefix(stream) + ":" + group + ":terminal";
    }

    /** {@code {T}:pelican:<stream>:<group>:errors}: pending entry id -> the text of its last failure. */
    public static String errors(String stream, String group) {
        return prefix(stream) + ":" + group + ":errors";
    }

    /**
     * {@code {T}:pelican:<stream>:<group>:consumers}: consumer -> its last lease tick (the server's time, ms), the
     * heartbeat {@code strategy: Reassign} hands work to live workers by.
     */
    public static String consumers(String stream, String group) {
        return prefix(stream) + ":" + group + ":consumers";
    }

    /** {@code {T}:pelican:<stream>:bounds}: group -> {@code backlog.maxLength}, read by the bounded publish scripts. */
    public static String bounds(String stream) {
        return prefix(stream) + ":bounds";
    }

    /** {@code {T}:pelican:<stream>:rejected}: group -> publishes refused for it. */
    public static String rejected(String stream) {
        return prefix(stream) + ":rejected";
    }

    /**
     * <code>{T:i}</code>: partition {@code i} of topic {@code T}, a stream whose whole name is its hash tag, so that a
     * Redis Cluster spreads the partitions over its shards.
     */
    public static String partitionStream(String topic, int partition) {
        return "{" + topic + ":" + partition + "}";
    }

    /** {@code {T}:pelican:T:topic}: the topic's description for producers ({@code partitions}, {@code contractVersion}). */
    public static String topic(String topic) {
        return prefix(topic) + ":topic";
    }

    /** {@code {T}:pelican:T:<group>:members}: member -> its membership deadline (the server's time, ms). */
    public static String members(String topic, String group) {
        return prefix(topic) + ":" + group + ":members";
    }

    /** {@code {T}:pelican:T:<group>:owners}: partition index -> the member that owns it. */
    public static String owners(String topic, String group) {
        return prefix(topic) + ":" + group + ":owners";
    }

    /** {@code {T}:pelican:T:<group>:epochs}: partition index -> its epoch, incremented at every hand-over. */
    public static String epochs(String topic, String group) {
        return prefix(topic) + ":" + group + ":epochs";
    }

    private static String prefix(String stream) {
        return "{" + hashTag(stream) + "}:pelican:" + stream;
    }
}
