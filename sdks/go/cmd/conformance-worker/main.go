// The conformance worker of the Go library (contract/README.md, "The conformance worker"), configured by
// environment: REDIS_URL, STREAM, GROUP, CONSUMER (default: the Pod's name) and SHUTDOWN_GRACE_MS. Its handler
// obeys the message: field ms = how long it takes, field handle = done | retry | fail | terminal:<Reason> | exit
// (the process exits at once with status 3). It prints one JSON line per handler run that finished on stdout, and
// exits 0 after a SIGTERM once its shutdown is complete, 4 when the operator speaks a contract version this library
// does not know (after its shutdown).
//
// With SENTINEL_MASTER=<name>, REDIS_URL names a sentinel, and go-redis' failover client (FailoverOptions) asks it for
// the primary monitored under that name, again whenever it connects.
//
// With TOPIC=<T> instead of STREAM it is a member of topic T's group: it runs the library's TopicWorker as member
// CONSUMER with a membership ttl of MEMBERSHIP_TTL_MS (the library's default without it), and each run line also says
// the partition the entry was read from, its key (null without one), and when the handler began and returned
// (startedAt, endedAt: ms since the epoch; for exit both the start). A topic the library refuses exits with status 4.
// With REDIS_CLUSTER=1 (either mode), REDIS_URL names one primary of a Redis Cluster, reached with go-redis'
// ClusterClient.
//
// With MODE=publish it is a producer instead: it publishes MESSAGES messages idempotently (message ids m-0, m-1,
// ...), each published again with the same id until it answers an entry id, one JSON line per attempt.
//
// With OTEL_EXPORTER_OTLP_ENDPOINT set, the library's spans go to it over OTLP (HTTP/protobuf, otlptracehttp reading
// the standard OTEL_EXPORTER_OTLP_* variables), the service named by OTEL_SERVICE_NAME (pelican-conformance-go by
// default); whichever way the program ends, the spans still queued are exported first (for at most 5 s). The program
// is a module of its own, so that the exporter and what it brings (gRPC, protobuf) are never requirements of the
// library's users.
//
// With METRICS_PORT set (a worker of a stream), the worker's metrics (package metrics, in a Prometheus registry of
// its own) are served at http://127.0.0.1:<port>/metrics.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	pelican "github.com/pelican-io/pelican/sdks/go"
	"github.com/pelican-io/pelican/sdks/go/metrics"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

var stdout sync.Mutex

type run struct {
	ID       string `json:"id"`
	Consumer string `json:"consumer"`
	Outcome  string `json:"outcome"`
	MS       int    `json:"ms"`
}

// topicRun is a run line of a topic's member.
type topicRun struct {
	run
	Partition int     `json:"partition"`
	Key       *string `json:"key"`
	StartedAt int64   `json:"startedAt"`
	EndedAt   int64   `json:"endedAt"`
}

// reporter prints the run lines of one handler; topic: with the partition, the key and the times.
type reporter struct {
	consumer string
	topic    bool
}

func (r reporter) report(m pelican.Message, outcome string, ms int, started time.Time) {
	line, _ := json.Marshal(run{ID: m.ID, Consumer: r.consumer, Outcome: outcome, MS: ms})
	if r.topic {
		ended := time.Now()
		if outcome == "exit" {
			ended = started
		}
		var key *string
		if k, ok := m.Key(); ok {
			key = &k
		}
		line, _ = json.Marshal(topicRun{run: run{ID: m.ID, Consumer: r.consumer, Outcome: outcome, MS: ms},
			Partition: m.Partition, Key: key, StartedAt: started.UnixMilli(), EndedAt: ended.UnixMilli()})
	}
	stdout.Lock()
	defer stdout.Unlock()
	os.Stdout.Write(append(line, '\n'))
}

