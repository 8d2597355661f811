package pelican

import (
	"bytes"
	"context"
	"errors"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"
)

// The worker against a real server: what it leaves in Redis for each outcome, lease, hand-over and shutdown.

var bg = context.Background()

// seen collects the ids a handler was given.
type seen struct {
	mu  sync.Mutex
	ids []string
}

func (s *seen) add(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ids = append(s.ids, id)
}

func (s *seen) list() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.ids...)
}

func done(s *seen) Handler {
	return func(_ context.Context, m Message) (Outcome, error) {
		s.add(m.ID)
		return Done(), nil
	}
}

func equal(a, b []string) bool { return strings.Join(a, ",") == strings.Join(b, ",") }

func TestDoneAcknowledgesAndReadsTheOwnPELFirst(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	before := []string{add(t, c, "n", "0"), add(t, c, "n", "1")}
	// Delivered to this consumer before a "restart": in its PEL.
	c.XReadGroup(bg, &redis.XReadGroupArgs{Group: testGroup, Consumer: testConsumer, Streams: []string{testStream, ">"}})
	after := []string{add(t, c, "n", "2"), add(t, c, "n", "3")}
	var s seen
	w, _ := newWorker(t, WorkerOptions{Concurrency: 1})
	r := start(t, w, done(&s))
	eventually(t, 5*time.Second, "4 messages acknowledged", func() bool { return len(pending(t, c)) == 0 && len(s.list()) == 4 })
	stats, err := r.stop(t)
	if err != nil || !equal(s.list(), append(before, after...)) {
		t.Fatalf("seen %v, want %v (%v)", s.list(), append(before, after...), err)
	}
	if stats.Done != 4 || stats.InFlight != 0 {
		t.Fatalf("stats %+v", stats)
	}
	if n := c.Exists(bg, ErrorsKey(testStream, testGroup)).Val(); n != 0 {
		t.Fatal("an errors hash was written")
	}
}

func TestAnEntryWhosePayloadWasDeletedIsNotHandled(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	gone := add(t, c, "n", "gone")
	kept := add(t, c, "n", "kept")
	c.XReadGroup(bg, &redis.XReadGroupArgs{Group: testGroup, Consumer: testConsumer, Streams: []string{testStream, ">"}})
	c.XDel(bg, testStream, gone)
	var s seen
	w, _ := newWorker(t, WorkerOptions{})
	r := start(t, w, done(&s))
	eventually(t, 5*time.Second, "the kept entry handled", func() bool { return equal(s.list(), []string{kept}) })
	time.Sleep(200 * time.Millisecond)
	r.stop(t)
	// Left for the operator's pass, which drops it.
	if p := pending(t, c); len(p) != 1 || p[0].ID != gone || !equal(s.list(), []string{kept}) {
		t.Fatalf("pending %v, seen %v", p, s.list())
	}
}

func TestFieldsArePassedInOrderWithRepeatedNamesOnRESP2AndRESP3(t *testing.T) {
	for _, protocol := range []int{2, 3} {
		c := newClient(t)
		createGroup(t, c)
		id := add(t, c, "job", "\xff\x00", "a", "1", "a", "2", OriginIDField, "1-1", DeliveriesField, "2")
		got := make(chan Message, 1)
		logger, _ := testLogger(t)
		client := redis.NewClient(&redis.Options{Addr: server.Addr, Protocol: protocol})
		t.Cleanup(func() { client.Close() })
		w, err := NewWorker(client, WorkerOptions{Stream: testStream, Group: testGroup, Consumer: testConsumer,
			Logger: logger})
		if err != nil {
			t.Fatal(err)
		}
		r := start(t, w, func(_ context.Context, m Message) (Outcome, error) {
			got <- m
			return Done(), nil
		})
		m := <-got
		r.stop(t)
		want := []Field{{"job", "\xff\x00"}, {"a", "1"}, {"a", "2"}, {OriginIDField, "1-1"}, {DeliveriesField, "2"}}
		if m.ID != id || !slices.Equal(m.Fields, want) {
			t.Fatalf("RESP%d: %q, want %q", protocol, m.Fields, want)
		}
		// The first value of a name, as the other libraries answer it.
		if v, ok := m.Lookup("a"); v != "1" || !ok || m.Get("b") != "" {
			t.Fatalf("RESP%d: Lookup(a) = %q, %v; Get(b) = %q", protocol, v, ok, m.Get("b"))
		}
		if _, ok := m.Lookup("b"); ok {
			t.Fatalf("RESP%d: Lookup(b) found one", protocol)
		}
	}
}

