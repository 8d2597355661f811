package io.pelican.worker;

/**
 * What a worker runs for each message. It never acknowledges: the worker does, by the {@link Outcome} it returns. An
 * exception is a failure of the message: no ACK, its text recorded as the entry's last error, and the operator's pass
 * retries it as the policy says (this worker never reads it again).
 */
@FunctionalInterface
public interface Handler {
    Outcome handle(Message message) throws Exception;
}
