package io.pelican.worker;

/** A terminal reason that is not CamelCase; thrown before anything is written, so the message fails. */
public final class InvalidReasonException extends IllegalArgumentException {
    private static final long serialVersionUID = 1L;

    public InvalidReasonException(String reason) {
        super("invalid terminal reason code '" + reason + "': it must be CamelCase, match ^[A-Z][A-Za-z0-9]{0,62}$ "
                + "(e.g. RecordNotFound)");
    }
}
