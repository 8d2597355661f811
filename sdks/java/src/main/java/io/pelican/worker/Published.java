package io.pelican.worker;

import java.util.List;
import java.util.Optional;

/**
 * What a batch publish wrote: its first {@code ids.size()} entries, in order; when {@code refusal} is present the rest
 * were not written (certainly).
 */
public record Published(List<String> ids, Optional<Refusal> refusal) {
    /**
     * The bounded group with the least room when a batch was cut short.
     *
     * @param group the group
     * @param backlog its backlog before the batch
     * @param max its {@code backlog.maxLength}
     */
    public record Refusal(String group, long backlog, long max) {}

    public Published {
        ids = List.copyOf(ids);
    }
}