func handler(r reporter) pelican.Handler {
	return func(ctx context.Context, m pelican.Message) (pelican.Outcome, error) {
		started := time.Now()
		ms, _ := strconv.Atoi(m.Get("ms"))
		if ms > 0 {
			select {
			case <-time.After(time.Duration(ms) * time.Millisecond):
			case <-ctx.Done(): // given back on shutdown: the run did not finish, nothing is printed
				return pelican.Outcome{}, ctx.Err()
			}
		}
		// HANDLE overrides every message's handle (a worker that fails whatever it reads).
		action := m.Get("handle")
		if override := os.Getenv("HANDLE"); override != "" {
			action = override
		}
		switch {
		case action == "exit":
			r.report(m, "exit", ms, started)
			exit(3)
		case action == "fail":
			r.report(m, "fail", ms, started)
			return pelican.Outcome{}, errors.New("the message asked the conformance worker to fail")
		case strings.HasPrefix(action, "terminal:"):
			reason := strings.TrimPrefix(action, "terminal:")
			if err := pelican.CheckReason(reason); err != nil {
				r.report(m, "fail", ms, started) // the library refuses it before anything is written
				return pelican.Outcome{}, err
			}
			r.report(m, "terminal", ms, started)
			return pelican.Terminal(reason), nil
		case action == "retry":
			r.report(m, "retry", ms, started)
			return pelican.Retry(), nil
		}
		r.report(m, "done", ms, started)
		return pelican.Done(), nil
	}
}

// newClient connects as REDIS_URL says: to the server it names, or, with SENTINEL_MASTER, to the primary the
// sentinel it names answers for that name, or, with REDIS_CLUSTER=1, to the Cluster of the primary it names.
// resend false: the client's own resends off, as a producer needs.
func newClient(url string, resend bool) (redis.UniversalClient, error) {
	options, err := redis.ParseURL(url)
	if err != nil {
		return nil, err
	}
	if !resend {
		options.MaxRetries = -1
	}
	if os.Getenv("REDIS_CLUSTER") == "1" {
		cluster := &redis.ClusterOptions{Addrs: []string{options.Addr}, Username: options.Username,
			Password: options.Password, TLSConfig: options.TLSConfig, MaxRetries: options.MaxRetries}
		if !resend {
			cluster.MaxRedirects = -1
		}
		return redis.NewClusterClient(cluster), nil
	}
	master := os.Getenv("SENTINEL_MASTER")
	if master == "" {
		return redis.NewClient(options), nil
	}
	return redis.NewFailoverClient(&redis.FailoverOptions{
		MasterName:    master,
		SentinelAddrs: []string{options.Addr},
		DB:            options.DB,
		MaxRetries:    options.MaxRetries,
	}), nil
}

func serve() error {
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	url := os.Getenv("REDIS_URL")
	if url == "" {
		url = "redis://127.0.0.1:6379"
	}
	grace := time.Duration(0) // the library's default
	if text := os.Getenv("SHUTDOWN_GRACE_MS"); text != "" {
		ms, err := strconv.Atoi(text)
		if err != nil {
			return fmt.Errorf("SHUTDOWN_GRACE_MS: %w", err)
		}
		grace = time.Duration(ms) * time.Millisecond
		if ms == 0 {
			grace = -1 // none
		}
	}
	client, err := newClient(url, true)
	if err != nil {
		return err
	}
	defer client.Close()
	options := pelican.WorkerOptions{
		Stream:        os.Getenv("STREAM"),
		Group:         os.Getenv("GROUP"),
		Consumer:      os.Getenv("CONSUMER"),
		ShutdownGrace: grace,
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if topic := os.Getenv("TOPIC"); topic != "" {
		return serveTopic(ctx, client, topic, options)
	}
	worker, err := pelican.NewWorker(client, options)
	if err != nil {
		return err
	}
	if port := os.Getenv("METRICS_PORT"); port != "" {
		if err := serveMetrics(worker, port); err != nil {
			return err
		}
	}
	_, err = worker.Run(ctx, handler(reporter{consumer: worker.Consumer()}))
	return err
}

// serveMetrics serves worker's metrics as an application would: its collector in a registry, read at each scrape.
func serveMetrics(worker *pelican.Worker, port string) error {
	registry := prometheus.NewRegistry()
	if err := registry.Register(metrics.NewCollector(worker)); err != nil {
		return err
	}
	listener, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", port))
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{}))
	go func() { _ = http.Serve(listener, mux) }()
	return nil
}

