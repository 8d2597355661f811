package io.pelican.worker;

/**
 * No policy with {@code spec.partitions} describes the topic (yet): for the group, when a {@link TopicWorker} asks,
 * or for any group, when a {@link TopicProducer} does. Nothing was read or written.
 */
public final class NotATopicException extends RuntimeException {
    private static final long serialVersionUID = 1L;

    private final String topic;

    NotATopicException(String topic, String group) {
        super(group != null
                ? "the settings of topic '" + topic + "' group '" + group + "' describe no topic: apply its policy with "
                        + "spec.partitions, or run a Worker for a stream"
                : "'" + topic + "' is not a topic: no policy with spec.partitions describes it (yet); apply one, or "
                        + "publish with a Producer if it is a plain stream");
        this.topic = topic;
    }

    /** The topic asked for. */
    public String topic() {
        return topic;
    }
}
