package io.pelican.worker;

import java.lang.System.Logger.Level;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;

/**
 * The contract's {@code maxHandling} (contract/README.md, step 6 "Leases"): a message whose handler runs longer is no
 * longer leased, said once with a warning, and the operator's pass may then take it. One rule for a {@link Worker}
 * and a PerKey partition ({@link InOrder}); each keeps one, used by its lease tick alone.
 */
final class MaxHandling {
    private static final System.Logger LOG = System.getLogger("io.pelican.worker");

    private final Duration limit;
    private final String where;
    /** The ids past the limit, said; forgotten once they no longer run. */
    private final Set<String> said = new HashSet<>();

    MaxHandling(Duration limit, String where) {
        this.limit = limit;
        this.where = where;
    }

    /**
     * Of {@code running} (entry id -> when it started, {@code nanoTime}), the ids whose lease is extended at
     * {@code now}: those running for less than the limit. Each one past it is said once.
     */
    List<String> leased(Map<String, Long> running, long now) {
        said.retainAll(running.keySet());
        List<String> leased = new ArrayList<>(running.size());
        running.forEach((id, startedAt) -> {
            if (now - startedAt < limit.toNanos()) {
                leased.add(id);
            } else if (said.add(id)) {
                LOG.log(Level.WARNING, where + "handler of " + id + " still running after maxHandling (" + limit
                        + "): its lease is no longer extended, and the operator's pass may retry it");
            }
        });
        return leased;
    }
}