// serveTopic runs the library's TopicWorker as a member of topic's group.
func serveTopic(ctx context.Context, client redis.UniversalClient, topic string, options pelican.WorkerOptions) error {
	options.Stream = topic
	if options.Consumer == "" {
		options.Consumer = pelican.PodName()
	}
	var ttl time.Duration // the library's default
	if text := os.Getenv("MEMBERSHIP_TTL_MS"); text != "" {
		ms, err := strconv.Atoi(text)
		if err != nil {
			return fmt.Errorf("MEMBERSHIP_TTL_MS: %w", err)
		}
		ttl = time.Duration(ms) * time.Millisecond
	}
	worker, err := pelican.NewTopicWorker(ctx, client, pelican.TopicWorkerOptions{WorkerOptions: options,
		MembershipTTL: ttl})
	if err != nil {
		return err
	}
	_, err = worker.Run(ctx, handler(reporter{consumer: options.Consumer, topic: true}))
	return err
}

// publish publishes m-0 .. m-<messages-1> idempotently; an attempt whose outcome is unknown (its reply was lost) or
// that found the server unavailable is published again with the same message id, as the contract says.
func publish(url, stream string, messages int) error {
	ctx := context.Background()
	line := func(fields map[string]string) {
		text, _ := json.Marshal(fields)
		os.Stdout.Write(append(text, '\n'))
	}
	for n := 0; n < messages; n++ {
		message := fmt.Sprintf("m-%d", n)
		for {
			// A client of its own per attempt: a lost reply leaves the last connection broken.
			client, err := newClient(url, false) // the contract: the client's own resends off
			if err != nil {
				return err
			}
			producer, err := pelican.NewIdempotentProducer(ctx, client, stream, pelican.PodName())
			if err != nil {
				client.Close()
				return err
			}
			id, err := producer.Publish(ctx, message, "n", strconv.Itoa(n))
			client.Close()
			var unknown *pelican.OutcomeUnknownError
			if err == nil {
				line(map[string]string{"message": message, "outcome": "published", "id": id})
				break
			}
			if !errors.As(err, &unknown) && !errors.Is(err, pelican.ErrUnavailable) {
				return err
			}
			line(map[string]string{"message": message, "outcome": "unknown"})
			time.Sleep(100 * time.Millisecond)
		}
	}
	return nil
}

// traces exports the library's spans when the program was given an OTLP endpoint; nil otherwise.
var traces *sdktrace.TracerProvider

// exportTraces installs the OpenTelemetry SDK when OTEL_EXPORTER_OTLP_ENDPOINT is set: a tracer provider whose batch
// processor hands the spans to the OTLP exporter, and the W3C trace-context propagator.
func exportTraces() error {
	if os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" {
		return nil
	}
	exporter, err := otlptracehttp.New(context.Background())
	if err != nil {
		return err
	}
	service := os.Getenv("OTEL_SERVICE_NAME")
	if service == "" {
		service = "pelican-conformance-go"
	}
	traces = sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter),
		sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", service))))
	otel.SetTracerProvider(traces)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	return nil
}

// exit ends the process with code once the spans still queued are exported, waiting for them at most 5 s.
func exit(code int) {
	if traces != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := traces.Shutdown(ctx); err != nil {
			fmt.Fprintln(os.Stderr, "conformance worker: exporting the last spans:", err)
		}
		cancel()
	}
	os.Exit(code)
}

func main() {
	if err := exportTraces(); err != nil {
		fmt.Fprintln(os.Stderr, "conformance worker: OTLP exporter:", err)
		os.Exit(1)
	}
	exit(status())
}

// status runs the program as its environment says and answers its exit status.
func status() int {
	if os.Getenv("MODE") == "publish" {
		messages, err := strconv.Atoi(os.Getenv("MESSAGES"))
		if err == nil {
			err = publish(os.Getenv("REDIS_URL"), os.Getenv("STREAM"), messages)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "conformance producer:", err)
			return 1
		}
		return 0
	}
	if err := serve(); err != nil {
		fmt.Fprintln(os.Stderr, "conformance worker:", err)
		var version *pelican.ContractVersionError
		var notATopic *pelican.NotATopicError
		var topicContract *pelican.TopicContractError
		var ordering *pelican.OrderingError
		if errors.As(err, &version) || errors.As(err, &notATopic) || errors.As(err, &topicContract) ||
			errors.As(err, &ordering) {
			return 4 // after its shutdown, when the operator speaks a contract this library does not know
		}
		return 1
	}
	return 0
}
