package io.pelican.worker;

import java.util.Locale;

/**
 * The worker's and the producer's metrics through OpenTelemetry's metrics API (SPEC 23; docs/src/tracing.md,
 * "Metrics"): the messaging conventions' instruments and Pelican's own, the same names, units and attributes in every
 * library, recorded where the stats are counted so that they agree with {@link Worker#stats()} (and the Prometheus
 * names of {@code micrometer.WorkerMetrics}).
 *
 * <p>As for {@link Tracing}, the API is an optional dependency: {@link OpenTelemetryMetering}, the one class that
 * names its metrics, is loaded only when it is on the classpath; without it nothing is recorded. With it, the
 * instruments come from {@code GlobalOpenTelemetry.getOrNoop()} when a worker or producer is made: nothing is
 * recorded until the application has installed an SDK by then.
 */
abstract class Metering {
    /** Nothing recorded. */
    static final Metering NONE = new Metering() {
        @Override
        WorkerMeter worker(String stream, String group) {
            return WorkerMeter.NONE;
        }

        @Override
        ProducerMeter producer(String stream) {
            return ProducerMeter.NONE;
        }
    };

    /** What the library records with: chosen once, by whether OpenTelemetry's API is on the classpath. */
    static final Metering CURRENT = load();

    private static Metering load() {
        try {
            Class.forName("io.opentelemetry.api.GlobalOpenTelemetry", false, Metering.class.getClassLoader());
        } catch (ClassNotFoundException | LinkageError e) {
            return NONE;
        }
        return new OpenTelemetryMetering();
    }

    /** A worker's instruments, from the global meter provider as it is now. */
    abstract WorkerMeter worker(String stream, String group);

    /** A producer's instrument, from the global meter provider as it is now. */
    abstract ProducerMeter producer(String stream);

    /** How a handler run ended, as the stats count it: {@code pelican.outcome}, the Prometheus outcome label. */
    enum Ended {
        DONE,
        TERMINAL,
        FAILED,
        RETRIED;

        final String label = name().toLowerCase(Locale.ROOT);
    }

    /** How a publish ended: written, or its {@code error.type}. */
    enum Sent {
        SENT,
        REFUSED,
        UNAVAILABLE,
        UNKNOWN,
        FAILED;

        final String label = name().toLowerCase(Locale.ROOT);

        /** A failed publish's {@code error.type}. */
        static Sent of(PublishException error) {
            if (error instanceof PublishRefusedException) {
                return REFUSED;
            }
            if (error instanceof PublishUnavailableException) {
                return UNAVAILABLE;
            }
            return error instanceof PublishOutcomeUnknownException ? UNKNOWN : FAILED;
        }
    }

    /** A worker's instruments. */
    interface WorkerMeter {
        WorkerMeter NONE = new WorkerMeter() {
            @Override
            public void started() {}

            @Override
            public void landed() {}

            @Override
            public void ended(Ended ended, long nanos, Throwable handlerError) {}

            @Override
            public void abandoned(long count) {}
        };

        /** A message handed to a handler. */
        void started();

        /** A message out of flight: its outcome written, or given back on shutdown. */
        void landed();

        /** A handler run that took {@code nanos}, counted as {@code ended}; {@code handlerError}: what it threw. */
        void ended(Ended ended, long nanos, Throwable handlerError);

        /** Messages given back on shutdown. */
        void abandoned(long count);
    }

    /** A producer's instrument: {@code count} entries published, or not. */
    @FunctionalInterface
    interface ProducerMeter {
        ProducerMeter NONE = (sent, count) -> {};

        void add(Sent sent, int count);
    }
}
