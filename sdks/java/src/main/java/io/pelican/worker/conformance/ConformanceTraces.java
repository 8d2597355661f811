package io.pelican.worker.conformance;

import io.opentelemetry.sdk.OpenTelemetrySdk;
import io.opentelemetry.sdk.autoconfigure.AutoConfiguredOpenTelemetrySdk;
import io.opentelemetry.sdk.common.CompletableResultCode;
import java.util.Map;
import java.util.concurrent.TimeUnit;

/**
 * The conformance worker's OpenTelemetry SDK, installed when {@code OTEL_EXPORTER_OTLP_ENDPOINT} is set: the SDK's
 * autoconfiguration, reading the standard {@code OTEL_*} variables, with these defaults: spans exported over OTLP
 * (HTTP/protobuf, to the endpoint's {@code /v1/traces}) by a batch processor, the W3C trace-context propagator, no
 * metrics or logs, the service {@code pelican-conformance-java}. Registered as the global OpenTelemetry, which the
 * library's spans go through.
 */
final class ConformanceTraces {
    private static final String SERVICE = "pelican-conformance-java";
    private static final Map<String, String> DEFAULTS = Map.of(
            "otel.traces.exporter", "otlp",
            "otel.exporter.otlp.protocol", "http/protobuf",
            "otel.propagators", "tracecontext",
            "otel.metrics.exporter", "none",
            "otel.logs.exporter", "none");

    /** The SDK, when it was installed; read by the shutdown hook's thread. */
    private static volatile OpenTelemetrySdk sdk;

    private ConformanceTraces() {}

    /** Installs the SDK when the program was given an OTLP endpoint; does nothing otherwise. */
    static void exportIfConfigured() {
        String endpoint = System.getenv("OTEL_EXPORTER_OTLP_ENDPOINT");
        if (endpoint == null || endpoint.isEmpty()) {
            return;
        }
        sdk = AutoConfiguredOpenTelemetrySdk.builder()
                .addPropertiesSupplier(() -> DEFAULTS)
                // The service's default also where OTEL_SERVICE_NAME is set but empty, as the other programs do.
                .addPropertiesCustomizer(config -> config.getString("otel.service.name", "").isEmpty()
                        ? Map.of("otel.service.name", SERVICE)
                        : Map.of())
                // The program shuts it down itself on every way out, bounded; its exits are halts, which run no hook.
                .disableShutdownHook()
                .setResultAsGlobal()
                .build()
                .getOpenTelemetrySdk();
    }

    /**
     * Exports the spans still queued and stops the exporter, waiting at most 5 s. Synchronized: on a SIGTERM the
     * main thread and the shutdown hook both come here, and the SDK answers a second shutdown at once, so the hook
     * must wait for the first before it halts.
     */
    static synchronized void shutdown() {
        OpenTelemetrySdk installed = sdk;
        if (installed == null) {
            return;
        }
        CompletableResultCode stopped = installed.shutdown().join(5, TimeUnit.SECONDS);
        if (!stopped.isSuccess()) {
            System.err.println("conformance worker: the last spans were not all exported within 5 s");
        }
    }
}
