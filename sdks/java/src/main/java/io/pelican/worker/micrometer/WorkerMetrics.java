package io.pelican.worker.micrometer;

import io.micrometer.core.instrument.FunctionCounter;
import io.micrometer.core.instrument.Gauge;
import io.micrometer.core.instrument.MeterRegistry;
import io.micrometer.core.instrument.Tags;
import io.micrometer.core.instrument.binder.MeterBinder;
import io.pelican.worker.Worker;
import io.pelican.worker.WorkerStats;
import java.util.Map;
import java.util.Objects;
import java.util.function.ToLongFunction;

/**
 * A worker's {@link Worker#stats() stats} as Micrometer meters, under the schema every Pelican library shares (in
 * Prometheus: {@code pelican_worker_messages_total{stream, group, outcome}}, outcome {@code done}, {@code terminal},
 * {@code failed}, {@code retried} or {@code abandoned}, and {@code pelican_worker_in_flight{stream, group}}). The
 * consumer (the Pod) is the scrape target's own label, not the library's.
 *
 * <p>Micrometer is an optional dependency of this library: add {@code io.micrometer:micrometer-core} (Spring Boot's
 * actuator does) to use this class. In Spring Boot, a bean is enough: the actuator binds every {@code MeterBinder}.
 *
 * <pre>{@code
 * @Bean
 * MeterBinder pelicanWorkerMetrics(Worker worker) {
 *     return new WorkerMetrics(worker);
 * }
 * }</pre>
 */
public final class WorkerMetrics implements MeterBinder {
    private static final Map<String, ToLongFunction<WorkerStats>> OUTCOMES = Map.of(
            "done", WorkerStats::done,
            "terminal", WorkerStats::terminal,
            "failed", WorkerStats::failed,
            "retried", WorkerStats::retried,
            "abandoned", WorkerStats::abandoned);

    private final Worker worker;

    public WorkerMetrics(Worker worker) {
        this.worker = Objects.requireNonNull(worker, "worker");
    }

    @Override
    public void bindTo(MeterRegistry registry) {
        Tags tags = Tags.of("stream", worker.stream(), "group", worker.group());
        OUTCOMES.forEach((outcome, count) -> FunctionCounter
                .builder("pelican.worker.messages", worker, w -> count.applyAsLong(w.stats()))
                .description("Handler runs of a Pelican worker by how they ended")
                .tags(tags)
                .tag("outcome", outcome)
                .register(registry));
        Gauge.builder("pelican.worker.in.flight", worker, w -> w.stats().inFlight())
                .description("Messages a Pelican worker is handling now")
                .tags(tags)
                .register(registry);
    }
}
