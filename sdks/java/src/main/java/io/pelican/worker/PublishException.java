package io.pelican.worker;

/**
 * Why a publish returned no id: {@link PublishRefusedException}, {@link PublishUnavailableException},
 * {@link PublishFailedException} or {@link PublishOutcomeUnknownException}. Whether to publish again is the caller's
 * decision, made from the class: the producer never resends.
 */
public abstract sealed class PublishException extends Exception
        permits PublishRefusedException, PublishUnavailableException, PublishFailedException,
                PublishOutcomeUnknownException {
    private static final long serialVersionUID = 1L;

    PublishException(String message, Throwable cause) {
        super(message, cause);
    }

    /** Whether the entry is surely not in the stream (false only for an unknown outcome). */
    public boolean certainlyNotWritten() {
        return true;
    }
}