func TestAFailureRecordsTheErrorCutAtACharacterAndIsNotReadAgain(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	writeSettings(t, c, 300, 60_000) // a lease tick, and a look for hand-overs, every 100 ms
	entry := add(t, c, "n", "1")
	var runs atomic.Int32
	w, _ := newWorker(t, WorkerOptions{Block: 50 * time.Millisecond})
	r := start(t, w, func(context.Context, Message) (Outcome, error) {
		runs.Add(1)
		return Outcome{}, errors.New(strings.Repeat("€", 2000))
	})
	eventually(t, 5*time.Second, "the error recorded", func() bool {
		return c.HExists(bg, ErrorsKey(testStream, testGroup), entry).Val()
	})
	// Several lease ticks' hand-over looks: an entry that failed here is left to the operator's retry.
	time.Sleep(800 * time.Millisecond)
	stats, _ := r.stop(t)
	if runs.Load() != 1 || stats.Failed != 1 {
		t.Fatalf("runs %d, stats %+v", runs.Load(), stats)
	}
	text := c.HGet(bg, ErrorsKey(testStream, testGroup), entry).Val()
	if !utf8.ValidString(text) || len(text) != 1023 || !strings.HasPrefix(text, "€€") { // 341 characters of 3 bytes
		t.Fatalf("%d bytes, valid %v", len(text), utf8.ValidString(text))
	}
	p := pending(t, c)
	if len(p) != 1 || p[0].ID != entry || p[0].Consumer != testConsumer || p[0].RetryCount != 1 {
		t.Fatalf("pending %+v", p)
	}
	if names := consumers(t, c); !equal(names, []string{testConsumer}) { // it still owns the failed entry: kept
		t.Fatalf("consumers %v", names)
	}
}

func TestAPanicIsAFailureAndTheWorkerGoesOn(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	var panicked []string
	for range 5 {
		panicked = append(panicked, add(t, c, "panic", "yes"))
	}
	ordinary := []string{add(t, c, "n", "1"), add(t, c, "n", "2"), add(t, c, "n", "3")}
	var s seen
	w, logs := newWorker(t, WorkerOptions{Concurrency: 2})
	r := start(t, w, func(_ context.Context, m Message) (Outcome, error) {
		if _, ok := m.Lookup("panic"); ok {
			panic("boom")
		}
		s.add(m.ID)
		return Done(), nil
	})
	eventually(t, 5*time.Second, "the ordinary messages handled after 5 panics", func() bool {
		return len(s.list()) == 3 && c.HLen(bg, ErrorsKey(testStream, testGroup)).Val() == 5
	})
	stats, _ := r.stop(t)
	if got := slices.Sorted(slices.Values(s.list())); !equal(got, ordinary) || stats.Failed != 5 || stats.Done != 3 {
		t.Fatalf("handled %v, stats %+v", got, stats)
	}
	var left []string
	for _, p := range pending(t, c) {
		left = append(left, p.ID)
	}
	if !equal(left, panicked) {
		t.Fatalf("pending %v, want %v", left, panicked)
	}
	for _, id := range panicked {
		if text := c.HGet(bg, ErrorsKey(testStream, testGroup), id).Val(); text != "panic: boom" {
			t.Fatalf("%s: %q", id, text)
		}
	}
	// One WARN line per failure, with the id and the error, never a stack trace.
	if n := logs.count("level=WARN msg=\"handler failed"); n != 5 || logs.count("goroutine") != 0 {
		t.Fatalf("%d failure lines, stack traces %d", n, logs.count("goroutine"))
	}
}

func TestAFailedMessageHandedBackIsHandledAndItsErrorRemovedWithTheAck(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	writeSettings(t, c, 300, 60_000) // a lease tick every 100 ms
	entry := add(t, c, "n", "1")
	var runs atomic.Int32
	w, _ := newWorker(t, WorkerOptions{})
	r := start(t, w, func(context.Context, Message) (Outcome, error) {
		if runs.Add(1) == 1 {
			return Outcome{}, errors.New("first delivery fails")
		}
		return Done(), nil
	})
	eventually(t, 5*time.Second, "the error recorded", func() bool {
		return c.HExists(bg, ErrorsKey(testStream, testGroup), entry).Val()
	})
	// What strategy: Reassign does once the entry was idle: it hands it over (here, back) with XCLAIM.
	time.Sleep(1200 * time.Millisecond)
	c.XClaim(bg, &redis.XClaimArgs{Stream: testStream, Group: testGroup, Consumer: testConsumer, Messages: []string{entry}})
	eventually(t, 5*time.Second, "the handed-back entry acknowledged", func() bool { return len(pending(t, c)) == 0 })
	stats, _ := r.stop(t)
	if c.HExists(bg, ErrorsKey(testStream, testGroup), entry).Val() || stats.Failed != 1 || stats.Done != 1 {
		t.Fatalf("stats %+v", stats)
	}
}

