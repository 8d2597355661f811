package io.pelican.worker;

import java.util.stream.Collectors;

/** The operator speaks a worker contract this library does not know: the worker refuses to start. */
public final class ContractVersionException extends RuntimeException {
    private static final long serialVersionUID = 1L;

    private final String operatorVersion;

    public ContractVersionException(String operatorVersion) {
        super("the operator speaks worker contract " + operatorVersion + ", this library knows "
                + Settings.KNOWN_CONTRACT_VERSIONS.stream().sorted().map(String::valueOf).collect(Collectors.joining(", "))
                + ": upgrade the library (io.pelican:pelican-worker)");
        this.operatorVersion = operatorVersion;
    }

    /** The {@code contractVersion} the operator published, as it wrote it. */
    public String operatorVersion() {
        return operatorVersion;
    }
}
