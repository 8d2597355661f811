package io.pelican.worker.micrometer;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.fail;

import io.lettuce.core.RedisClient;
import io.lettuce.core.XGroupCreateArgs;
import io.lettuce.core.XReadArgs.StreamOffset;
import io.lettuce.core.api.sync.RedisCommands;
import io.micrometer.prometheusmetrics.PrometheusConfig;
import io.micrometer.prometheusmetrics.PrometheusMeterRegistry;
import io.pelican.worker.Outcome;
import io.pelican.worker.RedisServer;
import io.pelican.worker.Worker;
import io.pelican.worker.WorkerStats;
import java.util.List;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;

/** A scrape of the worker's meters, as Prometheus sees them. */
class WorkerMetricsTest {
    private static final String STREAM = "{jobs}:metrics";
    private static final String GROUP = "workers";

    @Test
    void aScrapeShowsTheStatsUnderTheSharedSchema() throws Exception {
        RedisClient admin = RedisClient.create(RedisServer.shared().uri());
        try {
            RedisCommands<String, String> r = admin.connect().sync();
            r.del(STREAM);
            r.xgroupCreate(StreamOffset.from(STREAM, "0"), GROUP, XGroupCreateArgs.Builder.mkstream());
            for (String handle : List.of("done", "done", "fail", "terminal", "retry")) {
                r.xadd(STREAM, "handle", handle);
            }
            PrometheusMeterRegistry registry = new PrometheusMeterRegistry(PrometheusConfig.DEFAULT);
            Worker worker = Worker.builder(admin).stream(STREAM).group(GROUP).consumer("worker-1").handler(m ->
                    switch (m.text("handle")) {
                        case "fail" -> throw new IllegalStateException("asked to");
                        case "terminal" -> Outcome.terminal("RecordNotFound");
                        case "retry" -> Outcome.retry();
                        default -> Outcome.done();
                    }).build();
            new WorkerMetrics(worker).bindTo(registry);
            try (worker) {
                worker.start();
                long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(5);
                while (!worker.stats().equals(new WorkerStats(2, 1, 1, 1, 0, 0))) {
                    if (System.nanoTime() > deadline) {
                        fail("not all handled: " + worker.stats());
                    }
                    Thread.sleep(20);
                }
            }
            String labels = "group=\"workers\",stream=\"{jobs}:metrics\"";
            List<String> samples = registry.scrape().lines().filter(line -> line.startsWith("pelican_")).sorted().toList();
            assertEquals(List.of(
                    "pelican_worker_in_flight{" + labels + "} 0.0",
                    "pelican_worker_messages_total{" + labels.replace(",", ",outcome=\"abandoned\",") + "} 0.0",
                    "pelican_worker_messages_total{" + labels.replace(",", ",outcome=\"done\",") + "} 2.0",
                    "pelican_worker_messages_total{" + labels.replace(",", ",outcome=\"failed\",") + "} 1.0",
                    "pelican_worker_messages_total{" + labels.replace(",", ",outcome=\"retried\",") + "} 1.0",
                    "pelican_worker_messages_total{" + labels.replace(",", ",outcome=\"terminal\",") + "} 1.0"),
                    samples);
        } finally {
            admin.shutdown();
        }
    }
}
