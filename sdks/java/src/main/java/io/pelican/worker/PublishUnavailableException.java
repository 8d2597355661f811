package io.pelican.worker;

/**
 * Nothing was written and publishing again may succeed: the server answered {@code READONLY}, {@code LOADING},
 * {@code MASTERDOWN}, {@code BUSY} or {@code TRYAGAIN}, or the connection was down so the call was never sent.
 */
public final class PublishUnavailableException extends PublishException {
    private static final long serialVersionUID = 1L;

    public PublishUnavailableException(String message, Throwable cause) {
        super("unavailable (not written, try again): " + message, cause);
    }
}
