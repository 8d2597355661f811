package pelican

import (
	"context"
	"errors"
	"regexp"
	"sync"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// A message's trace through the stream (contract/README.md, "Trace context (SPEC 23)"): a publish is a
// `send <stream>` span whose context travels in the entry's fields (traceparent, tracestate), and each handler run
// is a `process <stream>` span continuing it. Everything goes through OpenTelemetry's API, its global tracer
// provider and propagator, read at each span: until the application installs an SDK and a propagator (W3C's:
// otel.SetTextMapPropagator(propagation.TraceContext{})), nothing is recorded and no field is added.

// tracerName is the library's tracer, as every Pelican library names it.
const tracerName = "pelican"

func tracer() trace.Tracer { return otel.GetTracerProvider().Tracer(tracerName) }

// sendDetails is what a publish is, for its span: a topic's key, an idempotent one's message id and the fields
// kept for it, a batch's size.
type sendDetails struct {
	key       *string
	messageID string
	carried   *carriedFields // an idempotent publish's: the fields of its message id's earlier attempts
	count     int            // a batch's entries
}

// sending is a publish's span and the trace fields (name, value, ...) its entries carry after their own fields.
type sending struct {
	span    trace.Span
	fields  []any
	details sendDetails
}

// startSending starts `send <stream>` as a child of ctx's span. An idempotent publish whose message id has fields
// kept from an earlier attempt sends those instead of its own: the entry keeps the first attempt's context.
func startSending(ctx context.Context, stream string, details sendDetails) sending {
	ctx, span := tracer().Start(ctx, "send "+stream, trace.WithSpanKind(trace.SpanKindProducer))
	// Without an SDK the span records nothing: its attributes are not even built.
	if span.IsRecording() {
		span.SetAttributes(
			attribute.String("messaging.system", "redis"),
			attribute.String("messaging.destination.name", stream),
			attribute.String("messaging.operation.type", "send"),
			attribute.String("messaging.operation.name", "publish"),
		)
		if topic, ok := topicOf(stream); ok {
			span.SetAttributes(attribute.String("pelican.topic", topic))
		}
		if details.key != nil {
			span.SetAttributes(attribute.String("pelican.key", *details.key))
		}
		if details.carried != nil {
			span.SetAttributes(attribute.String("pelican.message_id", details.messageID))
		}
		if details.count > 0 {
			span.SetAttributes(attribute.Int("messaging.batch.message_count", details.count))
		}
	}
	s := sending{span: span, details: details}
	carried := false
	if details.carried != nil {
		s.fields, carried = details.carried.take(details.messageID)
	}
	if !carried {
		injected := &injector{}
		otel.GetTextMapPropagator().Inject(ctx, injected)
		s.fields = injected.fields
	}
	return s
}

// sent ends the span of a publish that wrote (or found) the entry id ("" for a batch).
func (s sending) sent(id string) {
	if id != "" {
		s.span.SetAttributes(attribute.String("messaging.message.id", id))
	}
	s.span.End()
}

// failed ends the span with the publish's error (classified). An idempotent publish whose outcome was unknown or
// unavailable keeps its fields for the next publish of its message id.
func (s sending) failed(err error) {
	if s.details.carried != nil && isUnknownOrUnavailable(err) {
		s.details.carried.keep(s.details.messageID, s.fields)
	}
	s.span.SetStatus(codes.Error, err.Error())
	s.span.End()
}

// injector collects what the propagator writes, in order; an empty value (a tracestate without entries) adds none.
type injector struct{ fields []any }

func (c *injector) Set(name, value string) {
	if value != "" {
		c.fields = append(c.fields, name, value)
	}
}

// Get and Keys are for extracting, which an injector is not used for.
func (c *injector) Get(string) string { return "" }
func (c *injector) Keys() []string    { return nil }

// entryFields extracts from an entry's fields: the first value of a name, as Message.Get.
type entryFields []Field

func (f entryFields) Get(name string) string {
	for _, field := range f {
		if field.Name == name {
			return field.Value
		}
	}
	return ""
}

func (f entryFields) Keys() []string {
	names := make([]string, len(f))
	for i, field := range f {
		names[i] = field.Name
	}
	return names
}

// Set is for injecting, which an entry read is not used for.
func (entryFields) Set(string, string) {}

// partitionName is a topic's partition {T:i}.
var partitionName = regexp.MustCompile(`(?s)^\{(.*):\d+\}$`)

// topicOf names the topic of a partition's stream.
func topicOf(stream string) (string, bool) {
	if match := partitionName.FindStringSubmatch(stream); match != nil {
		return match[1], true
	}
	return "", false
}

// carriedKept is how many message ids a carriedFields keeps.
const carriedKept = 1024

// carriedFields are the trace fields of idempotent publishes whose outcome was unknown or unavailable, by message
// id, so that a publish of the same message id sends them again: the last carriedKept at most.
type carriedFields struct {
	mu     sync.Mutex
	fields map[string][]any
	order  []string // message ids, oldest first
}

// take answers the fields kept for messageID, and whether there were any kept; it forgets them.
func (c *carriedFields) take(messageID string) ([]any, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	fields, ok := c.fields[messageID]
	if ok {
		delete(c.fields, messageID)
		c.forget(messageID)
	}
	return fields, ok
}

// keep remembers fields for messageID, forgetting the oldest message id when carriedKept are kept.
func (c *carriedFields) keep(messageID string, fields []any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.fields == nil {
		c.fields = make(map[string][]any)
	}
	if _, ok := c.fields[messageID]; ok {
		c.forget(messageID)
	} else if len(c.order) >= carriedKept {
		delete(c.fields, c.order[0])
		c.order = c.order[1:]
	}
	c.fields[messageID] = fields
	c.order = append(c.order, messageID)
}

// forget takes messageID out of the order (a linear search over at most carriedKept ids, on a failed publish only).
func (c *carriedFields) forget(messageID string) {
	for i, id := range c.order {
		if id == messageID {
			c.order = append(c.order[:i], c.order[i+1:]...)
			return
		}
	}
}

// startProcessing starts `process <stream>` for a handler run on m, whose parent is the context its fields carry
// (a new trace without one, whatever ctx holds). Without an SDK and no context to pass on, it answers ctx and no
// span: the handler runs as it would without the API.
func startProcessing(ctx context.Context, w *Worker, m Message) (context.Context, trace.Span) {
	parent := ctx
	if trace.SpanContextFromContext(parent).IsValid() {
		parent = trace.ContextWithSpanContext(parent, trace.SpanContext{})
	}
	// A propagator that reads no field (the API's default) has nothing to extract: not asked, at no cost.
	if propagator := otel.GetTextMapPropagator(); len(propagator.Fields()) > 0 {
		parent = propagator.Extract(parent, entryFields(m.Fields))
	}
	spanCtx, span := tracer().Start(parent, w.processName, trace.WithSpanKind(trace.SpanKindConsumer))
	if !span.IsRecording() {
		if span.SpanContext().IsValid() {
			return spanCtx, span
		}
		return ctx, nil
	}
	span.SetAttributes(
		attribute.String("messaging.system", "redis"),
		attribute.String("messaging.destination.name", w.opt.Stream),
		attribute.String("messaging.operation.type", "process"),
		attribute.String("messaging.operation.name", "process"),
		attribute.String("messaging.message.id", m.ID),
		attribute.String("messaging.consumer.group.name", w.opt.Group),
		attribute.String("messaging.client.id", w.opt.Consumer),
	)
	if topic, ok := topicOf(w.opt.Stream); ok {
		span.SetAttributes(attribute.String("pelican.topic", topic))
	}
	if key, ok := m.Key(); ok {
		span.SetAttributes(attribute.String("pelican.key", key))
	}
	return spanCtx, span
}

// endProcessing ends a run's span with its outcome: ERROR with the failure's text when err is not nil (as the
// worker records it as the entry's last error).
func endProcessing(span trace.Span, outcome Outcome, err error) {
	if span == nil {
		return
	}
	switch {
	case err != nil:
		span.SetAttributes(attribute.String("pelican.outcome", "fail"))
		span.SetStatus(codes.Error, cutUTF8(err.Error(), ErrorTextMax))
	case outcome.kind == terminalOutcome:
		span.SetAttributes(attribute.String("pelican.outcome", "terminal"), attribute.String("pelican.reason", outcome.reason))
	default:
		span.SetAttributes(attribute.String("pelican.outcome", outcome.String()))
	}
	span.End()
}

// isUnknownOrUnavailable: the publish may be published again with the same message id (an idempotent one).
func isUnknownOrUnavailable(err error) bool {
	var unknown *OutcomeUnknownError
	return errors.As(err, &unknown) || errors.Is(err, ErrUnavailable)
}
