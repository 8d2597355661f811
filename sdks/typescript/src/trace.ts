/**
 * A message's trace through the stream (contract/README.md, "Trace context"): a publish is a `send <stream>` span
 * whose context travels in the entry's fields (`traceparent`, `tracestate`), and each handler run is a
 * `process <stream>` span continuing it. Everything goes through OpenTelemetry's API (its global tracer provider,
 * propagator and context manager), an optional peer dependency: without it nothing is traced, and with it nothing is
 * recorded nor added to an entry until the application installs an SDK and a propagator.
 */
import type * as OpenTelemetry from "@opentelemetry/api";

import { errorText } from "./connection.js";
import { KEY_FIELD } from "./keys.js";
import { api, INSTRUMENTATION as TRACER } from "./otel.js";
import type { Message } from "./message.js";
import type { Outcome } from "./outcome.js";

/** The fields a message's trace context is carried in, in order. */
export type TraceFields = ReadonlyArray<readonly [string, string]>;

/** A publish being sent: the fields that carry its span's context into the entry, and the span's end. */
export interface Sending {
  readonly fields: TraceFields;
  /** Ends the span: with the entry's id when there is one (not for a batch). */
  sent(id?: string): void;
  /** Ends the span with the error. */
  failed(error: unknown): void;
}

/** What a publish is, for its span's attributes: an idempotent one's message id, a topic's key, a batch's size. */
export interface SendDetails {
  messageId?: string | undefined;
  key?: string | Buffer | undefined;
  count?: number | undefined;
}

const NOT_TRACED: Sending = { fields: [], sent: () => undefined, failed: () => undefined };

/**
 * Starts `send <stream>` as a child of the active context. `carried`: the fields of an earlier attempt of the same
 * idempotent publish, sent again instead of this span's (the entry keeps its first context).
 */
export function startSending(stream: string, details: SendDetails, carried?: TraceFields): Sending {
  if (!api) return NOT_TRACED;
  const { context, propagation, trace, SpanKind, SpanStatusCode } = api;
  const parent = context.active();
  const span = trace.getTracer(TRACER).startSpan(`send ${stream}`, { kind: SpanKind.PRODUCER }, parent);
  // Without an SDK the span records nothing: its attributes are not even built.
  if (span.isRecording()) {
    span.setAttributes({
      ...topicAttribute(stream),
      ...(details.messageId === undefined ? {} : { "pelican.message_id": details.messageId }),
      ...(details.key === undefined ? {} : { "pelican.key": details.key.toString() }),
      ...(details.count === undefined ? {} : { "messaging.batch.message_count": details.count }),
      "messaging.system": "redis",
      "messaging.destination.name": stream,
      "messaging.operation.type": "send",
      "messaging.operation.name": "publish",
    });
  }
  let fields = carried;
  if (!fields) {
    const injected: Array<[string, string]> = [];
    propagation.inject(trace.setSpan(parent, span), injected, fieldSetter);
    fields = injected;
  }
  return {
    fields,
    sent(id) {
      if (id !== undefined) span.setAttribute("messaging.message.id", id);
      span.end();
    },
    failed(error) {
      span.setStatus({ code: SpanStatusCode.ERROR, message: errorText(error) });
      span.end();
    },
  };
}

/** An injector into the fields added to an entry: an empty value (a `tracestate` without entries) adds none. */
const fieldSetter: OpenTelemetry.TextMapSetter<Array<[string, string]>> = {
  set(fields, key, value) {
    if (value !== "") fields.push([key, value]);
  },
};

/** A topic's partition `{T:i}` names its topic. */
function topicAttribute(stream: string): Record<string, string> {
  const partition = /^\{(.*):\d+\}$/s.exec(stream);
  return partition ? { "pelican.topic": partition[1] ?? "" } : {};
}

/** How many message ids `Carried` keeps. */
export const KEPT = 1024;

/**
 * The trace fields of idempotent publishes whose outcome was unknown or unavailable, by message id, so that a
 * publish of the same message id sends them again; the last `KEPT` at most (a Map iterates in insertion order).
 */
export class Carried {
  private readonly fields = new Map<string, TraceFields>();

  take(messageId: string): TraceFields | undefined {
    const fields = this.fields.get(messageId);
    this.fields.delete(messageId);
    return fields;
  }

  keep(messageId: string, fields: TraceFields): void {
    if (!this.fields.has(messageId) && this.fields.size >= KEPT) {
      const oldest = this.fields.keys().next();
      if (!oldest.done) this.fields.delete(oldest.value);
    }
    this.fields.set(messageId, fields);
  }
}

/** Where a handler runs: the consumer's names, for the span's attributes. */
export interface Processing {
  readonly stream: string;
  readonly group: string;
  readonly consumer: string;
}

/**
 * Runs `run` (the handler on `message`, its value checked as an outcome) inside `process <stream>`, continuing the
 * trace the entry carries (a new trace without one), and ends the span with the outcome: status ERROR with the
 * failure's text when it throws or rejects, which is passed on.
 */
export function processing(where: Processing, message: Message, run: () => Promise<Outcome>): Promise<Outcome> {
  if (!api) return run();
  const { isSpanContextValid, propagation, trace, ROOT_CONTEXT, SpanKind } = api;
  const parent = propagation.extract(ROOT_CONTEXT, message, entryGetter);
  const span = trace.getTracer(TRACER).startSpan(`process ${where.stream}`, { kind: SpanKind.CONSUMER }, parent);
  // Without an SDK, and no context from the entry to pass on, the span is nothing at all: the handler runs as it
  // would without the API.
  if (!span.isRecording() && !isSpanContextValid(span.spanContext())) return run();
  return traced(api, span, parent, where, message, run);
}

async function traced(
  api: typeof OpenTelemetry,
  span: OpenTelemetry.Span,
  parent: OpenTelemetry.Context,
  where: Processing,
  message: Message,
  run: () => Promise<Outcome>,
): Promise<Outcome> {
  const { context, trace, SpanStatusCode } = api;
  const recording = span.isRecording();
  // Without an SDK the span records nothing: its attributes are not even built.
  if (recording) {
    const key = message.field(KEY_FIELD);
    span.setAttributes({
      ...topicAttribute(where.stream),
      ...(key === undefined ? {} : { "pelican.key": key }),
      "messaging.system": "redis",
      "messaging.destination.name": where.stream,
      "messaging.operation.type": "process",
      "messaging.operation.name": "process",
      "messaging.message.id": message.id,
      "messaging.consumer.group.name": where.group,
      "messaging.client.id": where.consumer,
    });
  }
  let outcome: Outcome;
  try {
    outcome = await context.with(trace.setSpan(parent, span), run);
  } catch (error) {
    if (recording) {
      span.setStatus({ code: SpanStatusCode.ERROR, message: errorText(error) });
      span.setAttribute("pelican.outcome", "fail");
    }
    span.end();
    throw error;
  }
  if (recording) {
    span.setAttribute("pelican.outcome", outcome.kind);
    if (outcome.kind === "terminal") span.setAttribute("pelican.reason", outcome.reason);
  }
  span.end();
  return outcome;
}

/** An extractor from an entry's fields (the first value of a name, as `Message.field`). */
const entryGetter: OpenTelemetry.TextMapGetter<Message> = {
  get: (message, key) => message.field(key),
  keys: (message) => [...message.fields.keys()],
};
