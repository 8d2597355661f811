package pelican

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// The worker's and the producer's metrics through OpenTelemetry (SPEC 23, docs/src/tracing.md "Metrics") against a
// real redis-server, with the SDK's manual reader installed as an application would: the instruments' names,
// units, attribute sets and values a dashboard reads, and that they agree with the worker's Stats (the Prometheus
// view). The meter provider is global: the test puts the API's no-op back after it.

// points is an instrument's unit and data points: its attributes (key=value, sorted) -> value (a histogram's count).
func points(t *testing.T, reader *sdkmetric.ManualReader, name string) (string, map[string]int64) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	for _, scope := range rm.ScopeMetrics {
		if scope.Scope.Name != meterName {
			continue
		}
		for _, m := range scope.Metrics {
			if m.Name != name {
				continue
			}
			found := map[string]int64{}
			switch data := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range data.DataPoints {
					found[attributesOf(p.Attributes)] = p.Value
				}
			case metricdata.Histogram[float64]:
				for _, p := range data.DataPoints {
					found[attributesOf(p.Attributes)] = int64(p.Count)
				}
			default:
				t.Fatalf("%s: %T is not a sum or a histogram", name, m.Data)
			}
			return m.Unit, found
		}
	}
	t.Fatalf("no instrument %s", name)
	return "", nil
}

func attributesOf(set attribute.Set) string {
	var pairs []string
	for _, kv := range set.ToSlice() {
		pairs = append(pairs, string(kv.Key)+"="+kv.Value.Emit())
	}
	return key(pairs...)
}

// key is an attribute set as points answers it.
func key(pairs ...string) string {
	sort.Strings(pairs)
	return strings.Join(pairs, ",")
}

// metered is the handler of the test: it obeys the field handle; a requeued copy of a retry is done.
func metered(ctx context.Context, m Message) (Outcome, error) {
	_, requeued := m.Lookup(DeliveriesField)
	switch m.Get("handle") {
	case "fail":
		return Outcome{}, errors.New("the card was declined")
	case "terminal":
		return Terminal("Gone"), nil
	case "retry":
		if !requeued {
			return Retry(), nil
		}
	case "slow":
		<-ctx.Done()
	}
	return Done(), nil
}

func TestWithoutAnSDKAWorkerAndAProducerRunAsEver(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	if _, err := newProducer(t, noRetries(t, server.Addr)).Publish(bg, "handle", "done"); err != nil {
		t.Fatal(err)
	}
	w, _ := newWorker(t, WorkerOptions{Block: 50 * time.Millisecond})
	r := start(t, w, metered)
	eventually(t, 10*time.Second, "the handler run", func() bool { return w.Stats().Done == 1 })
	if stats, err := r.stop(t); err != nil || stats.Done != 1 {
		t.Fatalf("%+v, %v", stats, err)
	}
}

func TestAWorkerAndAProducerRecordTheMessagingConventionsInstrumentsAsTheStatsCount(t *testing.T) {
	// The application installs an SDK, before it makes its producers and workers.
	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	otel.SetMeterProvider(provider)
	t.Cleanup(func() {
		otel.SetMeterProvider(noop.NewMeterProvider())
		_ = provider.Shutdown(bg)
	})
	c := newClient(t)
	createGroup(t, c)
	const wrongType = "not-a-stream"
	c.Set(bg, wrongType, "x", 0)
	producer := newProducer(t, noRetries(t, server.Addr))
	w, _ := newWorker(t, WorkerOptions{Block: 50 * time.Millisecond, ShutdownGrace: 200 * time.Millisecond})
	r := start(t, w, metered)
	ids := map[string]string{}
	for _, handle := range []string{"done", "fail", "retry", "terminal"} {
		id, err := producer.Publish(bg, "handle", handle)
		if err != nil {
			t.Fatal(err)
		}
		ids[handle] = id
	}
	runs := func(done, failed uint64) func() bool {
		return func() bool {
			s := w.Stats()
			return s.Done == done && s.Failed == failed && s.Retried == 1 && s.Terminal == 1
		}
	}
	eventually(t, 10*time.Second, "the four runs", runs(1, 1))
	// The pass retries the failure and the retry (a copy at the end, the original ACKed); the failure's copy fails
	// again (at the cap: dead-letter-bound).
	for _, handle := range []string{"fail", "retry"} {
		c.XAdd(bg, &redis.XAddArgs{Stream: testStream, Values: []any{"handle", handle, "pelican-origin-id", ids[handle],
			DeliveriesField, "1"}})
		c.XAck(bg, testStream, testGroup, ids[handle])
	}
	eventually(t, 10*time.Second, "the copies' runs", runs(2, 2))
	if _, err := producer.Publish(bg, "handle", "slow"); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the slow one in flight", func() bool { return w.Stats().InFlight == 1 })
	stats, err := r.stop(t)
	if err != nil {
		t.Fatal(err)
	}
	wrong, err := NewProducer(noRetries(t, server.Addr), wrongType)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := wrong.Publish(bg, "handle", "done"); !errors.Is(err, ErrFailed) {
		t.Fatalf("a publish to a key of another type: %v", err)
	}
	want := Stats{Done: 2, Terminal: 1, Failed: 2, Retried: 1, Abandoned: 1}
	if stats != want {
		t.Fatalf("stats %+v, not %+v", stats, want)
	}

	names := []string{"messaging.destination.name=" + testStream, "messaging.consumer.group.name=" + testGroup}
	messaging := func(operation string, more ...string) string {
		return key(append(append([]string{"messaging.system=redis", "messaging.operation.name=" + operation,
			"messaging.operation.type=" + operation}, names...), more...)...)
	}
	publish := func(destination string, more ...string) string {
		return key(append([]string{"messaging.system=redis", "messaging.destination.name=" + destination,
			"messaging.operation.name=publish", "messaging.operation.type=send"}, more...)...)
	}
	for _, c := range []struct {
		name, unit string
		want       map[string]int64
	}{
		{"messaging.client.consumed.messages", "{message}", map[string]int64{messaging("receive"): 7}},
		{"messaging.process.duration", "s", map[string]int64{
			messaging("process", "pelican.outcome=done"):                                     2,
			messaging("process", "pelican.outcome=failed", "error.type=*errors.errorString"): 2,
			messaging("process", "pelican.outcome=retried"):                                  1,
			messaging("process", "pelican.outcome=terminal"):                                 1,
		}},
		{"pelican.worker.in_flight", "{message}", map[string]int64{key(names...): 0}},
		{"pelican.worker.abandoned", "{message}", map[string]int64{key(names...): 1}},
		{"messaging.client.sent.messages", "{message}", map[string]int64{
			publish(testStream):                     5,
			publish(wrongType, "error.type=failed"): 1,
		}},
	} {
		unit, got := points(t, reader, c.name)
		if unit != c.unit || fmt.Sprint(got) != fmt.Sprint(c.want) {
			t.Errorf("%s: unit %q, points %v; want %q, %v", c.name, unit, got, c.unit, c.want)
		}
	}
}
