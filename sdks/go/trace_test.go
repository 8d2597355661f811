package pelican

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"reflect"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/redis/go-redis/v9"
)

// A message's trace through the stream (SPEC 23, contract/README.md "Trace context") against a real redis-server,
// with the OpenTelemetry SDK's in-memory exporter and the W3C propagator installed as an application would: what
// the entry carries, and the spans of each publish and handler run, one trace from the application's request to
// every run. Each test installs the SDK (the provider and the propagator are global) and puts the API's defaults
// back after it.

// installSDK installs an SDK recording every span into the exporter answered, and the W3C propagator.
func installSDK(t *testing.T) *tracetest.InMemoryExporter {
	t.Helper()
	exporter := tracetest.NewInMemoryExporter()
	provider := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
	otel.SetTracerProvider(provider)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	t.Cleanup(func() {
		otel.SetTracerProvider(noop.NewTracerProvider())
		otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator())
		_ = provider.Shutdown(bg)
	})
	return exporter
}

// inSpan runs work inside a new span of the application's, name, ended after it.
func inSpan[T any](name string, work func(ctx context.Context) T) (trace.SpanContext, T) {
	ctx, span := otel.Tracer("shop").Start(bg, name)
	defer span.End()
	return span.SpanContext(), work(ctx)
}

// streamEntries is each entry of stream: its fields in order (the raw reply: go-redis' XRange answers a map), by id.
func streamEntries(t *testing.T, c *redis.Client, stream string) map[string][]string {
	t.Helper()
	raw, err := c.Do(bg, "XRANGE", stream, "-", "+").Slice()
	if err != nil {
		t.Fatal(err)
	}
	found := map[string][]string{}
	for _, e := range raw {
		entry := e.([]any)
		fields := []string{}
		for _, v := range entry[1].([]any) {
			fields = append(fields, v.(string))
		}
		found[entry[0].(string)] = fields
	}
	return found
}

func named(spans tracetest.SpanStubs, name string) tracetest.SpanStubs {
	var found tracetest.SpanStubs
	for _, s := range spans {
		if s.Name == name {
			found = append(found, s)
		}
	}
	return found
}

// attr is the span's attribute key as text, "" when it has none.
func attr(s tracetest.SpanStub, key string) string {
	for _, a := range s.Attributes {
		if string(a.Key) == key {
			return a.Value.Emit()
		}
	}
	return ""
}

func ofMessage(t *testing.T, spans tracetest.SpanStubs, id string) tracetest.SpanStub {
	t.Helper()
	for _, s := range spans {
		if attr(s, "messaging.message.id") == id {
			return s
		}
	}
	t.Fatalf("no span of message %s among %d", id, len(spans))
	return tracetest.SpanStub{}
}

// traceparent is the W3C field of a sampled span context.
func traceparent(sc trace.SpanContext) string {
	return fmt.Sprintf("00-%s-%s-01", sc.TraceID(), sc.SpanID())
}

// obey is the handler the tests run: it obeys the field handle, and records the span it runs in.
func obey(seen *sync.Map) Handler {
	return func(ctx context.Context, m Message) (Outcome, error) {
		seen.Store(m.ID, trace.SpanContextFromContext(ctx))
		switch m.Get("handle") {
		case "fail":
			return Outcome{}, errors.New("the card was declined")
		case "terminal:Gone":
			return Terminal("Gone"), nil
		case "retry":
			return Retry(), nil
		}
		return Done(), nil
	}
}

func count(m *sync.Map) int {
	n := 0
	m.Range(func(any, any) bool { n++; return true })
	return n
}

func TestWithoutAnSDKNothingIsAddedToAnEntryAndTheHandlerRunsInNoSpan(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	_, id := inSpan("checkout", func(ctx context.Context) string {
		id, err := newProducer(t, noRetries(t, server.Addr)).Publish(ctx, "handle", "done")
		if err != nil {
			t.Fatal(err)
		}
		return id
	})
	if got := streamEntries(t, c, testStream); !reflect.DeepEqual(got, map[string][]string{id: {"handle", "done"}}) {
		t.Fatalf("entries %v", got)
	}
	w, _ := newWorker(t, WorkerOptions{Block: 100 * time.Millisecond})
	var seen sync.Map
	r := start(t, w, obey(&seen))
	eventually(t, 10*time.Second, "the handler run", func() bool { return w.Stats().Done == 1 })
	r.stop(t)
	if sc, _ := seen.Load(id); sc.(trace.SpanContext).IsValid() {
		t.Fatalf("the handler ran in span %v", sc)
	}
}