func TestDoneOnARequeuedCopyRemovesItsLastError(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	copied := add(t, c, "n", "1", OriginIDField, "1-1", DeliveriesField, "2")
	c.HSet(bg, ErrorsKey(testStream, testGroup), copied, "before", "9-9", "someone else's")
	w, _ := newWorker(t, WorkerOptions{})
	r := start(t, w, done(&seen{}))
	eventually(t, 5*time.Second, "the copy acknowledged", func() bool { return w.Stats().Done == 1 })
	r.stop(t)
	if errs := c.HGetAll(bg, ErrorsKey(testStream, testGroup)).Val(); len(errs) != 1 || errs["9-9"] != "someone else's" {
		t.Fatalf("errors %v", errs)
	}
}

func TestTerminalAcknowledgesAndCountsTheReasonOnce(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	first := add(t, c, "n", "1")
	add(t, c, "n", "2")
	c.HSet(bg, ErrorsKey(testStream, testGroup), first, "earlier")
	w, _ := newWorker(t, WorkerOptions{})
	r := start(t, w, func(context.Context, Message) (Outcome, error) { return Terminal("RecordNotFound"), nil })
	eventually(t, 5*time.Second, "2 terminal", func() bool { return w.Stats().Terminal == 2 })
	r.stop(t)
	counts := c.HGetAll(bg, TerminalKey(testStream, testGroup)).Val()
	if len(pending(t, c)) != 0 || len(counts) != 1 || counts["RecordNotFound"] != "2" {
		t.Fatalf("counts %v, pending %v", counts, pending(t, c))
	}
	if c.HExists(bg, ErrorsKey(testStream, testGroup), first).Val() {
		t.Fatal("the last error was not removed")
	}
}

func TestAnInvalidReasonIsAFailureNeverAnAck(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	entry := add(t, c, "n", "1")
	w, _ := newWorker(t, WorkerOptions{})
	r := start(t, w, func(context.Context, Message) (Outcome, error) { return Terminal("record not found"), nil })
	eventually(t, 5*time.Second, "the error recorded", func() bool {
		return c.HExists(bg, ErrorsKey(testStream, testGroup), entry).Val()
	})
	stats, _ := r.stop(t)
	text := c.HGet(bg, ErrorsKey(testStream, testGroup), entry).Val()
	if !strings.Contains(text, "^[A-Z][A-Za-z0-9]{0,62}$") || c.Exists(bg, TerminalKey(testStream, testGroup)).Val() != 0 {
		t.Fatalf("error %q", text)
	}
	if p := pending(t, c); len(p) != 1 || stats.Failed != 1 || stats.Terminal != 0 {
		t.Fatalf("pending %v, stats %+v", p, stats)
	}
}

func TestTheZeroOutcomeFailsTheMessage(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	entry := add(t, c, "n", "1")
	w, _ := newWorker(t, WorkerOptions{})
	start(t, w, func(context.Context, Message) (Outcome, error) { return Outcome{}, nil })
	eventually(t, 5*time.Second, "the error recorded", func() bool {
		return strings.HasPrefix(c.HGet(bg, ErrorsKey(testStream, testGroup), entry).Val(), "the handler returned the zero Outcome")
	})
}

func TestRetryGivesBackCountedWithAnIdleOfMinIdle(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	writeSettings(t, c, 7000, 50_000)
	entry := add(t, c, "n", "1")
	w, _ := newWorker(t, WorkerOptions{})
	r := start(t, w, func(context.Context, Message) (Outcome, error) { return Retry(), nil })
	eventually(t, 5*time.Second, "the retry", func() bool { return w.Stats().Retried == 1 })
	r.stop(t)
	// Still this consumer's, the delivery counted (1: the read), idle set to minIdle for the pass's backoff.
	p := pending(t, c)
	if len(p) != 1 || p[0].ID != entry || p[0].Consumer != testConsumer || p[0].RetryCount != 1 ||
		p[0].Idle < 7*time.Second || p[0].Idle >= 9*time.Second {
		t.Fatalf("pending %+v", p)
	}
}

// maxIdleWhile is the highest idle time of the PEL's entries, sampled every 50 ms for d.
func maxIdleWhile(t *testing.T, c *redis.Client, d time.Duration) time.Duration {
	var highest time.Duration
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		for _, p := range pending(t, c) {
			highest = max(highest, p.Idle)
		}
	}
	return highest
}

