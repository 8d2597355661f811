package pelican

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pelican-io/pelican/sdks/go/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// The tests run against a real redis-server of their own (REDIS_SERVER, else the one on PATH), emptied before
// each test; the idempotent-publish tests against IDMP_REDIS_SERVER (a Redis 8.6+ binary) when it is named.

const (
	testStream   = "{jobs}:files"
	testGroup    = "workers"
	testConsumer = "worker-1"
)

var (
	server     *redistest.Server
	idmpOnce   sync.Once
	idmpServer *redistest.Server
	idmpErr    error
)

func TestMain(m *testing.M) {
	binary, err := redistest.Binary()
	if err == nil {
		server, err = redistest.Start(binary)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	server.Stop()
	if idmpServer != nil {
		idmpServer.Stop()
	}
	if cluster != nil {
		cluster.Stop()
	}
	os.Exit(code)
}

// newClient is a client of the test server, emptied first.
func newClient(t *testing.T) *redis.Client {
	t.Helper()
	return emptied(t, server.Addr)
}

func emptied(t *testing.T, addr string) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { c.Close() })
	if err := c.FlushAll(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	return c
}

// idmpClient is a client of a server with XADD ... IDMP, emptied first: skipped, saying why, when
// IDMP_REDIS_SERVER names none, unless IDMP_REQUIRED=1.
func idmpClient(t *testing.T) *redis.Client {
	t.Helper()
	binary := os.Getenv("IDMP_REDIS_SERVER")
	if binary == "" {
		if os.Getenv("IDMP_REQUIRED") == "1" {
			t.Fatal("IDMP_REQUIRED=1 but no IDMP_REDIS_SERVER (a Redis 8.6+ redis-server) is named")
		}
		t.Skip("no IDMP_REDIS_SERVER (a Redis 8.6+ redis-server): idempotent publishes are not tested")
	}
	idmpOnce.Do(func() { idmpServer, idmpErr = redistest.Start(binary) })
	if idmpErr != nil {
		t.Fatal(idmpErr)
	}
	return emptied(t, idmpServer.Addr)
}

func createGroup(t *testing.T, c *redis.Client) {
	t.Helper()
	if err := c.XGroupCreateMkStream(context.Background(), testStream, testGroup, "0").Err(); err != nil {
		t.Fatal(err)
	}
}

func add(t *testing.T, c *redis.Client, values ...string) string {
	t.Helper()
	id, err := c.XAdd(context.Background(), &redis.XAddArgs{Stream: testStream, Values: values}).Result()
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func writeSettings(t *testing.T, c *redis.Client, minIdleMs, retryAfterMs int, extra ...string) {
	t.Helper()
	fields := append([]string{"minIdleMs", fmt.Sprint(minIdleMs), "retryAfterMs", fmt.Sprint(retryAfterMs),
		"maxDeliveries", "5"}, extra...)
	if err := c.HSet(context.Background(), SettingsKey(testStream, testGroup), fields).Err(); err != nil {
		t.Fatal(err)
	}
}

func pending(t *testing.T, c *redis.Client) []redis.XPendingExt {
	t.Helper()
	p, err := c.XPendingExt(context.Background(), &redis.XPendingExtArgs{
		Stream: testStream, Group: testGroup, Start: "-", End: "+", Count: 1000,
	}).Result()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func consumers(t *testing.T, c *redis.Client) []string {
	t.Helper()
	infos, err := c.XInfoConsumers(context.Background(), testStream, testGroup).Result()
	if err != nil {
		t.Fatal(err)
	}
	names := make([]string, len(infos))
	for i, info := range infos {
		names[i] = info.Name
	}
	return names
}

func eventually(t *testing.T, within time.Duration, what string, check func() bool) {
	t.Helper()
	for deadline := time.Now().Add(within); !check(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// logBuffer collects a worker's log lines; a failed test shows them.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) count(s string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.Count(b.buf.String(), s)
}

func testLogger(t *testing.T) (*slog.Logger, *logBuffer) {
	logs := &logBuffer{}
	t.Cleanup(func() {
		if t.Failed() {
			logs.mu.Lock()
			t.Log("worker log:\n" + logs.buf.String())
			logs.mu.Unlock()
		}
	})
	return slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})), logs
}

// newWorker is a worker of testStream as testConsumer on its own client, logging into logs.
func newWorker(t *testing.T, opt WorkerOptions) (*Worker, *logBuffer) {
	t.Helper()
	opt.Stream, opt.Group = testStream, testGroup
	if opt.Consumer == "" {
		opt.Consumer = testConsumer
	}
	var logs *logBuffer
	if opt.Logger == nil {
		opt.Logger, logs = testLogger(t)
	}
	client := redis.NewClient(&redis.Options{Addr: server.Addr})
	t.Cleanup(func() { client.Close() })
	w, err := NewWorker(client, opt)
	if err != nil {
		t.Fatal(err)
	}
	return w, logs
}

// running is a worker's Run in the background.
type running struct {
	cancel context.CancelFunc
	done   chan struct{}
	stats  Stats
	err    error
}

func start(t *testing.T, w *Worker, handler Handler) *running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		r.stats, r.err = w.Run(ctx, handler)
	}()
	t.Cleanup(func() { r.stop(t) })
	return r
}

// stop cancels Run's context (as SIGTERM does) and waits for the shutdown.
func (r *running) stop(t *testing.T) (Stats, error) {
	t.Helper()
	r.cancel()
	select {
	case <-r.done:
	case <-time.After(30 * time.Second):
		t.Fatal("the worker did not stop within 30 s")
	}
	return r.stats, r.err
}