func TestAMessageIsOneTraceFromTheRequestsSpanThroughItsPublishToEachHandlerRun(t *testing.T) {
	exporter := installSDK(t)
	c := newClient(t)
	createGroup(t, c)
	producer := newProducer(t, noRetries(t, server.Addr))
	handles := []string{"done", "fail", "terminal:Gone", "retry"}
	checkout, ids := inSpan("checkout", func(ctx context.Context) []string {
		var ids []string
		for _, handle := range handles {
			id, err := producer.Publish(ctx, "handle", handle)
			if err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id)
		}
		return ids
	})
	request := regexp.MustCompile(`^00-` + checkout.TraceID().String() + `-[0-9a-f]{16}-01$`)
	for id, fields := range streamEntries(t, c, testStream) {
		if len(fields) != 4 || fields[0] != "handle" || fields[2] != "traceparent" || !request.MatchString(fields[3]) {
			t.Fatalf("entry %s: %q: the application's fields, then the request's trace (no tracestate without "+
				"entries)", id, fields)
		}
	}

	w, _ := newWorker(t, WorkerOptions{Block: 100 * time.Millisecond})
	var seen sync.Map
	r := start(t, w, obey(&seen))
	eventually(t, 10*time.Second, "a handler run of each message", func() bool { return count(&seen) == len(handles) })
	r.stop(t)

	spans := exporter.GetSpans()
	sends, runs := named(spans, "send "+testStream), named(spans, "process "+testStream)
	if len(sends) != 4 || len(runs) != 4 {
		t.Fatalf("%d sends, %d runs", len(sends), len(runs))
	}
	for _, id := range ids {
		send := ofMessage(t, sends, id)
		if send.SpanKind != trace.SpanKindProducer || send.Parent.SpanID() != checkout.SpanID() {
			t.Errorf("send %s: kind %v, parent %v: a child of the request", id, send.SpanKind, send.Parent.SpanID())
		}
		for key, want := range map[string]string{"messaging.system": "redis", "messaging.destination.name": testStream,
			"messaging.operation.type": "send", "messaging.operation.name": "publish"} {
			if got := attr(send, key); got != want {
				t.Errorf("send %s: %s = %q, not %q", id, key, got, want)
			}
		}
		run := ofMessage(t, runs, id)
		if run.SpanKind != trace.SpanKindConsumer || run.SpanContext.TraceID() != checkout.TraceID() ||
			run.Parent.SpanID() != send.SpanContext.SpanID() {
			t.Errorf("run %s: kind %v, trace %v, parent %v: one trace, each run continuing its publish", id,
				run.SpanKind, run.SpanContext.TraceID(), run.Parent.SpanID())
		}
		for key, want := range map[string]string{"messaging.consumer.group.name": testGroup,
			"messaging.client.id": testConsumer, "messaging.operation.type": "process",
			"messaging.operation.name": "process", "messaging.destination.name": testStream} {
			if got := attr(run, key); got != want {
				t.Errorf("run %s: %s = %q, not %q", id, key, got, want)
			}
		}
		if sc, _ := seen.Load(id); sc.(trace.SpanContext).SpanID() != run.SpanContext.SpanID() {
			t.Errorf("run %s: the handler ran in %v, not in its run's span", id, sc)
		}
	}
	doneRun, failRun, terminalRun, retryRun := ofMessage(t, runs, ids[0]), ofMessage(t, runs, ids[1]),
		ofMessage(t, runs, ids[2]), ofMessage(t, runs, ids[3])
	if attr(doneRun, "pelican.outcome") != "done" || doneRun.Status.Code != codes.Unset {
		t.Errorf("done: %q, %v", attr(doneRun, "pelican.outcome"), doneRun.Status)
	}
	recorded := c.HGet(bg, ErrorsKey(testStream, testGroup), ids[1]).Val()
	if attr(failRun, "pelican.outcome") != "fail" || failRun.Status.Code != codes.Error ||
		failRun.Status.Description != "the card was declined" || recorded != failRun.Status.Description {
		t.Errorf("fail: %q, %v; the entry's last error %q", attr(failRun, "pelican.outcome"), failRun.Status, recorded)
	}
	if attr(terminalRun, "pelican.outcome") != "terminal" || attr(terminalRun, "pelican.reason") != "Gone" {
		t.Errorf("terminal: %q, %q", attr(terminalRun, "pelican.outcome"), attr(terminalRun, "pelican.reason"))
	}
	if attr(retryRun, "pelican.outcome") != "retry" {
		t.Errorf("retry: %q", attr(retryRun, "pelican.outcome"))
	}
}