// slow is a handler that takes d (or less when its context ends), telling when it started.
func slow(d time.Duration, started chan<- string) Handler {
	return func(ctx context.Context, m Message) (Outcome, error) {
		started <- m.ID
		select {
		case <-time.After(d):
			return Done(), nil
		case <-ctx.Done():
			return Outcome{}, ctx.Err()
		}
	}
}

func TestTheLeaseKeepsASlowHandlersEntryFromGoingIdle(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	writeSettings(t, c, 600, 60_000) // a lease every 200 ms
	add(t, c, "n", "1")
	started := make(chan string, 1)
	// A read blocking 2 s is in flight all along: the leases never wait behind it.
	w, _ := newWorker(t, WorkerOptions{Block: 2 * time.Second})
	r := start(t, w, slow(2*time.Second, started)) // over 3 x minIdle
	<-started
	highest := maxIdleWhile(t, c, 1800*time.Millisecond)
	p := pending(t, c)
	eventually(t, 5*time.Second, "the ACK", func() bool { return len(pending(t, c)) == 0 })
	stats, _ := r.stop(t)
	if highest >= 600*time.Millisecond || len(p) != 1 || p[0].RetryCount != 1 || stats.Done != 1 {
		t.Fatalf("highest idle %v, pending %+v, stats %+v", highest, p, stats) // a lease leaves the count alone
	}
}

func TestSettingsAreReReadAtEveryLeaseTick(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	writeSettings(t, c, 3000, 60_000) // a lease every second
	add(t, c, "n", "1")
	started := make(chan string, 1)
	w, _ := newWorker(t, WorkerOptions{})
	start(t, w, slow(3*time.Second, started))
	<-started
	writeSettings(t, c, 300, 60_000) // a lease every 100 ms from the next tick on
	time.Sleep(1200 * time.Millisecond)
	highest := maxIdleWhile(t, c, 1500*time.Millisecond)
	if s := w.Settings(); s == nil || s.MinIdle != 300*time.Millisecond || highest >= 300*time.Millisecond {
		t.Fatalf("settings %+v, highest idle %v", s, highest)
	}
}

func TestPastMaxHandlingTheLeaseIsNoLongerExtended(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	writeSettings(t, c, 300, 60_000)
	add(t, c, "n", "1")
	started := make(chan string, 1)
	w, logs := newWorker(t, WorkerOptions{MaxHandling: 400 * time.Millisecond})
	start(t, w, slow(1600*time.Millisecond, started))
	<-started
	time.Sleep(1300 * time.Millisecond)
	if p := pending(t, c); len(p) != 1 || p[0].Idle < 700*time.Millisecond || logs.count("after MaxHandling") != 1 {
		t.Fatalf("pending %+v, warned %d times", p, logs.count("after MaxHandling"))
	}
}

func TestShutdownGivesBackUnownedWithTheDeliveryUncounted(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	writeSettings(t, c, 60_000, 4321)
	entry := add(t, c, "n", "1")
	started := make(chan string, 1)
	cancelled := make(chan struct{})
	w, logs := newWorker(t, WorkerOptions{ShutdownGrace: 300 * time.Millisecond})
	r := start(t, w, func(ctx context.Context, m Message) (Outcome, error) {
		started <- m.ID
		<-ctx.Done() // cancelled when the grace ran out
		close(cancelled)
		return Outcome{}, ctx.Err()
	})
	<-started
	if p := pending(t, c); len(p) != 1 || p[0].Consumer != testConsumer || p[0].RetryCount != 1 {
		t.Fatalf("pending %+v", p)
	}
	stats, err := r.stop(t)
	<-cancelled
	p := pending(t, c)
	if err != nil || len(p) != 1 || p[0].ID != entry || p[0].Consumer != "" || p[0].RetryCount != 0 ||
		p[0].Idle < 4321*time.Millisecond || p[0].Idle >= 6*time.Second {
		t.Fatalf("pending %+v (%v)", p, err)
	}
	if stats.Abandoned != 1 || stats.Done != 0 || stats.Failed != 0 || stats.InFlight != 0 {
		t.Fatalf("stats %+v", stats)
	}
	if slices.Contains(consumers(t, c), testConsumer) { // it owns nothing any more: deleted
		t.Fatal("the consumer was not deleted")
	}
	if c.Exists(bg, ErrorsKey(testStream, testGroup)).Val() != 0 {
		t.Fatal("a message given back was recorded as failed")
	}
	// One INFO line with the count.
	if n := logs.count(`level=INFO msg="shutdown: messages given back`); n != 1 || logs.count("given=1") != 1 {
		t.Fatalf("%d shutdown lines", n)
	}
}

