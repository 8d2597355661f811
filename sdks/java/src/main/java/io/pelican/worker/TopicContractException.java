package io.pelican.worker;

/** The topic is described under a worker contract this library does not know for topics: nothing is read. */
public final class TopicContractException extends RuntimeException {
    private static final long serialVersionUID = 1L;

    private final String topic;
    private final String operatorVersion;

    TopicContractException(String topic, String operatorVersion) {
        super("topic '" + topic + "' is described under worker contract " + (operatorVersion == null ? "(none)"
                : "'" + operatorVersion + "'") + ", this library knows topics of contract "
                + Partitions.TOPIC_CONTRACT_VERSION + ": upgrade the library (io.pelican:pelican-worker)");
        this.topic = topic;
        this.operatorVersion = operatorVersion;
    }

    /** The topic asked for. */
    public String topic() {
        return topic;
    }

    /** The {@code contractVersion} the operator wrote; {@code null} when there is none. */
    public String operatorVersion() {
        return operatorVersion;
    }
}
