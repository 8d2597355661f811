package pelican

import (
	"bytes"
	"errors"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"
)

// Producers against a real server: refused, failed, unavailable, no resend after a lost reply, idempotence.

// noRetries is a client that never resends, as a producer needs.
func noRetries(t *testing.T, addr string) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	t.Cleanup(func() { c.Close() })
	return c
}

func newProducer(t *testing.T, client redis.UniversalClient) *Producer {
	t.Helper()
	p, err := NewProducer(client, testStream)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestPublishAddsTheFieldsInOrder(t *testing.T) {
	c := newClient(t)
	p := newProducer(t, noRetries(t, server.Addr))
	id, err := p.Publish(bg, "job", "42", "path", "/in/a.txt", "job", "7")
	if err != nil {
		t.Fatal(err)
	}
	rows, err := c.Do(bg, "XRANGE", testStream, "-", "+").Slice()
	want := []any{[]any{id, []any{"job", "42", "path", "/in/a.txt", "job", "7"}}}
	if err != nil || !deepEqual(rows, want) {
		t.Fatalf("got %v, want %v (%v)", rows, want, err)
	}
	if _, err := p.Publish(bg, "odd"); err == nil {
		t.Fatal("an odd number of strings was published")
	}
}

func deepEqual(a, b any) bool {
	switch a := a.(type) {
	case []any:
		b, ok := b.([]any)
		if !ok || len(a) != len(b) {
			return false
		}
		for i := range a {
			if !deepEqual(a[i], b[i]) {
				return false
			}
		}
		return true
	}
	return a == b
}

func bounded(t *testing.T, c *redis.Client, maxLength, backlog int) {
	t.Helper()
	if err := c.XGroupCreateMkStream(bg, testStream, testGroup, "$").Err(); err != nil {
		t.Fatal(err)
	}
	c.HSet(bg, BoundsKey(testStream), testGroup, maxLength)
	for range backlog {
		add(t, c, "n", "1")
	}
}

func TestAFullBacklogRefusesAndWritesNothing(t *testing.T) {
	c := newClient(t)
	bounded(t, c, 2, 2)
	_, err := newProducer(t, noRetries(t, server.Addr)).Publish(bg, "n", "over")
	var refused *RefusedError
	if !errors.As(err, &refused) || *refused != (RefusedError{Group: testGroup, Backlog: 2, Max: 2}) {
		t.Fatalf("got %v", err)
	}
	if n := c.XLen(bg, testStream).Val(); n != 2 {
		t.Fatalf("%d entries", n)
	}
	if counts := c.HGetAll(bg, RejectedKey(testStream)).Val(); counts[testGroup] != "1" {
		t.Fatalf("rejected %v", counts)
	}
}

func TestABatchWritesWhatTheBoundHasRoomFor(t *testing.T) {
	c := newClient(t)
	bounded(t, c, 3, 1)
	published, err := newProducer(t, noRetries(t, server.Addr)).PublishBatch(bg, [][]string{
		{"n", "0"}, {"n", "1"}, {"n", "2"}, {"n", "3"},
	})
	if err != nil || len(published.IDs) != 2 || published.Refused == nil ||
		*published.Refused != (RefusedError{Group: testGroup, Backlog: 1, Max: 3}) {
		t.Fatalf("got %+v, %v", published, err)
	}
	var ns []string
	for _, e := range c.XRange(bg, testStream, "-", "+").Val() {
		ns = append(ns, e.Values["n"].(string))
	}
	if !equal(ns, []string{"1", "0", "1"}) || c.HGet(bg, RejectedKey(testStream), testGroup).Val() != "2" {
		t.Fatalf("entries %v", ns)
	}
}

func TestAnotherServerErrorIsFailed(t *testing.T) {
	c := newClient(t)
	c.Set(bg, testStream, "not a stream", 0)
	_, err := newProducer(t, noRetries(t, server.Addr)).Publish(bg, "n", "1")
	if !errors.Is(err, ErrFailed) || !strings.Contains(err.Error(), "WRONGTYPE") {
		t.Fatalf("got %v", err)
	}
}

func TestAReadOnlyReplicaIsUnavailable(t *testing.T) {
	c := newClient(t)
	// A replica of a primary that is not there: it keeps refusing writes.
	if err := c.SlaveOf(bg, "127.0.0.1", "1").Err(); err != nil {
		t.Fatal(err)
	}
	defer c.SlaveOf(bg, "NO", "ONE")
	_, err := newProducer(t, noRetries(t, server.Addr)).Publish(bg, "n", "1")
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("got %v", err)
	}
	if c.Exists(bg, testStream).Val() != 0 {
		t.Fatal("written")
	}
}

