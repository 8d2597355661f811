package io.pelican.worker.conformance;

import com.sun.net.httpserver.HttpServer;
import io.micrometer.prometheusmetrics.PrometheusConfig;
import io.micrometer.prometheusmetrics.PrometheusMeterRegistry;
import io.pelican.worker.Worker;
import io.pelican.worker.micrometer.WorkerMetrics;
import java.io.IOException;
import java.io.OutputStream;
import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.nio.charset.StandardCharsets;

/**
 * The conformance worker's metrics endpoint ({@code METRICS_PORT}): the worker's {@link WorkerMetrics} bound to a
 * Prometheus registry of its own, scraped at each request, as an application with Micrometer would serve them. Apart
 * from {@link ConformanceWorker} so that Micrometer (an optional dependency) is loaded only when it is asked for.
 */
final class ConformanceMetrics {
    private ConformanceMetrics() {}

    /** Serves {@code worker}'s metrics at {@code http://127.0.0.1:<port>/metrics} until the process ends. */
    static void serve(Worker worker, int port) throws IOException {
        PrometheusMeterRegistry registry = new PrometheusMeterRegistry(PrometheusConfig.DEFAULT);
        new WorkerMetrics(worker).bindTo(registry);
        HttpServer server = HttpServer.create(new InetSocketAddress(InetAddress.getLoopbackAddress(), port), 0);
        server.createContext("/metrics", exchange -> {
            byte[] body = registry.scrape().getBytes(StandardCharsets.UTF_8);
            exchange.getResponseHeaders().set("Content-Type", "text/plain; version=0.0.4; charset=utf-8");
            exchange.sendResponseHeaders(200, body.length);
            try (OutputStream out = exchange.getResponseBody()) {
                out.write(body);
            }
        });
        server.start();
    }
}