func TestAReadInFlightAtTheStopGivesBackWhatItBroughtUnhandled(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	writeSettings(t, c, 60_000, 4321)
	var s seen
	w, _ := newWorker(t, WorkerOptions{Block: 3 * time.Second})
	r := start(t, w, done(&s))
	eventually(t, 5*time.Second, "the first read", func() bool { return len(consumers(t, c)) == 1 })
	time.Sleep(300 * time.Millisecond) // the blocking read is on its way
	r.cancel()
	time.Sleep(100 * time.Millisecond)
	// The read in flight is awaited: what it brings now is delivered to this consumer, and given back.
	entry := add(t, c, "n", "1")
	stats, _ := r.stop(t)
	p := pending(t, c)
	if len(s.list()) != 0 || len(p) != 1 || p[0].ID != entry || p[0].Consumer != "" || p[0].RetryCount != 0 {
		t.Fatalf("seen %v, pending %+v", s.list(), p)
	}
	if stats.Abandoned != 1 || slices.Contains(consumers(t, c), testConsumer) {
		t.Fatalf("stats %+v, consumers %q", stats, consumers(t, c))
	}
}

func TestShutdownLetsHandlersFinishWithinTheGrace(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	add(t, c, "n", "1")
	started := make(chan string, 1)
	w, _ := newWorker(t, WorkerOptions{ShutdownGrace: 5 * time.Second})
	r := start(t, w, slow(500*time.Millisecond, started))
	<-started
	stats, _ := r.stop(t)
	// Given back nothing, and the consumer deleted all the same.
	if stats.Done != 1 || stats.Abandoned != 0 || len(pending(t, c)) != 0 || len(consumers(t, c)) != 0 {
		t.Fatalf("stats %+v, consumers %v", stats, consumers(t, c))
	}
}

