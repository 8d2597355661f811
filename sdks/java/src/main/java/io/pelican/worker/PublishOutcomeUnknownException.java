package io.pelican.worker;

/**
 * The connection broke or timed out after the call may have reached the server: the entry may be in the stream.
 * Publishing again may write it twice: reconcile first, or publish with an {@link IdempotentProducer}.
 */
public final class PublishOutcomeUnknownException extends PublishException {
    private static final long serialVersionUID = 1L;

    public PublishOutcomeUnknownException(String message, Throwable cause) {
        super("outcome unknown (may have been written): " + message, cause);
    }

    @Override
    public boolean certainlyNotWritten() {
        return false;
    }
}
