package io.pelican.worker;

/**
 * What a worker did so far.
 *
 * @param done acknowledged
 * @param terminal acknowledged and counted under a reason
 * @param failed handler exceptions, and outcomes the server did not record: left pending for the operator's retry
 * @param retried {@link Outcome#retry()}: given back to the operator's pass, the delivery counted
 * @param abandoned given back on shutdown (still running when the grace ran out, or read and not started), the
 *     delivery not counted
 * @param inFlight messages being handled or having their outcome written now
 */
public record WorkerStats(long done, long terminal, long failed, long retried, long abandoned, int inFlight) {}
