/**
 * The conformance worker's OpenTelemetry SDK, installed when `OTEL_EXPORTER_OTLP_ENDPOINT` is set: a tracer provider
 * whose batch processor exports over OTLP (HTTP/protobuf, to the endpoint's `/v1/traces`, configured by the standard
 * `OTEL_EXPORTER_OTLP_*` and `OTEL_BSP_*` variables), the W3C trace-context propagator, and a context manager that
 * follows `await`. The service is `OTEL_SERVICE_NAME`, `pelican-conformance-typescript` by default.
 */
import { context, propagation, trace } from "@opentelemetry/api";
import { AsyncLocalStorageContextManager } from "@opentelemetry/context-async-hooks";
import { W3CTraceContextPropagator } from "@opentelemetry/core";
import { OTLPTraceExporter } from "@opentelemetry/exporter-trace-otlp-proto";
import { defaultResource, resourceFromAttributes } from "@opentelemetry/resources";
import { BasicTracerProvider, BatchSpanProcessor } from "@opentelemetry/sdk-trace-base";

export function exportTraces(): BasicTracerProvider {
  const service = process.env["OTEL_SERVICE_NAME"] || "pelican-conformance-typescript";
  const provider = new BasicTracerProvider({
    resource: defaultResource().merge(resourceFromAttributes({ "service.name": service })),
    spanProcessors: [new BatchSpanProcessor(new OTLPTraceExporter())],
  });
  trace.setGlobalTracerProvider(provider);
  propagation.setGlobalPropagator(new W3CTraceContextPropagator());
  context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
  return provider;
}