// serverError is an error reply, as go-redis reads one.
type serverError string

func (e serverError) Error() string { return string(e) }
func (serverError) RedisError()     {}

func TestServerErrorsAreClassifiedAsTheContractSays(t *testing.T) {
	var refused *RefusedError
	if err := classify(serverError("PELICAN_BACKLOG_FULL my group 5 6")); !errors.As(err, &refused) ||
		*refused != (RefusedError{Group: "my group", Backlog: 5, Max: 6}) {
		t.Fatalf("got %v", err)
	}
	for _, text := range []string{
		"READONLY You can't write against a read only replica.", "LOADING Redis is loading the dataset in memory",
		"BUSY Redis is busy running a script.", "MASTERDOWN Link with MASTER is down",
		"TRYAGAIN Multiple keys request during rehashing of slot",
	} {
		if err := classify(serverError(text)); !errors.Is(err, ErrUnavailable) {
			t.Errorf("%s: %v", text, err)
		}
	}
	var unknown *OutcomeUnknownError
	for _, err := range []error{serverError("PELICAN_PARTIAL 1 of 3 entries written before: OOM"), io.EOF,
		&net.OpError{Op: "read", Err: errors.New("i/o timeout")}} {
		if !errors.As(classify(err), &unknown) {
			t.Errorf("%v: %v", err, classify(err))
		}
	}
	if err := classify(serverError("ERR bounded publish needs field value pairs")); !errors.Is(err, ErrFailed) {
		t.Errorf("got %v", err)
	}
	if err := classify(&net.OpError{Op: "dial", Err: errors.New("refused")}); !errors.Is(err, ErrUnavailable) {
		t.Errorf("a connection never made: %v", err)
	}
}

func TestAClientThatResendsIsRefused(t *testing.T) {
	for _, client := range []redis.UniversalClient{
		redis.NewClient(&redis.Options{Addr: server.Addr}),
		redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{server.Addr}, MaxRetries: -1}),
	} {
		if _, err := NewProducer(client, testStream); err == nil || !strings.Contains(err.Error(), "-1") {
			t.Errorf("%T: got %v", client, err)
		}
		client.Close()
	}
}

// lostReply is a loopback proxy to the server that loses one reply: on the first connection whose client sends
// EVALSHA, it lets the command through and closes the connection instead of passing the answer on. Later
// connections pass through.
type lostReply struct {
	listener net.Listener
	upstream string
	cut      atomic.Bool
}