func TestABatchIsOneSendSpanWhoseContextEveryEntryCarries(t *testing.T) {
	exporter := installSDK(t)
	c := newClient(t)
	_, published := inSpan("import", func(ctx context.Context) Published {
		published, err := newProducer(t, noRetries(t, server.Addr)).PublishBatch(ctx, [][]string{{"n", "1"}, {"n", "2"}})
		if err != nil || len(published.IDs) != 2 {
			t.Fatalf("%+v, %v", published, err)
		}
		return published
	})
	sends := named(exporter.GetSpans(), "send "+testStream)
	if len(sends) != 1 || attr(sends[0], "messaging.batch.message_count") != "2" {
		t.Fatalf("%d send spans, count %q: one for the batch", len(sends), attr(sends[0], "messaging.batch.message_count"))
	}
	batch := traceparent(sends[0].SpanContext)
	want := map[string][]string{
		published.IDs[0]: {"n", "1", "traceparent", batch},
		published.IDs[1]: {"n", "2", "traceparent", batch},
	}
	if got := streamEntries(t, c, testStream); !reflect.DeepEqual(got, want) {
		t.Fatalf("entries %q, not %q", got, want)
	}
}

func TestATopicsPublishAndHandlerRunNameTheTopicTheKeyAndThePartition(t *testing.T) {
	for _, ordering := range []string{"None", "PerKey"} {
		t.Run(ordering, func(t *testing.T) {
			exporter := installSDK(t)
			c := newClient(t)
			describe(t, c, 2, "ordering", ordering)
			_, published := inSpan("checkout", func(ctx context.Context) TopicPublished {
				published, err := newTopicProducer(t).PublishKeyed(ctx, "order-42", "handle", "done")
				if err != nil {
					t.Fatal(err)
				}
				return published
			})
			stream := PartitionStream(testTopic, published.Partition)
			var seen sync.Map
			m := startMember(t, "member-1", 4, obey(&seen))
			eventually(t, 10*time.Second, "the run's span", func() bool {
				return len(named(exporter.GetSpans(), "process "+stream)) == 1
			})
			m.stop(t)

			spans := exporter.GetSpans()
			send := ofMessage(t, named(spans, "send "+stream), published.ID)
			run := ofMessage(t, named(spans, "process "+stream), published.ID)
			for _, s := range []tracetest.SpanStub{send, run} {
				got := []string{attr(s, "pelican.topic"), attr(s, "pelican.key"), attr(s, "messaging.destination.name")}
				if want := []string{testTopic, "order-42", stream}; !reflect.DeepEqual(got, want) {
					t.Errorf("%s: %q, not %q", s.Name, got, want)
				}
			}
			if run.Parent.SpanID() != send.SpanContext.SpanID() || attr(run, "pelican.outcome") != "done" {
				t.Errorf("the run's parent %v, outcome %q: it continues its publish", run.Parent.SpanID(),
					attr(run, "pelican.outcome"))
			}
			want := []string{KeyField, "order-42", "handle", "done", "traceparent", traceparent(send.SpanContext)}
			if got := streamEntries(t, c, stream)[published.ID]; !reflect.DeepEqual(got, want) {
				t.Errorf("entry %q, not %q: the key first, the context last", got, want)
			}
		})
	}
}

func TestARunOfAnEntryWithoutAContextIsANewTraceWhateverTheWorkersContextHolds(t *testing.T) {
	exporter := installSDK(t)
	ctx, serving := otel.Tracer("shop").Start(bg, "serve")
	defer serving.End()
	w := &Worker{opt: WorkerOptions{Stream: testStream, Group: testGroup, Consumer: testConsumer},
		processName: "process " + testStream}
	var seen sync.Map
	if _, err := w.handle(ctx, obey(&seen), Message{ID: "1-0", Fields: []Field{{"handle", "done"}}}); err != nil {
		t.Fatal(err)
	}
	runs := named(exporter.GetSpans(), "process "+testStream)
	if len(runs) != 1 || runs[0].Parent.IsValid() || runs[0].SpanContext.TraceID() == serving.SpanContext().TraceID() {
		t.Fatalf("runs %v: one, the root of a trace of its own", runs)
	}
}

// lostRequest is a loopback proxy to upstream that loses one request: the first EVALSHA is never passed on, and
// its connection is closed. Later connections pass through.
type lostRequest struct {
	listener net.Listener
	upstream string
	lost     atomic.Bool
}

func newLostRequest(t *testing.T, upstream string) *lostRequest {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &lostRequest{listener: listener, upstream: upstream}
	t.Cleanup(func() { listener.Close() })
	go func() {
		for {
			conn, err := listener.Accept()
			if err != nil {
				return
			}
			go p.serve(conn)
		}
	}()
	return p
}

func (p *lostRequest) serve(client net.Conn) {
	defer client.Close()
	server, err := net.Dial("tcp", p.upstream)
	if err != nil {
		return
	}
	defer server.Close()
	go func() { _, _ = io.Copy(client, server) }()
	buf := make([]byte, 65536)
	for {
		n, err := client.Read(buf)
		if err != nil {
			return
		}
		if strings.Contains(strings.ToUpper(string(buf[:n])), "EVALSHA") && p.lost.CompareAndSwap(false, true) {
			return // the request is lost with the connection
		}
		if _, err := server.Write(buf[:n]); err != nil {
			return
		}
	}
}

