package io.pelican.worker;

/** The server has no {@code XADD ... IDMP} (Redis 8.6 or later), or would not say. */
public final class IdempotenceUnsupportedException extends RuntimeException {
    private static final long serialVersionUID = 1L;

    public IdempotenceUnsupportedException(String message, Throwable cause) {
        super(message, cause);
    }
}
