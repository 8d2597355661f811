package io.pelican.worker;

import java.util.Set;
import java.util.stream.Collectors;

/**
 * The operator speaks a worker contract this library does not know: the worker refuses to start. A plain stream's
 * worker knows {@link Settings#KNOWN_CONTRACT_VERSIONS}; a topic's partition, {@link Partitions#TOPIC_CONTRACT_VERSION}.
 */
public final class ContractVersionException extends RuntimeException {
    private static final long serialVersionUID = 1L;

    private final String operatorVersion;
    private final Set<Integer> known;

    /** A plain stream's settings of version {@code operatorVersion}: this library knows {@link Settings#KNOWN_CONTRACT_VERSIONS}. */
    public ContractVersionException(String operatorVersion) {
        this(operatorVersion, Settings.KNOWN_CONTRACT_VERSIONS);
    }

    /** Settings of version {@code operatorVersion}, read by a worker that knows the versions {@code known}. */
    public ContractVersionException(String operatorVersion, Set<Integer> known) {
        super("the operator speaks worker contract " + operatorVersion + ", this library knows "
                + known.stream().sorted().map(String::valueOf).collect(Collectors.joining(", "))
                + ": upgrade the library (io.pelican:pelican-worker)");
        this.operatorVersion = operatorVersion;
        this.known = Set.copyOf(known);
    }

    /** The {@code contractVersion} the operator published, as it wrote it. */
    public String operatorVersion() {
        return operatorVersion;
    }

    /** The contract versions the worker that met it knows: {@code {1}} on a plain stream, {@code {2}} on a partition. */
    public Set<Integer> known() {
        return known;
    }
}