func TestAHandOverIsTakenUpAtTheNextLeaseTicksWithItsCountUnchanged(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	writeSettings(t, c, 3000, 60_000) // a lease tick every second
	entry := add(t, c, "n", "1")
	c.XReadGroup(bg, &redis.XReadGroupArgs{Group: testGroup, Consumer: "other", Streams: []string{testStream, ">"}})
	started := make(chan string, 1)
	// An idle worker: its blocking read (4 s) is not what finds the hand-over, nor does its age delay it.
	w, _ := newWorker(t, WorkerOptions{Block: 4 * time.Second})
	r := start(t, w, slow(300*time.Millisecond, started))
	eventually(t, 5*time.Second, "the blocking read", func() bool { return readBlocked(t, c) })
	// What strategy: Reassign does: XCLAIM to this worker's name, the delivery counted.
	if err := c.Do(bg, "XCLAIM", testStream, testGroup, testConsumer, 0, entry, "RETRYCOUNT", 2).Err(); err != nil {
		t.Fatal(err)
	}
	handedOver := time.Now()
	select {
	case id := <-started:
		if id != entry {
			t.Fatal(id)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("not taken up within 3 lease ticks")
	}
	took := time.Since(handedOver)
	p := pending(t, c)
	eventually(t, 5*time.Second, "the ACK", func() bool { return len(pending(t, c)) == 0 })
	stats, _ := r.stop(t)
	// Taken with lease.lua and XRANGE: not counted again.
	if len(p) != 1 || p[0].Consumer != testConsumer || p[0].RetryCount != 2 || stats.Done != 1 {
		t.Fatalf("pending %+v, stats %+v (taken up after %v)", p, stats, took)
	}
}

func TestAnEntryAReadDeliveredIsNoHandOverWhileItsReplyIsOnItsWay(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	writeSettings(t, c, 600, 60_000) // a lease tick every 200 ms
	proxy := newHeldRead(t, server.Addr, "held by the proxy")
	logger, _ := testLogger(t)
	client := redis.NewClient(&redis.Options{Addr: proxy.listener.Addr().String()})
	t.Cleanup(func() { client.Close() })
	w, err := NewWorker(client, WorkerOptions{Stream: testStream, Group: testGroup, Consumer: testConsumer,
		Block: time.Second, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	runs := &seen{}
	r := start(t, w, done(runs))
	entry := add(t, c, "n", "held by the proxy")
	eventually(t, 5*time.Second, "the read's delivery", func() bool { return len(pending(t, c)) == 1 })
	// In the worker's PEL, the reply that brings it held back: the lease ticks look at the PEL meanwhile.
	heartbeat := func() string { return c.HGet(bg, ConsumersKey(testStream, testGroup), testConsumer).Val() }
	for range 3 {
		before := heartbeat()
		eventually(t, 5*time.Second, "the next lease tick", func() bool { return heartbeat() != before })
	}
	reads := proxy.reads.Load()
	close(proxy.release)
	// The next read is sent once what the held one brought was handled.
	eventually(t, 5*time.Second, "the next read", func() bool { return proxy.reads.Load() > reads })
	stats, _ := r.stop(t)
	if ids := runs.list(); !slices.Equal(ids, []string{entry}) || stats.Done != 1 || len(pending(t, c)) != 0 {
		t.Fatalf("runs %v, stats %+v, pending %+v", ids, stats, pending(t, c))
	}
}

// heldRead is a loopback proxy to the server that holds back the reply of a read: on a connection whose client sent
// XREADGROUP, the first reply holding marker and all after it wait until release is closed. The server delivered
// what the read asked for; the client does not see it. reads counts the XREADGROUP requests.
type heldRead struct {
	listener net.Listener
	upstream string
	marker   []byte
	release  chan struct{}
	held     atomic.Bool
	reads    atomic.Int64
}

func newHeldRead(t *testing.T, upstream, marker string) *heldRead {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &heldRead{listener: listener, upstream: upstream, marker: []byte(marker), release: make(chan struct{})}
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

func (p *heldRead) serve(client net.Conn) {
	defer client.Close()
	server, err := net.Dial("tcp", p.upstream)
	if err != nil {
		return
	}
	defer server.Close()
	var reader atomic.Bool
	go func() {
		buf := make([]byte, 65536)
		for {
			n, err := client.Read(buf)
			if err != nil {
				server.Close()
				return
			}
			// go-redis writes each command whole: on loopback a command's name comes in one chunk.
			if sent := bytes.Count(bytes.ToUpper(buf[:n]), []byte("XREADGROUP")); sent > 0 {
				p.reads.Add(int64(sent))
				reader.Store(true)
			}
			if _, err := server.Write(buf[:n]); err != nil {
				return
			}
		}
	}()
	buf := make([]byte, 65536)
	for {
		n, err := server.Read(buf)
		if err != nil {
			return
		}
		if reader.Load() && bytes.Contains(buf[:n], p.marker) && p.held.CompareAndSwap(false, true) {
			<-p.release // what comes after waits in the socket meanwhile
		}
		if _, err := client.Write(buf[:n]); err != nil {
			return
		}
	}
}

// readBlocked tells whether a client waits in a blocking XREADGROUP (CLIENT LIST: flags b, cmd xreadgroup).
func readBlocked(t *testing.T, c *redis.Client) bool {
	t.Helper()
	list, err := c.ClientList(bg).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(list, "\n") {
		fields := strings.Fields(line)
		if slices.Contains(fields, "flags=b") && slices.Contains(fields, "cmd=xreadgroup") {
			return true
		}
	}
	return false
}

func TestTheHeartbeatIsWrittenAtEveryLeaseTickWhileIdle(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	writeSettings(t, c, 300, 60_000) // a lease tick every 100 ms
	w, _ := newWorker(t, WorkerOptions{})
	start(t, w, done(&seen{}))
	heartbeat := func() int64 {
		v, _ := c.HGet(bg, ConsumersKey(testStream, testGroup), testConsumer).Int64()
		return v
	}
	eventually(t, 5*time.Second, "the first heartbeat", func() bool { return heartbeat() > 0 })
	first := heartbeat()
	eventually(t, 5*time.Second, "the heartbeat advancing", func() bool { return heartbeat() > first })
	now, err := c.Time(bg).Result()
	if err != nil || now.Sub(time.UnixMilli(first)).Abs() > 5*time.Second {
		t.Fatalf("not the server's time in ms: %d (server %v, %v)", first, now, err)
	}
	if p := pending(t, c); len(p) != 0 { // nothing to lease: the heartbeat alone
		t.Fatalf("pending %+v", p)
	}
}

func TestNOGROUPIsWaitedOutAndTheGroupNeverCreated(t *testing.T) {
	c := newClient(t)
	var s seen
	w, logs := newWorker(t, WorkerOptions{Concurrency: 1}) // in order
	r := start(t, w, done(&s))
	time.Sleep(1500 * time.Millisecond)
	if c.Exists(bg, testStream).Val() != 0 {
		t.Fatal("the stream was created")
	}
	add(t, c, "n", "0")
	time.Sleep(500 * time.Millisecond)
	if groups := c.XInfoGroups(bg, testStream).Val(); len(groups) != 0 {
		t.Fatalf("groups %v", groups)
	}
	c.XGroupCreate(bg, testStream, testGroup, "0")
	entry := add(t, c, "n", "1")
	eventually(t, 12*time.Second, "both entries handled", func() bool { return len(s.list()) == 2 })
	r.stop(t)
	if s.list()[1] != entry || logs.count("does not exist yet") != 1 { // said once, though reads failed several times
		t.Fatalf("seen %v, said %d times", s.list(), logs.count("does not exist yet"))
	}
}

func TestAnUnknownContractVersionRefusesToStart(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	writeSettings(t, c, 1000, 60_000, "contractVersion", "2")
	add(t, c, "n", "1")
	w, _ := newWorker(t, WorkerOptions{})
	_, err := w.Run(bg, func(context.Context, Message) (Outcome, error) {
		t.Error("no message may be read")
		return Done(), nil
	})
	var version *ContractVersionError
	if !errors.As(err, &version) || !strings.Contains(err.Error(), "worker contract 2") ||
		!strings.Contains(err.Error(), "knows 1") || !strings.Contains(err.Error(), "upgrade the library") {
		t.Fatalf("got %v", err)
	}
	// Nothing was read.
	if groups := c.XInfoGroups(bg, testStream).Val(); len(pending(t, c)) != 0 || groups[0].LastDeliveredID != "0-0" {
		t.Fatalf("groups %+v", groups)
	}
}

func TestAContractVersionMetWhileRunningShutsDownGracefully(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	writeSettings(t, c, 300, 60_000)
	w, _ := newWorker(t, WorkerOptions{})
	r := start(t, w, done(&seen{}))
	eventually(t, 5*time.Second, "the first read", func() bool { return len(consumers(t, c)) == 1 })
	writeSettings(t, c, 300, 60_000, "contractVersion", "2")
	select {
	case <-r.done:
	case <-time.After(5 * time.Second):
		t.Fatal("the worker did not stop")
	}
	var version *ContractVersionError
	if !errors.As(r.err, &version) || version.Operator != "2" || len(consumers(t, c)) != 0 {
		t.Fatalf("got %v, consumers %v", r.err, consumers(t, c))
	}
}

func TestConcurrencyBoundsTheHandlersRunning(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	for range 8 {
		add(t, c, "n", "1")
	}
	var now, highest atomic.Int32
	w, _ := newWorker(t, WorkerOptions{Concurrency: 3})
	r := start(t, w, func(context.Context, Message) (Outcome, error) {
		n := now.Add(1)
		for h := highest.Load(); n > h && !highest.CompareAndSwap(h, n); h = highest.Load() {
		}
		time.Sleep(100 * time.Millisecond)
		now.Add(-1)
		return Done(), nil
	})
	eventually(t, 5*time.Second, "8 done", func() bool { return w.Stats().Done == 8 })
	r.stop(t)
	if highest.Load() != 3 {
		t.Fatalf("highest %d", highest.Load())
	}
}

func TestABlockThatRoundsTo0OrReachesTheReadTimeoutIsRefused(t *testing.T) {
	for _, c := range []struct {
		readTimeout, block time.Duration
		refused            bool
	}{
		{0, 500 * time.Microsecond, true}, // BLOCK 0
		{0, -time.Second, true},
		{0, 5 * time.Second, true},               // go-redis' default ReadTimeout: 5 s
		{2 * time.Second, 2 * time.Second, true}, // at the timeout
		{2 * time.Second, 1999 * time.Millisecond, false},
		{-1, time.Minute, false}, // no timeout
		{0, 0, false},            // the default, 1 s
	} {
		client := redis.NewClient(&redis.Options{Addr: server.Addr, ReadTimeout: c.readTimeout})
		_, err := NewWorker(client, WorkerOptions{Stream: testStream, Group: testGroup, Consumer: testConsumer,
			Block: c.block})
		client.Close()
		if refused := err != nil && strings.Contains(err.Error(), "WorkerOptions.Block"); refused != c.refused {
			t.Errorf("Block %v, ReadTimeout %v: got %v", c.block, c.readTimeout, err)
		}
	}
}

func TestAPoolOfOneIsRefused(t *testing.T) {
	client := redis.NewClient(&redis.Options{Addr: server.Addr, PoolSize: 1})
	defer client.Close()
	if _, err := NewWorker(client, WorkerOptions{Stream: testStream, Group: testGroup}); err == nil ||
		!strings.Contains(err.Error(), "PoolSize is 1") {
		t.Fatalf("got %v", err)
	}
}

// countingHook counts the XACK commands a client sends, alone or in a pipeline.
type countingHook struct{ xacks atomic.Int32 }

func (h *countingHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *countingHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.count(cmd)
		return next(ctx, cmd)
	}
}

func (h *countingHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			h.count(cmd)
		}
		return next(ctx, cmds)
	}
}

func (h *countingHook) count(cmd redis.Cmder) {
	if cmd.Name() == "xack" {
		h.xacks.Add(1)
	}
}

func TestAcksOfHandlersThatReturnTogetherShareOneRoundTrip(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	for range 32 {
		add(t, c, "n", "1")
	}
	client := redis.NewClient(&redis.Options{Addr: server.Addr})
	defer client.Close()
	hook := &countingHook{}
	client.AddHook(hook)
	logger, _ := testLogger(t)
	w, err := NewWorker(client, WorkerOptions{Stream: testStream, Group: testGroup, Consumer: testConsumer,
		Concurrency: 16, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	var started atomic.Int32
	r := start(t, w, func(context.Context, Message) (Outcome, error) {
		started.Add(1)
		<-release // the handlers of a read return together
		return Done(), nil
	})
	eventually(t, 5*time.Second, "16 handlers", func() bool { return started.Load() == 16 })
	close(release)
	eventually(t, 5*time.Second, "32 done", func() bool { return w.Stats().Done == 32 })
	r.stop(t)
	if n := hook.xacks.Load(); n > 8 || len(pending(t, c)) != 0 { // 32 without batching
		t.Fatalf("%d XACK commands for 32 messages", n)
	}
}

func TestAnAckNeverWaitsForTheBlockingRead(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	add(t, c, "n", "1")
	started := make(chan string, 1)
	w, _ := newWorker(t, WorkerOptions{Block: 2 * time.Second})
	r := start(t, w, slow(300*time.Millisecond, started))
	<-started
	// The handler returns while a read blocks for 2 s: its ACK goes at once, on a connection of its own.
	began := time.Now()
	eventually(t, 2*time.Second, "the ACK", func() bool { return len(pending(t, c)) == 0 })
	if took := time.Since(began); took > 700*time.Millisecond {
		t.Fatalf("acknowledged after %v", took)
	}
	r.stop(t)
}

// Short handlers keep every path busy at once: ACKs carried by reads, flushes, the bound on ACKs being written.
func TestManyShortMessagesAreAllAcknowledged(t *testing.T) {
	for _, concurrency := range []int{1, 16} {
		c := newClient(t)
		createGroup(t, c)
		pipe := c.Pipeline()
		for range 5000 {
			pipe.XAdd(bg, &redis.XAddArgs{Stream: testStream, Values: []string{"n", "1"}})
		}
		if _, err := pipe.Exec(bg); err != nil {
			t.Fatal(err)
		}
		w, _ := newWorker(t, WorkerOptions{Concurrency: concurrency})
		r := start(t, w, done(&seen{}))
		eventually(t, 20*time.Second, "5000 done", func() bool { return w.Stats().Done == 5000 })
		stats, _ := r.stop(t)
		if p := pending(t, c); len(p) != 0 || stats.Failed != 0 || stats.InFlight != 0 {
			t.Fatalf("concurrency %d: pending %d, stats %+v", concurrency, len(p), stats)
		}
	}
}

// The read loop waits for a free slot, and the outcomes being written fill the bound: an ACK left for its next read
// would never be written. It is flushed.
func TestAnAckIsNotLeftForAReadThatCannotCome(t *testing.T) {
	c := newClient(t)
	createGroup(t, c)
	ids := []string{add(t, c, "n", "1"), add(t, c, "n", "2")}
	c.XReadGroup(bg, &redis.XReadGroupArgs{Group: testGroup, Consumer: testConsumer, Streams: []string{testStream, ">"}})
	w, _ := newWorker(t, WorkerOptions{Concurrency: 1})
	// The first one's outcome is being written elsewhere; the second one's handler just returned.
	flights := []*flight{{id: ids[0], settled: true}, {id: ids[1], settled: true}}
	w.inFlight = map[string]*flight{ids[0]: flights[0], ids[1]: flights[1]}
	w.settling, w.wakeAt, w.readerWaiting = 2, 1, true
	w.ack(bg, Message{ID: ids[1], Fields: []Field{{"n", "2"}}}, flights[1])
	if p := pending(t, c); len(p) != 1 || p[0].ID != ids[0] || w.Stats().Done != 1 {
		t.Fatalf("pending %v, stats %+v", p, w.Stats())
	}
	select {
	case <-w.freed: // a slot is free now: the read loop is woken
	default:
		t.Fatal("the read loop was not woken")
	}
}
