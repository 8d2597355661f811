package io.pelican.worker;

import io.opentelemetry.api.GlobalOpenTelemetry;
import io.opentelemetry.api.common.AttributeKey;
import io.opentelemetry.api.common.Attributes;
import io.opentelemetry.api.metrics.DoubleHistogram;
import io.opentelemetry.api.metrics.LongCounter;
import io.opentelemetry.api.metrics.LongUpDownCounter;
import io.opentelemetry.api.metrics.Meter;
import java.util.EnumMap;
import java.util.List;
import java.util.Map;

/** {@link Metering} through OpenTelemetry's API: the only class of the library that names its metrics. */
final class OpenTelemetryMetering extends Metering {
    /** The name of the library's meter, as its tracer is named. */
    private static final String METER = "pelican";
    /** {@code messaging.process.duration}'s buckets, in seconds: the conventions' advice. */
    private static final List<Double> DURATION_BUCKETS =
            List.of(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0);
    private static final AttributeKey<String> ERROR_TYPE = AttributeKey.stringKey("error.type");

    private static Meter meter() {
        return GlobalOpenTelemetry.getOrNoop().getMeter(METER);
    }

    @Override
    WorkerMeter worker(String stream, String group) {
        Meter meter = meter();
        LongCounter consumed = meter.counterBuilder("messaging.client.consumed.messages").setUnit("{message}")
                .setDescription("Messages delivered to the worker's handlers").build();
        DoubleHistogram duration = meter.histogramBuilder("messaging.process.duration").setUnit("s")
                .setDescription("Handler runs, by how they ended (pelican.outcome)")
                .setExplicitBucketBoundariesAdvice(DURATION_BUCKETS).build();
        LongUpDownCounter inFlight = meter.upDownCounterBuilder("pelican.worker.in_flight").setUnit("{message}")
                .setDescription("Messages being handled by the worker now").build();
        LongCounter abandoned = meter.counterBuilder("pelican.worker.abandoned").setUnit("{message}")
                .setDescription("Messages given back unfinished on shutdown, their delivery not counted").build();
        Attributes names = Attributes.builder().put("messaging.destination.name", stream)
                .put("messaging.consumer.group.name", group).build();
        Attributes receive = messaging(names, "receive");
        Map<Ended, Attributes> outcomes = new EnumMap<>(Ended.class);
        for (Ended ended : Ended.values()) {
            outcomes.put(ended, messaging(names, "process").toBuilder().put("pelican.outcome", ended.label).build());
        }
        return new WorkerMeter() {
            @Override
            public void started() {
                consumed.add(1, receive);
                inFlight.add(1, names);
            }

            @Override
            public void landed() {
                inFlight.add(-1, names);
            }

            @Override
            public void ended(Ended ended, long nanos, Throwable handlerError) {
                Attributes attributes = outcomes.get(ended);
                if (handlerError != null) {
                    attributes = attributes.toBuilder().put(ERROR_TYPE, handlerError.getClass().getName()).build();
                }
                duration.record(nanos / 1e9, attributes);
            }

            @Override
            public void abandoned(long count) {
                if (count > 0) {
                    abandoned.add(count, names);
                }
            }
        };
    }

    private static Attributes messaging(Attributes names, String operation) {
        return names.toBuilder().put("messaging.system", "redis").put("messaging.operation.name", operation)
                .put("messaging.operation.type", operation).build();
    }

    @Override
    ProducerMeter producer(String stream) {
        LongCounter sent = meter().counterBuilder("messaging.client.sent.messages").setUnit("{message}")
                .setDescription("Entries published, with error.type when not written (or not known to be)").build();
        Attributes written = Attributes.builder().put("messaging.system", "redis")
                .put("messaging.destination.name", stream).put("messaging.operation.name", "publish")
                .put("messaging.operation.type", "send").build();
        Map<Sent, Attributes> attributes = new EnumMap<>(Sent.class);
        for (Sent outcome : Sent.values()) {
            attributes.put(outcome, outcome == Sent.SENT ? written
                    : written.toBuilder().put(ERROR_TYPE, outcome.label).build());
        }
        return (outcome, count) -> {
            if (count > 0) {
                sent.add(count, attributes.get(outcome));
            }
        };
    }
}
