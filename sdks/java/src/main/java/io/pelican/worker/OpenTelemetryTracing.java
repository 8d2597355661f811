package io.pelican.worker;

import io.opentelemetry.api.GlobalOpenTelemetry;
import io.opentelemetry.api.OpenTelemetry;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.api.trace.SpanKind;
import io.opentelemetry.api.trace.StatusCode;
import io.opentelemetry.context.Context;
import io.opentelemetry.context.Scope;
import io.opentelemetry.context.propagation.TextMapGetter;
import io.opentelemetry.context.propagation.TextMapSetter;
import java.util.ArrayList;
import java.util.List;
import java.util.Locale;

/** {@link Tracing} through OpenTelemetry's API: the only class of the library that names it. */
final class OpenTelemetryTracing extends Tracing {
    /** The name of the library's tracer, as every Pelican library names it. */
    private static final String TRACER = "pelican";

    /** An injector into the fields added to an entry: an empty value (a tracestate without entries) adds none. */
    private static final TextMapSetter<List<byte[]>> SETTER = (fields, name, value) -> {
        if (fields != null && !value.isEmpty()) {
            fields.add(Worker.bytes(name));
            fields.add(Worker.bytes(value));
        }
    };

    /** An extractor from an entry's fields: the first value of a name, as {@link Message#text}. */
    private static final TextMapGetter<Message> GETTER = (message, name) -> message == null ? null : message.text(name);

    @Override
    Sending sending(String stream, Send send, List<byte[]> carried) {
        // Read at each span: an SDK installed after the producer was made is used from then on.
        OpenTelemetry otel = GlobalOpenTelemetry.getOrNoop();
        Context parent = Context.current();
        Span span = otel.getTracer(TRACER).spanBuilder("send " + stream).setSpanKind(SpanKind.PRODUCER)
                .setParent(parent).startSpan();
        // Without an SDK the span records nothing: its attributes are not even built.
        if (span.isRecording()) {
            span.setAttribute("messaging.system", "redis");
            span.setAttribute("messaging.destination.name", stream);
            span.setAttribute("messaging.operation.type", "send");
            span.setAttribute("messaging.operation.name", "publish");
            topicOf(stream).ifPresent(topic -> span.setAttribute("pelican.topic", topic));
            if (send.key() != null) {
                span.setAttribute("pelican.key", send.key());
            }
            if (send.messageId() != null) {
                span.setAttribute("pelican.message_id", send.messageId());
            }
            if (send.count() > 0) {
                span.setAttribute("messaging.batch.message_count", send.count());
            }
        }
        List<byte[]> fields = carried;
        if (fields == null) {
            fields = new ArrayList<>(2);
            otel.getPropagators().getTextMapPropagator().inject(parent.with(span), fields, SETTER);
        }
        return new Sending(fields) {
            @Override
            void sent(String id) {
                if (id != null) {
                    span.setAttribute("messaging.message.id", id);
                }
                span.end();
            }

            @Override
            void failed(PublishException error) {
                span.setStatus(StatusCode.ERROR, Worker.errorText(error));
                span.end();
            }
        };
    }

    @Override
    Processing processing(Where where, Message message) {
        OpenTelemetry otel = GlobalOpenTelemetry.getOrNoop();
        Context parent = otel.getPropagators().getTextMapPropagator().extract(Context.root(), message, GETTER);
        Span span = otel.getTracer(TRACER).spanBuilder("process " + where.stream()).setSpanKind(SpanKind.CONSUMER)
                .setParent(parent).startSpan();
        boolean recording = span.isRecording();
        // Without an SDK, and no context from the entry to pass on, the span is nothing at all: the handler runs as
        // it would without the API.
        if (!recording && !span.getSpanContext().isValid()) {
            return Processing.NONE;
        }
        if (recording) {
            span.setAttribute("messaging.system", "redis");
            span.setAttribute("messaging.destination.name", where.stream());
            span.setAttribute("messaging.operation.type", "process");
            span.setAttribute("messaging.operation.name", "process");
            span.setAttribute("messaging.message.id", message.id());
            span.setAttribute("messaging.consumer.group.name", where.group());
            span.setAttribute("messaging.client.id", where.consumer());
            topicOf(where.stream()).ifPresent(topic -> span.setAttribute("pelican.topic", topic));
            message.key().ifPresent(key -> span.setAttribute("pelican.key", key));
        }
        Scope scope = parent.with(span).makeCurrent();
        return (outcome, failure) -> {
            scope.close();
            if (recording) {
                if (failure != null) {
                    span.setAttribute("pelican.outcome", "fail");
                    span.setStatus(StatusCode.ERROR, Worker.errorText(failure));
                } else {
                    span.setAttribute("pelican.outcome", outcome.kind().name().toLowerCase(Locale.ROOT));
                    if (outcome.kind() == Outcome.Kind.TERMINAL) {
                        span.setAttribute("pelican.reason", outcome.reason());
                    }
                }
            }
            span.end();
        };
    }
}
