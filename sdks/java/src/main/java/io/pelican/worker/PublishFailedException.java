package io.pelican.worker;

/** The server answered with another error (a key of the wrong type, an ACL): nothing was written; fix the cause. */
public final class PublishFailedException extends PublishException {
    private static final long serialVersionUID = 1L;

    public PublishFailedException(String message, Throwable cause) {
        super("failed (not written): " + message, cause);
    }
}