func TestARetriedIdempotentPublishWritesTheContextOfItsFirstAttempt(t *testing.T) {
	c := idmpClient(t)
	exporter := installSDK(t)
	proxy := newLostRequest(t, c.Options().Addr)
	producer, err := NewIdempotentProducer(bg, noRetries(t, proxy.listener.Addr().String()), testStream, "shop-1")
	if err != nil {
		t.Fatal(err)
	}
	first, err := inSpan("checkout", func(ctx context.Context) error {
		_, err := producer.Publish(ctx, "order-7", "order", "7")
		return err
	})
	var unknown *OutcomeUnknownError
	if !errors.As(err, &unknown) || !proxy.lost.Load() {
		t.Fatalf("the first attempt: %v, lost %v", err, proxy.lost.Load())
	}
	if n := c.XLen(bg, testStream).Val(); n != 0 {
		t.Fatalf("the first attempt wrote %d entries", n)
	}
	// The application publishes it again, later, in another span.
	_, id := inSpan("retry", func(ctx context.Context) string {
		id, err := producer.Publish(ctx, "order-7", "order", "7")
		if err != nil {
			t.Fatal(err)
		}
		return id
	})

	sends := named(exporter.GetSpans(), "send "+testStream)
	if len(sends) != 2 {
		t.Fatalf("%d send spans", len(sends))
	}
	firstSend, written := sends[0], ofMessage(t, sends, id)
	if firstSend.Parent.SpanID() != first.SpanID() || firstSend.Status.Code != codes.Error ||
		attr(firstSend, "pelican.message_id") != "order-7" {
		t.Errorf("the first send: parent %v, status %v, message id %q", firstSend.Parent.SpanID(), firstSend.Status,
			attr(firstSend, "pelican.message_id"))
	}
	if written.SpanContext.TraceID() == firstSend.SpanContext.TraceID() {
		t.Errorf("the second attempt was published in the first one's trace")
	}
	want := map[string][]string{id: {"order", "7", "traceparent", traceparent(firstSend.SpanContext)}}
	if got := streamEntries(t, c, testStream); !reflect.DeepEqual(got, want) {
		t.Fatalf("entries %q, not %q: the first attempt's context", got, want)
	}
}

func TestTheCarriedFieldsAreKeptForTheLast1024MessageIDsOnlyEachTakenOnce(t *testing.T) {
	var carried carriedFields
	for n := 0; n <= carriedKept; n++ {
		carried.keep(fmt.Sprint("m-", n), []any{"traceparent", fmt.Sprint(n)})
	}
	if got, ok := carried.take("m-0"); ok {
		t.Errorf("the oldest is still kept: %v", got)
	}
	last := fmt.Sprint("m-", carriedKept)
	if got, _ := carried.take(last); !reflect.DeepEqual(got, []any{"traceparent", fmt.Sprint(carriedKept)}) {
		t.Errorf("the last: %v", got)
	}
	if got, ok := carried.take(last); ok {
		t.Errorf("taken twice: %v", got)
	}
	carried.keep("m-1", []any{"traceparent", "again"})
	if got, _ := carried.take("m-1"); !reflect.DeepEqual(got, []any{"traceparent", "again"}) {
		t.Errorf("kept again under its id: %v", got)
	}
	// Kept again, m-1 is the newest: 1,024 more push out m-2 first, and m-1 last.
	carried.keep("m-1", []any{"traceparent", "newest"})
	for n := 0; n < carriedKept-1; n++ {
		carried.keep(fmt.Sprint("x-", n), nil)
	}
	_, older := carried.take("m-2")
	_, newer := carried.take("m-1")
	if older || !newer {
		t.Errorf("the order of the kept ids is not the order they were kept in")
	}
}

// What tracing costs a handler run without an SDK: the run inside its (no-op) span beside the bare handler call, on
// an entry that carries a traceparent. go test -run XXX -bench HandlerRun
func BenchmarkAHandlerRunWithoutAnSDK(b *testing.B) {
	w := &Worker{opt: WorkerOptions{Stream: testStream, Group: testGroup, Consumer: testConsumer},
		processName: "process " + testStream}
	m := Message{ID: "1-0", Fields: []Field{{"n", "1"}, {"traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}}
	handler := func(context.Context, Message) (Outcome, error) { return Done(), nil }
	b.Run("bare", func(b *testing.B) {
		for b.Loop() {
			_, _ = runHandler(bg, handler, m)
		}
	})
	b.Run("traced", func(b *testing.B) {
		for b.Loop() {
			_, _ = w.handle(bg, handler, m)
		}
	})
}
