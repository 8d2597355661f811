package io.pelican.worker;

import java.util.concurrent.CompletableFuture;

/** One owned partition's worker, as a {@link TopicWorker} runs it: a plain {@link Worker}, or a PerKey one. */
interface PartitionRun {
    /** Starts reading (the pending list was taken over before). */
    void start();

    /** Stops as on SIGTERM: handlers finish within the grace, the rest is given back; returns once stopped. */
    void close();

    /** Lost: stops at once, writing no outcome and giving nothing back; returns at once. */
    void abort();

    /** Completes once it stopped, for whatever reason. */
    CompletableFuture<Void> whenClosed();

    WorkerStats stats();

    /** The unknown contract version it met, which stopped it; {@code null} when none. */
    ContractVersionException versionMet();
}
