package io.pelican.worker;

import java.util.Objects;
import java.util.regex.Pattern;

/** How a handler ended a message. An exception is a failure, not an outcome. */
public final class Outcome {
    /** The kinds of outcome. */
    public enum Kind {
        DONE,
        RETRY,
        TERMINAL
    }

    private static final Pattern REASON = Pattern.compile("[A-Z][A-Za-z0-9]{0,62}");
    private static final Outcome DONE = new Outcome(Kind.DONE, null);
    private static final Outcome RETRY = new Outcome(Kind.RETRY, null);

    private final Kind kind;
    private final String reason;

    private Outcome(Kind kind, String reason) {
        this.kind = kind;
        this.reason = reason;
    }

    /** Processed: acknowledge. */
    public static Outcome done() {
        return DONE;
    }

    /** Failed, retry it under the policy's backoff without waiting {@code minIdle} (the delivery counts). */
    public static Outcome retry() {
        return RETRY;
    }

    /**
     * Will never succeed: acknowledge and count under {@code reason}, e.g. {@code RecordNotFound}.
     *
     * @throws InvalidReasonException unless the reason matches {@code ^[A-Z][A-Za-z0-9]{0,62}$}
     */
    public static Outcome terminal(String reason) {
        if (reason == null || !REASON.matcher(reason).matches()) {
            throw new InvalidReasonException(String.valueOf(reason));
        }
        return new Outcome(Kind.TERMINAL, reason);
    }

    public Kind kind() {
        return kind;
    }

    /** The terminal reason; {@code null} for the other kinds. */
    public String reason() {
        return reason;
    }

    @Override
    public boolean equals(Object other) {
        return other instanceof Outcome that && kind == that.kind && Objects.equals(reason, that.reason);
    }

    @Override
    public int hashCode() {
        return Objects.hash(kind, reason);
    }

    @Override
    public String toString() {
        return reason == null ? kind.name().toLowerCase() : "terminal(" + reason + ")";
    }
}
