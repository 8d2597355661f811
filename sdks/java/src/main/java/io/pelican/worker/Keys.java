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

    private static String prefix(String stream) {
        return "{" + hashTag(stream) + "}:pelican:" + stream;
    }
}
