package metrics

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	pelican "github.com/pelican-io/pelican/sdks/go"
	"github.com/pelican-io/pelican/sdks/go/internal/redistest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
)

const stream, group = "{jobs}:files", "workers"

func TestAScrapeShowsTheStatsUnderTheSharedSchema(t *testing.T) {
	binary, err := redistest.Binary()
	if err != nil {
		t.Fatal(err)
	}
	server, err := redistest.Start(binary)
	if err != nil {
		t.Fatal(err)
	}
	defer server.Stop()
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: server.Addr})
	defer c.Close()
	if err := c.XGroupCreateMkStream(ctx, stream, group, "0").Err(); err != nil {
		t.Fatal(err)
	}
	for _, handle := range []string{"done", "done", "fail", "terminal", "retry"} {
		c.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []string{"handle", handle}})
	}
	w, err := pelican.NewWorker(c, pelican.WorkerOptions{Stream: stream, Group: group, Consumer: "worker-1"})
	if err != nil {
		t.Fatal(err)
	}
	registry := prometheus.NewPedanticRegistry()
	registry.MustRegister(NewCollector(w))
	runCtx, stop := context.WithCancel(ctx)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		_, _ = w.Run(runCtx, func(_ context.Context, m pelican.Message) (pelican.Outcome, error) {
			switch m.Get("handle") {
			case "fail":
				return pelican.Outcome{}, errors.New("asked to")
			case "terminal":
				return pelican.Terminal("RecordNotFound"), nil
			case "retry":
				return pelican.Retry(), nil
			}
			return pelican.Done(), nil
		})
	}()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if s := w.Stats(); s.Done+s.Failed+s.Terminal+s.Retried == 5 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not all handled: %+v", w.Stats())
		}
	}
	stop()
	<-finished
	// The text format as a scrape shows it (labels sorted by name).
	expected := `
# HELP pelican_worker_in_flight Messages a Pelican worker is handling now.
# TYPE pelican_worker_in_flight gauge
pelican_worker_in_flight{group="workers",stream="{jobs}:files"} 0
# HELP pelican_worker_messages_total Handler runs of a Pelican worker by how they ended.
# TYPE pelican_worker_messages_total counter
pelican_worker_messages_total{group="workers",outcome="abandoned",stream="{jobs}:files"} 0
pelican_worker_messages_total{group="workers",outcome="done",stream="{jobs}:files"} 2
pelican_worker_messages_total{group="workers",outcome="failed",stream="{jobs}:files"} 1
pelican_worker_messages_total{group="workers",outcome="retried",stream="{jobs}:files"} 1
pelican_worker_messages_total{group="workers",outcome="terminal",stream="{jobs}:files"} 1
`
	if err := testutil.GatherAndCompare(registry, strings.NewReader(expected)); err != nil {
		t.Fatal(err)
	}
}
