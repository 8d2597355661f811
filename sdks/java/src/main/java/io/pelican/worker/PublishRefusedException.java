package io.pelican.worker;

/** A bounded group's backlog is full: nothing was written. Publish again later, with backoff and jitter. */
public final class PublishRefusedException extends PublishException {
    private static final long serialVersionUID = 1L;

    private final String group;
    private final long backlog;
    private final long max;

    public PublishRefusedException(String group, long backlog, long max) {
        super("refused: the backlog of group '" + group + "' is " + backlog + ", its bound is " + max, null);
        this.group = group;
        this.backlog = backlog;
        this.max = max;
    }

    /** The bounded group whose backlog is full. */
    public String group() {
        return group;
    }

    public long backlog() {
        return backlog;
    }

    /** The group's {@code backlog.maxLength}. */
    public long max() {
        return max;
    }
}
