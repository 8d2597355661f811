package io.pelican.worker;

/** A settings hash a worker cannot use: a field that is no decimal integer, or one it needs is missing. */
public final class SettingsException extends RuntimeException {
    private static final long serialVersionUID = 1L;

    public SettingsException(String message) {
        super(message);
    }
}
