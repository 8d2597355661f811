package io.pelican.worker;

import java.util.List;
import java.util.Optional;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * A message's trace through the stream (contract/README.md, "Trace context (SPEC 23)"): a publish is a
 * {@code send <stream>} span whose context travels in the entry's fields ({@code traceparent}, {@code tracestate}),
 * and each handler run is a {@code process <stream>} span continuing it.
 *
 * <p>OpenTelemetry's API is an optional dependency: {@link OpenTelemetryTracing}, the one class that names it, is
 * loaded only when the API is on the classpath; without it nothing is traced. With it, everything goes through
 * {@code GlobalOpenTelemetry.getOrNoop()}, which is a no-op until the application installs an SDK and a propagator
 * (and, unlike {@code get()}, never fixes the no-op as the global one): nothing is recorded nor added to an entry
 * before then.
 */
abstract class Tracing {
    /** Nothing traced: no span, no field. */
    static final Tracing NONE = new Tracing() {
        @Override
        Sending sending(String stream, Send send, List<byte[]> carried) {
            return new Sending(carried != null ? carried : List.of()) {
                @Override
                void sent(String id) {}

                @Override
                void failed(PublishException error) {}
            };
        }

        @Override
        Processing processing(Where where, Message message) {
            return Processing.NONE;
        }
    };

    /**
     * What the library traces with: chosen once, by whether OpenTelemetry's API is on the classpath (after
     * {@link #NONE}, which it may be).
     */
    static final Tracing CURRENT = load();

    private static Tracing load() {
        try {
            Class.forName("io.opentelemetry.api.GlobalOpenTelemetry", false, Tracing.class.getClassLoader());
        } catch (ClassNotFoundException | LinkageError e) {
            return NONE;
        }
        return new OpenTelemetryTracing();
    }

    /**
     * Starts {@code send <stream>} as a child of the current context. {@code carried}: the fields of an earlier
     * attempt of the same idempotent publish, sent again instead of this span's (the entry keeps its first context).
     */
    abstract Sending sending(String stream, Send send, List<byte[]> carried);

    /**
     * Starts {@code process <stream>} for a handler run on {@code message}, current on this thread until it ends,
     * continuing the trace the entry carries (a new trace without one).
     */
    abstract Processing processing(Where where, Message message);

    /** What a publish is, for its span: a topic's key, an idempotent one's message id, a batch's size (0: none). */
    record Send(String key, String messageId, int count) {
        static final Send PLAIN = new Send(null, null, 0);

        static Send keyed(String key) {
            return new Send(key, null, 0);
        }

        static Send batch(int count) {
            return new Send(null, null, count);
        }
    }

    /** A publish being sent: the fields (name, value, ...) that carry its context, after the entry's own. */
    abstract static class Sending {
        final List<byte[]> fields;

        Sending(List<byte[]> fields) {
            this.fields = fields;
        }

        /** Ends the span: with the entry's id when there is one ({@code null} for a batch). */
        abstract void sent(String id);

        /** Ends the span with the publish's error. */
        abstract void failed(PublishException error);
    }

    /** Where a handler runs: the consumer's names, for the span's attributes. */
    record Where(String stream, String group, String consumer) {}

    /** A handler run's span, current on its thread until {@link #end}. */
    interface Processing {
        Processing NONE = (outcome, failure) -> {};

        /** Ends the span with the run's outcome, or its failure ({@code null} when it has an outcome). */
        void end(Outcome outcome, Throwable failure);
    }

    private static final Pattern PARTITION = Pattern.compile("\\{(.*):\\d+\\}", Pattern.DOTALL);

    /** The topic a partition's stream <code>{T:i}</code> belongs to. */
    static Optional<String> topicOf(String stream) {
        Matcher partition = PARTITION.matcher(stream);
        return partition.matches() ? Optional.of(partition.group(1)) : Optional.empty();
    }
}
