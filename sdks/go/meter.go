package pelican

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// The worker's and the producer's metrics through OpenTelemetry's metrics API (SPEC 23; docs/src/tracing.md,
// "Metrics"): the messaging conventions' instruments and Pelican's own, the same names, units and attributes in
// every library, recorded where the stats are counted so that they agree with Stats (and the Prometheus names of
// the metrics package). The instruments come from the global meter provider when a worker or producer is made
// (OpenTelemetry's global delegates to a provider installed later); nothing is recorded until the application
// installs an SDK's.

// meterName is the library's meter, as its tracer is named.
const meterName = "pelican"

// durationBuckets are messaging.process.duration's buckets, in seconds: the conventions' advice.
var durationBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10}

// counted is how a handler run ended, as the stats count it: pelican.outcome, the Prometheus outcome label.
type counted int

const (
	countedDone counted = iota
	countedTerminal
	countedFailed
	countedRetried
)

var countedNames = [...]string{"done", "terminal", "failed", "retried"}

// workerMeter is a worker's instruments, with their attribute sets made once.
type workerMeter struct {
	consumed  metric.Int64Counter
	duration  metric.Float64Histogram
	inFlight  metric.Int64UpDownCounter
	abandoned metric.Int64Counter
	// names (the stream and the group), receive and each outcome's process attributes.
	names, receive metric.MeasurementOption
	outcomes       [len(countedNames)]metric.MeasurementOption
	process        []attribute.KeyValue
}

func newWorkerMeter(stream, group string) *workerMeter {
	meter := otel.GetMeterProvider().Meter(meterName)
	// The API's instruments never fail to be made: an invalid name is the SDK's to report, and a no-op answers.
	consumed, _ := meter.Int64Counter("messaging.client.consumed.messages",
		metric.WithUnit("{message}"), metric.WithDescription("Messages delivered to the worker's handlers"))
	duration, _ := meter.Float64Histogram("messaging.process.duration",
		metric.WithUnit("s"), metric.WithDescription("Handler runs, by how they ended (pelican.outcome)"),
		metric.WithExplicitBucketBoundaries(durationBuckets...))
	inFlight, _ := meter.Int64UpDownCounter("pelican.worker.in_flight",
		metric.WithUnit("{message}"), metric.WithDescription("Messages being handled by the worker now"))
	abandoned, _ := meter.Int64Counter("pelican.worker.abandoned", metric.WithUnit("{message}"),
		metric.WithDescription("Messages given back unfinished on shutdown, their delivery not counted"))
	names := []attribute.KeyValue{
		attribute.String("messaging.destination.name", stream),
		attribute.String("messaging.consumer.group.name", group),
	}
	messaging := func(operation string) []attribute.KeyValue {
		return append([]attribute.KeyValue{
			attribute.String("messaging.system", "redis"),
			attribute.String("messaging.operation.name", operation),
			attribute.String("messaging.operation.type", operation),
		}, names...)
	}
	m := &workerMeter{
		consumed:  consumed,
		duration:  duration,
		inFlight:  inFlight,
		abandoned: abandoned,
		names:     metric.WithAttributes(names...),
		receive:   metric.WithAttributes(messaging("receive")...),
		process:   messaging("process"),
	}
	for e, name := range countedNames {
		m.outcomes[e] = metric.WithAttributes(append(messaging("process"), attribute.String("pelican.outcome", name))...)
	}
	return m
}

// started counts n messages handed to the handlers.
func (m *workerMeter) started(n int) {
	m.consumed.Add(context.Background(), int64(n), m.receive)
	m.inFlight.Add(context.Background(), int64(n), m.names)
}

// landed counts n messages out of flight: settled, or left to the give-back on shutdown.
func (m *workerMeter) landed(n int) {
	if n > 0 {
		m.inFlight.Add(context.Background(), -int64(n), m.names)
	}
}

// ended records a handler run that took ran, counted as e; handlerErr is what the handler failed with.
func (m *workerMeter) ended(e counted, ran time.Duration, handlerErr error) {
	attributes := m.outcomes[e]
	if handlerErr != nil {
		attributes = metric.WithAttributes(append(m.process,
			attribute.String("pelican.outcome", countedNames[e]), attribute.String("error.type", errorType(handlerErr)))...)
	}
	m.duration.Record(context.Background(), ran.Seconds(), attributes)
}

// abandonedGiven counts n messages given back on shutdown.
func (m *workerMeter) abandonedGiven(n int64) {
	if n > 0 {
		m.abandoned.Add(context.Background(), n, m.names)
	}
}

// errorType is a handler's failure as error.type: its type (*errors.errorString), or "panic".
func errorType(err error) string {
	if _, ok := err.(*panicError); ok {
		return "panic"
	}
	return fmt.Sprintf("%T", err)
}

// producerMeter is a producer's instrument, with its attribute sets made once: written, then by error.type.
type producerMeter struct {
	sent                                           metric.Int64Counter
	written, refused, unavailable, unknown, failed metric.MeasurementOption
}

func newProducerMeter(stream string) *producerMeter {
	sent, _ := otel.GetMeterProvider().Meter(meterName).Int64Counter("messaging.client.sent.messages",
		metric.WithUnit("{message}"),
		metric.WithDescription("Entries published, with error.type when not written (or not known to be)"))
	attributes := func(errorType ...string) metric.MeasurementOption {
		set := []attribute.KeyValue{
			attribute.String("messaging.system", "redis"),
			attribute.String("messaging.destination.name", stream),
			attribute.String("messaging.operation.name", "publish"),
			attribute.String("messaging.operation.type", "send"),
		}
		for _, e := range errorType {
			set = append(set, attribute.String("error.type", e))
		}
		return metric.WithAttributes(set...)
	}
	return &producerMeter{
		sent:        sent,
		written:     attributes(),
		refused:     attributes("refused"),
		unavailable: attributes("unavailable"),
		unknown:     attributes("unknown"),
		failed:      attributes("failed"),
	}
}

// add counts n entries as attributes say.
func (m *producerMeter) add(n int, attributes metric.MeasurementOption) {
	if n > 0 {
		m.sent.Add(context.Background(), int64(n), attributes)
	}
}

// notSent counts n entries a publish did not write (or may have): error.type is its outcome.
func (m *producerMeter) notSent(n int, err error) {
	var refused *RefusedError
	var unknown *OutcomeUnknownError
	switch {
	case errors.As(err, &refused):
		m.add(n, m.refused)
	case errors.Is(err, ErrUnavailable):
		m.add(n, m.unavailable)
	case errors.As(err, &unknown):
		m.add(n, m.unknown)
	default:
		m.add(n, m.failed)
	}
}
