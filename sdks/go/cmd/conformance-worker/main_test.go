package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	pelican "github.com/pelican-io/pelican/sdks/go"
	"github.com/pelican-io/pelican/sdks/go/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// The conformance worker as the suite runs it: a process configured by environment, against a real redis-server.
// The test binary runs as the worker when PELICAN_CONFORMANCE_WORKER is set.

var server *redistest.Server

func TestMain(m *testing.M) {
	if os.Getenv("PELICAN_CONFORMANCE_WORKER") == "1" {
		main()
		os.Exit(0)
	}
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
	os.Exit(code)
}

const stream, group = "go", "workers"

var bg = context.Background()

// worker starts the conformance worker, with env added to its environment; its lines come on the channel, closed at
// its exit.
func worker(t *testing.T, c *redis.Client, graceMs int, env ...string) (*exec.Cmd, <-chan run) {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "PELICAN_CONFORMANCE_WORKER=1", "REDIS_URL="+server.URL(), "STREAM="+stream,
		"GROUP="+group, "CONSUMER=w1", fmt.Sprintf("SHUTDOWN_GRACE_MS=%d", graceMs))
	cmd.Env = append(cmd.Env, env...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill() })
	runs := make(chan run, 100)
	go func() {
		defer close(runs)
		for lines := bufio.NewScanner(out); lines.Scan(); {
			var r run
			if err := json.Unmarshal(lines.Bytes(), &r); err != nil {
				t.Errorf("not a run line (%v): %s", err, lines.Text())
			}
			runs <- r
		}
	}()
	return cmd, runs
}

func setUp(t *testing.T) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: server.Addr})
	t.Cleanup(func() { c.Close() })
	c.FlushAll(bg)
	if err := c.XGroupCreateMkStream(bg, stream, group, "0").Err(); err != nil {
		t.Fatal(err)
	}
	return c
}

func add(t *testing.T, c *redis.Client, handle string, ms int) string {
	return c.XAdd(bg, &redis.XAddArgs{Stream: stream, Values: []any{"handle", handle, "ms", ms}}).Val()
}

func exitCode(t *testing.T, cmd *exec.Cmd) int {
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return exit.ExitCode()
		}
		if err != nil {
			t.Fatal(err)
		}
		return 0
	case <-time.After(30 * time.Second):
		t.Fatal("the worker did not exit within 30 s")
	}
	return -1
}

func TestTheHandlerObeysTheMessageAndSIGTERMGivesBack(t *testing.T) {
	c := setUp(t)
	want := map[string]string{
		add(t, c, "done", 10):                   "done",
		add(t, c, "retry", 0):                   "retry",
		add(t, c, "fail", 0):                    "fail",
		add(t, c, "terminal:RecordNotFound", 0): "terminal",
		add(t, c, "terminal:not camel", 0):      "fail",
	}
	slow := add(t, c, "done", 60_000)
	cmd, runs := worker(t, c, 200)
	got := map[string]string{}
	for len(got) < len(want) {
		select {
		case r := <-runs:
			if r.Consumer != "w1" {
				t.Errorf("consumer %q", r.Consumer)
			}
			got[r.ID] = r.Outcome
		case <-time.After(10 * time.Second):
			t.Fatalf("runs %v, want %v", got, want)
		}
	}
	cmd.Process.Signal(syscall.SIGTERM)
	if code := exitCode(t, cmd); code != 0 {
		t.Fatalf("exit status %d", code)
	}
	for r := range runs {
		got[r.ID] = r.Outcome // the slow one was given back unfinished: no line
	}
	for id, outcome := range want {
		if got[id] != outcome {
			t.Errorf("%s: %q, want %q", id, got[id], outcome)
		}
	}
	if len(got) != len(want) {
		t.Errorf("runs %v", got)
	}
	owners := map[string]string{}
	for _, p := range c.XPendingExt(bg, &redis.XPendingExtArgs{Stream: stream, Group: group, Start: "-", End: "+", Count: 10}).Val() {
		owners[p.ID] = fmt.Sprintf("%s/%d", p.Consumer, p.RetryCount)
	}
	// The retry and the failures stay pending for the pass; the slow one was given back without an owner, uncounted.
	if len(owners) != 4 || owners[slow] != "/0" {
		t.Errorf("pending %v", owners)
	}
	if counts := c.HGetAll(bg, pelican.TerminalKey(stream, group)).Val(); len(counts) != 1 || counts["RecordNotFound"] != "1" {
		t.Errorf("terminal counts %v", counts)
	}
	if n := c.HLen(bg, pelican.ErrorsKey(stream, group)).Val(); n != 2 {
		t.Errorf("%d errors recorded", n)
	}
}

func TestExitEndsTheProcessAtOnceWithStatus3(t *testing.T) {
	c := setUp(t)
	id := add(t, c, "exit", 0)
	cmd, runs := worker(t, c, 20_000)
	if code := exitCode(t, cmd); code != 3 {
		t.Fatalf("exit status %d", code)
	}
	if r := <-runs; r.ID != id || r.Outcome != "exit" {
		t.Fatalf("run %+v", r)
	}
}

func TestAnUnknownContractVersionMetWhileRunningExitsWithStatus4(t *testing.T) {
	c := setUp(t)
	cmd, runs := worker(t, c, 20_000)
	id := add(t, c, "done", 0)
	if r := <-runs; r.ID != id || r.Outcome != "done" {
		t.Fatalf("run %+v", r)
	}
	// No settings yet: the worker meets the version at a lease tick (every second).
	c.HSet(bg, pelican.SettingsKey(stream, group), "contractVersion", "2")
	if code := exitCode(t, cmd); code != 4 {
		t.Fatalf("exit status %d", code)
	}
}

// export is one request an OTLP/HTTP collector received.
type export struct {
	path, contentType string
	body              []byte
}

func TestWithAnOTLPEndpointTheRunsSpanIsExportedBeforeTheExitAfterSIGTERM(t *testing.T) {
	exports := make(chan export, 10)
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		exports <- export{r.URL.Path, r.Header.Get("Content-Type"), body}
	}))
	defer collector.Close()
	c := setUp(t)
	const traceID = "0af7651916cd43dd8448eb211c80319c"
	id := c.XAdd(bg, &redis.XAddArgs{Stream: stream,
		Values: []any{"handle", "done", "traceparent", "00-" + traceID + "-b7ad6b7169203331-01"}}).Val()
	// The batch processor's first export is 5 s away: only the flush at the exit can send the span in time.
	cmd, runs := worker(t, c, 200, "OTEL_EXPORTER_OTLP_ENDPOINT="+collector.URL, "OTEL_SERVICE_NAME=")
	select {
	case r := <-runs:
		if r.ID != id || r.Outcome != "done" {
			t.Fatalf("run %+v", r)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no run line")
	}
	cmd.Process.Signal(syscall.SIGTERM)
	if code := exitCode(t, cmd); code != 0 {
		t.Fatalf("exit status %d", code)
	}
	var got export
	select {
	case got = <-exports:
	default:
		t.Fatal("the worker exited without exporting its spans")
	}
	if got.path != "/v1/traces" || got.contentType != "application/x-protobuf" {
		t.Errorf("POST %s (%s)", got.path, got.contentType)
	}
	// The protobuf holds the trace id as its 16 bytes, the names as text.
	trace, _ := hex.DecodeString(traceID)
	for _, want := range [][]byte{trace, []byte("process " + stream), []byte("pelican-conformance-go")} {
		if !bytes.Contains(got.body, want) {
			t.Errorf("the export (%d bytes) lacks %q", len(got.body), want)
		}
	}
}