func newLostReply(t *testing.T, upstream string) *lostReply {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &lostReply{listener: listener, upstream: upstream}
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

func (p *lostReply) serve(client net.Conn) {
	defer client.Close()
	server, err := net.Dial("tcp", p.upstream)
	if err != nil {
		return
	}
	defer server.Close()
	var armed atomic.Bool
	go func() {
		buf := make([]byte, 65536)
		for {
			n, err := client.Read(buf)
			if err != nil {
				server.Close()
				return
			}
			if !p.cut.Load() && bytes.Contains(bytes.ToUpper(buf[:n]), []byte("EVALSHA")) {
				armed.Store(true)
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
		if armed.Load() {
			p.cut.Store(true)
			return // the reply is lost with the connection
		}
		if _, err := client.Write(buf[:n]); err != nil {
			return
		}
	}
}

func loadPublishScript(t *testing.T, c *redis.Client) {
	// So that the EVALSHA runs, rather than answering NOSCRIPT.
	if err := boundedPublishScript.Load(bg, c).Err(); err != nil {
		t.Fatal(err)
	}
}

func TestAPublishWhoseReplyWasLostIsOutcomeUnknownAndWrittenOnce(t *testing.T) {
	c := newClient(t)
	loadPublishScript(t, c)
	proxy := newLostReply(t, server.Addr)
	_, err := newProducer(t, noRetries(t, proxy.listener.Addr().String())).Publish(bg, "n", "once")
	var unknown *OutcomeUnknownError
	if !errors.As(err, &unknown) || !proxy.cut.Load() {
		t.Fatalf("got %v, cut %v", err, proxy.cut.Load())
	}
	if n := c.XLen(bg, testStream).Val(); n != 1 {
		t.Fatalf("%d entries", n)
	}
}

// The control of the test above: the same lost reply through go-redis' defaults (MaxRetries 3) writes twice.
func TestTheLostReplyMakesADefaultClientWriteTwice(t *testing.T) {
	c := newClient(t)
	loadPublishScript(t, c)
	proxy := newLostReply(t, server.Addr)
	resending := redis.NewClient(&redis.Options{Addr: proxy.listener.Addr().String()})
	defer resending.Close()
	keys := []string{testStream, BoundsKey(testStream), RejectedKey(testStream)}
	if err := boundedPublishScript.Run(bg, resending, keys, "n", "once").Err(); err != nil {
		t.Fatal(err)
	}
	if n := c.XLen(bg, testStream).Val(); !proxy.cut.Load() || n != 2 {
		t.Fatalf("%d entries, cut %v", n, proxy.cut.Load())
	}
}

func TestAnIdempotentPublishIsWrittenOnce(t *testing.T) {
	c := idmpClient(t)
	p, err := NewIdempotentProducer(bg, noRetries(t, c.Options().Addr), testStream, "producer-0")
	if err != nil {
		t.Fatal(err)
	}
	first, err := p.Publish(bg, "order-1", "n", "1")
	if err != nil {
		t.Fatal(err)
	}
	again, err := p.Publish(bg, "order-1", "n", "1")
	if err != nil || again != first {
		t.Fatalf("again %s, first %s (%v)", again, first, err)
	}
	batch, err := p.PublishBatch(bg, []IdempotentEntry{{"order-1", []string{"n", "1"}}, {"order-2", []string{"n", "2"}}})
	if err != nil || len(batch.IDs) != 2 || batch.IDs[0] != first || batch.Refused != nil {
		t.Fatalf("batch %+v (%v)", batch, err)
	}
	if n := c.XLen(bg, testStream).Val(); n != 2 {
		t.Fatalf("%d entries", n)
	}
}

func TestWithoutIDMPAnIdempotentProducerRefusesClearly(t *testing.T) {
	c := newClient(t)
	_, err := NewIdempotentProducer(bg, noRetries(t, server.Addr), testStream, "producer-0")
	if !errors.Is(err, ErrIdempotenceUnsupported) || !strings.Contains(err.Error(), "no XADD ... IDMP (Redis 8.6 or later)") {
		t.Fatalf("got %v: REDIS_SERVER must be a server without XADD ... IDMP", err)
	}
	if c.Exists(bg, testStream).Val() != 0 {
		t.Fatal("written")
	}
}

func TestIDMPIsDetectedFromTheTokenInCommandDocs(t *testing.T) {
	// COMMAND DOCS XADD as Redis 8.6 answers it, abridged: RESP2 (flat lists) and RESP3 (maps).
	resp2 := []any{"xadd", []any{"summary", "Appends a new message to a stream.", "arguments", []any{
		[]any{"name", "key", "type", "key"},
		[]any{"name", "idmp", "type", "block", "token", "IDMP", "arguments", []any{[]any{"name", "pid"}}},
	}}}
	resp3 := map[any]any{"xadd": map[any]any{"summary": "x", "arguments": []any{
		map[any]any{"name": "idmp", "type": "block", "token": "IDMP"},
	}}}
	older := []any{"xadd", []any{"summary", "mentions IDMP only in text", "arguments", []any{
		[]any{"name", "key", "token", "MAXLEN"},
	}}}
	if !hasToken(resp2, "IDMP") || !hasToken(resp3, "IDMP") || hasToken(older, "IDMP") || hasToken([]any{}, "IDMP") {
		t.Fatal("misread")
	}
}
