// The throughput of the library's worker beside a hand-written go-redis XREADGROUP/XACK loop, on the same server
// in one run: go run ./bench [-n 20000] [-rounds 5]. REDIS_URL names the server; without it a redis-server
// (REDIS_SERVER, else the one on PATH) is started on a free loopback port. Each round runs every pair in turn; the
// medians are printed side by side with their ratio; and the worker again with an OpenTelemetry SDK installed,
// recording a span per handler run, and with a meter provider recording its metrics, beside the worker without one.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"slices"
	"time"

	pelican "github.com/pelican-io/pelican/sdks/go"
	"github.com/pelican-io/pelican/sdks/go/internal/redistest"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace/noop"
)

const stream, group, consumer = "bench", "bench", "bench-1"

var ctx = context.Background()

// traceparent is the context a traced producer writes into each entry (contract/README.md, "Trace context").
const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// recorded counts the spans the SDK recorded, in every traced run.
var recorded int

// fill empties the stream and adds n entries for a new group (not timed).
func fill(c *redis.Client, n int) error {
	c.Del(ctx, stream, pelican.SettingsKey(stream, group))
	if err := c.XGroupCreateMkStream(ctx, stream, group, "$").Err(); err != nil {
		return err
	}
	for added := 0; added < n; {
		pipe := c.Pipeline()
		for ; added < n && pipe.Len() < 1000; added++ {
			pipe.XAdd(ctx, &redis.XAddArgs{Stream: stream,
				Values: []string{"job", fmt.Sprint(added), "traceparent", traceparent}})
		}
		if _, err := pipe.Exec(ctx); err != nil {
			return err
		}
	}
	return nil
}

// library runs the worker with a handler that does nothing until n messages are acknowledged.
func library(c *redis.Client, n, concurrency int) (time.Duration, error) {
	w, err := pelican.NewWorker(c, pelican.WorkerOptions{
		Stream: stream, Group: group, Consumer: consumer, Concurrency: concurrency, Block: 100 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		return 0, err
	}
	runCtx, stop := context.WithCancel(ctx)
	ended := make(chan error, 1)
	began := time.Now()
	go func() {
		_, err := w.Run(runCtx, func(context.Context, pelican.Message) (pelican.Outcome, error) {
			return pelican.Done(), nil
		})
		ended <- err
	}()
	for w.Stats().Done < uint64(n) {
		time.Sleep(time.Millisecond)
	}
	took := time.Since(began)
	stop()
	return took, <-ended
}

// traced is library with an OpenTelemetry SDK installed as an application that traces would (the W3C propagator),
// every span recorded and kept in memory; the API's defaults are put back after the run.
func traced(c *redis.Client, n, concurrency int) (time.Duration, error) {
	exporter := tracetest.NewInMemoryExporter()
	provider := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
	otel.SetTracerProvider(provider)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	defer func() {
		otel.SetTracerProvider(noop.NewTracerProvider())
		otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator())
	}()
	took, err := library(c, n, concurrency)
	recorded += len(exporter.GetSpans())
	return took, errors.Join(err, provider.Shutdown(ctx))
}

// metered is library with an OpenTelemetry meter provider installed (a manual reader, read at the end); the API's
// no-op is put back after the run.
func metered(c *redis.Client, n, concurrency int) (time.Duration, error) {
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	otel.SetMeterProvider(provider)
	defer otel.SetMeterProvider(metricnoop.NewMeterProvider())
	took, err := library(c, n, concurrency)
	return took, errors.Join(err, provider.Shutdown(ctx))
}

// loop is the hand-written consumer: XREADGROUP COUNT count, then one XACK of what it read.
func loop(c *redis.Client, n, count int) (time.Duration, error) {
	began := time.Now()
	for acked := 0; acked < n; {
		streams, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{
			Group: group, Consumer: consumer, Streams: []string{stream, ">"}, Count: int64(count),
			Block: 100 * time.Millisecond,
		}).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return 0, err
		}
		var ids []string
		for _, s := range streams {
			for _, m := range s.Messages {
				ids = append(ids, m.ID)
			}
		}
		if len(ids) > 0 {
			if err := c.XAck(ctx, stream, group, ids...).Err(); err != nil {
				return 0, err
			}
		}
		acked += len(ids)
	}
	return time.Since(began), nil
}

func median(values []float64) float64 {
	sorted := slices.Sorted(slices.Values(values))
	return sorted[len(sorted)/2]
}

func main() {
	n := flag.Int("n", 20000, "messages per run")
	rounds := flag.Int("rounds", 5, "runs of each pair")
	flag.Parse()
	url, stop, err := redistest.FromEnv()
	if err != nil {
		log.Fatal(err)
	}
	defer stop()
	options, err := redis.ParseURL(url)
	if err != nil {
		log.Fatal(err)
	}
	c := redis.NewClient(options)
	defer c.Close()

	type pair struct {
		name        string
		concurrency int // the worker's; the loop reads COUNT as many
	}
	pairs := []pair{{"concurrency 1 / COUNT 1", 1}, {"concurrency 16 / COUNT 16", 16}}
	rates := map[string][]float64{}
	for round := range *rounds {
		for _, p := range pairs {
			for _, side := range []string{"library", "loop", "traced", "metered"} {
				if err := fill(c, *n); err != nil {
					log.Fatal(err)
				}
				var took time.Duration
				switch side {
				case "library":
					took, err = library(c, *n, p.concurrency)
				case "loop":
					took, err = loop(c, *n, p.concurrency)
				case "traced":
					took, err = traced(c, *n, p.concurrency)
				default:
					took, err = metered(c, *n, p.concurrency)
				}
				if err != nil {
					log.Fatal(err)
				}
				rate := float64(*n) / took.Seconds()
				rates[p.name+" "+side] = append(rates[p.name+" "+side], rate)
				fmt.Fprintf(os.Stderr, "round %d: %s %s: %.0f msgs/s\n", round+1, p.name, side, rate)
			}
		}
	}
	fmt.Printf("%d messages, median of %d rounds, on %s\n", *n, *rounds, options.Addr)
	fmt.Printf("%-28s %12s %12s %7s\n", "", "library", "loop", "ratio")
	for _, p := range pairs {
		lib, hand := median(rates[p.name+" library"]), median(rates[p.name+" loop"])
		fmt.Printf("%-28s %10.0f/s %10.0f/s %7.2f\n", p.name, lib, hand, lib/hand)
	}
	fmt.Printf("\ntracing: the worker without an SDK and with one recording a span per handler run (%d spans)\n",
		recorded)
	fmt.Printf("%-28s %12s %12s %7s\n", "", "no SDK", "SDK", "ratio")
	for _, p := range pairs {
		lib, sdk := median(rates[p.name+" library"]), median(rates[p.name+" traced"])
		fmt.Printf("%-28s %10.0f/s %10.0f/s %7.2f\n", p.name, lib, sdk, sdk/lib)
	}
	fmt.Printf("\nmetrics: the worker without an SDK and with a meter provider recording its metrics\n")
	fmt.Printf("%-28s %12s %12s %7s\n", "", "no SDK", "SDK", "ratio")
	for _, p := range pairs {
		lib, sdk := median(rates[p.name+" library"]), median(rates[p.name+" metered"])
		fmt.Printf("%-28s %10.0f/s %10.0f/s %7.2f\n", p.name, lib, sdk, sdk/lib)
	}
}
