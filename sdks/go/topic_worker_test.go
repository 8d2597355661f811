package pelican

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Topic workers against a real server: members sharing partitions, hand-overs, order per key, refusals. The
// operator's part (the topic's description, its settings and each partition's, the group on each partition) is
// written by hand as the operator writes it.

const testTTL = 3 * time.Second

// describe writes what the operator writes for a topic of n partitions, and creates the group on each partition.
func describe(t *testing.T, c *redis.Client, n int, fields ...any) {
	t.Helper()
	settings := append([]any{"contractVersion", 2, "partitions", n, "ordering", "None", "backoffFactor", 1,
		"backoffMaxMs", 0, "minIdleMs", 300, "retryAfterMs", 300, "maxDeliveries", 5}, fields...)
	c.HSet(bg, TopicKey(testTopic), "partitions", n, "contractVersion", 2)
	c.HSet(bg, SettingsKey(testTopic, testGroup), settings...)
	for p := range n {
		stream := PartitionStream(testTopic, p)
		c.HSet(bg, SettingsKey(stream, testGroup), settings...)
		if err := c.XGroupCreateMkStream(bg, stream, testGroup, "0").Err(); err != nil {
			t.Fatal(err)
		}
	}
}

// handled is one run of a handler, as the test saw it.
type handled struct {
	member, id, key string
	partition       int
	started, ended  time.Time
	// deliveries is the entry's delivery count on the server when its handler ran.
	deliveries int64
}

type runs struct {
	mu   sync.Mutex
	list []handled
}

func (r *runs) add(h handled) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.list = append(r.list, h)
}

func (r *runs) all() []handled {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]handled(nil), r.list...)
}

func (r *runs) of(pred func(handled) bool) []handled {
	var found []handled
	for _, h := range r.all() {
		if pred(h) {
			found = append(found, h)
		}
	}
	return found
}

// member is a TopicWorker's Run in the background, on a client of its own.
type member struct {
	name   string
	client *redis.Client
	cancel context.CancelFunc
	done   chan struct{}
	stats  Stats
	err    error
}

func startMember(t *testing.T, name string, concurrency int, handler Handler) *member {
	t.Helper()
	logger, _ := testLogger(t)
	client := redis.NewClient(&redis.Options{Addr: server.Addr})
	t.Cleanup(func() { client.Close() })
	w, err := NewTopicWorker(bg, client, TopicWorkerOptions{
		WorkerOptions: WorkerOptions{Stream: testTopic, Group: testGroup, Consumer: name, Concurrency: concurrency,
			Block: 200 * time.Millisecond, ShutdownGrace: 2 * time.Second, Logger: logger.With("member", name)},
		MembershipTTL: testTTL,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(bg)
	m := &member{name: name, client: client, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(m.done)
		m.stats, m.err = w.Run(ctx, handler)
	}()
	t.Cleanup(func() { m.stop(t) })
	return m
}

// stop cancels Run's context (as SIGTERM does) and waits for the shutdown and the leave.
func (m *member) stop(t *testing.T) {
	t.Helper()
	m.cancel()
	select {
	case <-m.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("member %s did not stop within 30 s", m.name)
	}
}

// recording is a handler that records each run as member name's and answers Done, after hang when the key is
// "hang" (until its context is cancelled).
func recording(c *redis.Client, name string, r *runs, hang func(handled) bool) Handler {
	return func(ctx context.Context, m Message) (Outcome, error) {
		key, _ := m.Key()
		h := handled{member: name, id: m.ID, key: key, partition: m.Partition, started: time.Now()}
		p, err := c.XPendingExt(bg, &redis.XPendingExtArgs{Stream: PartitionStream(testTopic, m.Partition),
			Group: testGroup, Start: m.ID, End: m.ID, Count: 1}).Result()
		if err == nil && len(p) == 1 {
			h.deliveries = p[0].RetryCount
		}
		r.add(h)
		if hang != nil && hang(h) {
			<-ctx.Done()
			return Outcome{}, ctx.Err()
		}
		return Done(), nil
	}
}

// owners is the owners hash: partition -> member.
func owners(c *redis.Client) map[string]string {
	return c.HGetAll(bg, OwnersKey(testTopic, testGroup)).Val()
}

func owning(c *redis.Client, want map[string]int) func() bool {
	return func() bool {
		counts := map[string]int{}
		for _, m := range owners(c) {
			counts[m]++
		}
		if len(counts) != len(want) {
			return false
		}
		for name, n := range want {
			if counts[name] != n {
				return false
			}
		}
		return true
	}
}

func newTopicProducer(t *testing.T) *TopicProducer {
	t.Helper()
	p, err := NewTopicProducer(bg, noRetries(t, server.Addr), testTopic)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestTwoMembersShareFourPartitionsAndEachKeyedMessageIsHandledOnceByItsOwner(t *testing.T) {
	c := newClient(t)
	describe(t, c, 4)
	r := &runs{}
	startMember(t, "a", 4, recording(c, "a", r, nil))
	startMember(t, "b", 4, recording(c, "b", r, nil))
	eventually(t, 3*testTTL, "each member to own 2 partitions", owning(c, map[string]int{"a": 2, "b": 2}))
	p := newTopicProducer(t)
	published := map[string]TopicPublished{}
	for i := range 40 {
		key := fmt.Sprintf("order-%d", i)
		at, err := p.PublishKeyed(bg, key, "n", "1")
		if err != nil {
			t.Fatal(err)
		}
		published[at.ID+"/"+fmt.Sprint(at.Partition)] = at
	}
	eventually(t, 10*time.Second, "40 runs", func() bool { return len(r.all()) >= 40 })
	owner := owners(c)
	seen := map[string]int{}
	for _, h := range r.all() {
		seen[h.id+"/"+fmt.Sprint(h.partition)]++
		if h.partition != PartitionOf([]byte(h.key), 4) {
			t.Errorf("%s (key %s) came from partition %d, its key's is %d", h.id, h.key, h.partition,
				PartitionOf([]byte(h.key), 4))
		}
		if owner[fmt.Sprint(h.partition)] != h.member {
			t.Errorf("%s of partition %d was handled by %s, its owner is %s", h.id, h.partition, h.member,
				owner[fmt.Sprint(h.partition)])
		}
	}
	for id := range published {
		if seen[id] != 1 {
			t.Errorf("%s handled %d times", id, seen[id])
		}
	}
	members := map[string]bool{}
	for _, h := range r.all() {
		members[h.member] = true
	}
	if len(members) != 2 {
		t.Fatalf("handled by %v only", members)
	}
}

func TestAMemberLeavingHandsItsPartitionsToTheOther(t *testing.T) {
	c := newClient(t)
	describe(t, c, 4)
	r := &runs{}
	startMember(t, "a", 4, recording(c, "a", r, nil))
	b := startMember(t, "b", 4, recording(c, "b", r, nil))
	eventually(t, 3*testTTL, "each member to own 2 partitions", owning(c, map[string]int{"a": 2, "b": 2}))
	b.stop(t)
	if b.err != nil {
		t.Fatal(b.err)
	}
	if n := c.HLen(bg, MembersKey(testTopic, testGroup)).Val(); n != 1 {
		t.Fatalf("%d members after b left", n)
	}
	eventually(t, testTTL, "a to own all 4 partitions", owning(c, map[string]int{"a": 4}))
	p := newTopicProducer(t)
	for range 8 {
		if _, err := p.Publish(bg, "n", "1"); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 10*time.Second, "8 runs", func() bool { return len(r.all()) >= 8 })
	partitions := map[int]bool{}
	for _, h := range r.all() {
		if h.member != "a" {
			t.Fatalf("%s handled %s after it left", h.member, h.id)
		}
		partitions[h.partition] = true
	}
	if len(partitions) != 4 {
		t.Fatalf("a handled partitions %v", partitions)
	}
}

func TestAMemberThatStopsHeartbeatingLosesItsPartitionsAndTheOtherRunsItsPendingEntryFirst(t *testing.T) {
	c := newClient(t)
	describe(t, c, 4)
	r := &runs{}
	startMember(t, "a", 4, recording(c, "a", r, nil))
	b := startMember(t, "b", 4, recording(c, "b", r, func(h handled) bool { return h.member == "b" }))
	eventually(t, 3*testTTL, "each member to own 2 partitions", owning(c, map[string]int{"a": 2, "b": 2}))
	var partition int
	for p, name := range owners(c) {
		if name == "b" {
			fmt.Sscan(p, &partition)
		}
	}
	stream := PartitionStream(testTopic, partition)
	id := c.XAdd(bg, &redis.XAddArgs{Stream: stream, Values: []string{"n", "1"}}).Val()
	eventually(t, 5*time.Second, "b to run the entry", func() bool {
		return len(r.of(func(h handled) bool { return h.id == id })) == 1
	})
	// b crashes: nothing more reaches the server from it, and it never leaves.
	b.client.Close()
	crashed := time.Now()
	eventually(t, 3*testTTL, "a to run b's pending entry", func() bool {
		return len(r.of(func(h handled) bool { return h.id == id && h.member == "a" })) == 1
	})
	if took := time.Since(crashed); took > testTTL+testTTL/3+time.Second {
		t.Errorf("a ran b's entry %v after b stopped heart-beating (ttl %v)", took, testTTL)
	}
	a := r.of(func(h handled) bool { return h.id == id && h.member == "a" })[0]
	if a.deliveries != 2 {
		t.Fatalf("the entry had %d deliveries on the server when a ran it, not 2", a.deliveries)
	}
	eventually(t, 5*time.Second, "the entry to be acknowledged", func() bool {
		return len(c.XPendingExt(bg, &redis.XPendingExtArgs{Stream: stream, Group: testGroup, Start: "-",
			End: "+", Count: 10}).Val()) == 0
	})
	if owners(c)[fmt.Sprint(partition)] != "a" {
		t.Fatalf("owners %v", owners(c))
	}
}

func TestPerKeyRunsEachKeyInOrderOneAtATimeAndKeysSideBySide(t *testing.T) {
	c := newClient(t)
	describe(t, c, 1, "ordering", "PerKey")
	r := &runs{}
	var mu sync.Mutex
	inFlight := map[string]int{}
	keysAtOnce, mostKeysAtOnce, twoOfAKey := 0, 0, 0
	startMember(t, "a", 8, func(ctx context.Context, m Message) (Outcome, error) {
		key, _ := m.Key()
		mu.Lock()
		inFlight[key]++
		if inFlight[key] > 1 {
			twoOfAKey++
		}
		keysAtOnce = len(inFlight)
		mostKeysAtOnce = max(mostKeysAtOnce, keysAtOnce)
		mu.Unlock()
		r.add(handled{member: "a", id: m.ID, key: key, partition: m.Partition, started: time.Now()})
		time.Sleep(20 * time.Millisecond) // the work
		mu.Lock()
		if inFlight[key]--; inFlight[key] == 0 {
			delete(inFlight, key)
		}
		mu.Unlock()
		return Done(), nil
	})
	eventually(t, 3*testTTL, "a to own the partition", owning(c, map[string]int{"a": 1}))
	p := newTopicProducer(t)
	order := map[string][]string{}
	for i := range 6 {
		for k := range 5 {
			key := fmt.Sprintf("key-%d", k)
			at, err := p.PublishKeyed(bg, key, "n", fmt.Sprint(i))
			if err != nil {
				t.Fatal(err)
			}
			order[key] = append(order[key], at.ID)
		}
	}
	eventually(t, 10*time.Second, "30 runs", func() bool { return len(r.all()) >= 30 })
	ran := map[string][]string{}
	for _, h := range r.all() {
		ran[h.key] = append(ran[h.key], h.id)
	}
	for key, ids := range order {
		if strings.Join(ran[key], " ") != strings.Join(ids, " ") {
			t.Errorf("key %s ran %v, published %v", key, ran[key], ids)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if twoOfAKey > 0 {
		t.Errorf("two entries of one key ran at once %d times", twoOfAKey)
	}
	if mostKeysAtOnce < 2 {
		t.Errorf("at most %d keys ran at once", mostKeysAtOnce)
	}
}

func TestPerKeyRunsAFailingMessageAgainInPlaceWhileItsKeyWaitsAndAnotherKeyDoesNot(t *testing.T) {
	c := newClient(t)
	describe(t, c, 1, "ordering", "PerKey", "minIdleMs", 500)
	r := &runs{}
	var mu sync.Mutex
	failures := 0
	var lastError string
	startMember(t, "a", 4, func(ctx context.Context, m Message) (Outcome, error) {
		recording(c, "a", r, nil)(ctx, m)
		if m.Get("n") != "a1" {
			return Done(), nil
		}
		mu.Lock()
		defer mu.Unlock()
		if failures == 0 {
			failures++
			return Outcome{}, errors.New("the store is away")
		}
		lastError = c.HGet(bg, ErrorsKey(PartitionStream(testTopic, 0), testGroup), m.ID).Val()
		return Done(), nil
	})
	eventually(t, 3*testTTL, "a to own the partition", owning(c, map[string]int{"a": 1}))
	p := newTopicProducer(t)
	for _, m := range [][2]string{{"a", "a1"}, {"a", "a2"}, {"b", "b1"}} {
		if _, err := p.PublishKeyed(bg, m[0], "n", m[1]); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 10*time.Second, "4 runs", func() bool { return len(r.all()) >= 4 })
	// Key a: a1, a1 again (its delivery raised first), then a2. Key b: b1 while a waits. Runs of different keys
	// start at once, so which of a1 and b1 is recorded first is not promised.
	a := r.of(func(h handled) bool { return h.key == "a" })
	b := r.of(func(h handled) bool { return h.key == "b" })
	if len(a) != 3 || len(b) != 1 || a[1].id != a[0].id || a[2].id == a[0].id {
		t.Fatalf("ran %v", r.all())
	}
	if a[0].deliveries != 1 || a[1].deliveries != 2 {
		t.Fatalf("a1 ran with %d then %d deliveries, not 1 then 2", a[0].deliveries, a[1].deliveries)
	}
	if wait := a[1].started.Sub(a[0].started); wait < 400*time.Millisecond {
		t.Fatalf("a1 ran again %v after it failed, before minIdle", wait)
	}
	if !b[0].started.Before(a[1].started) {
		t.Fatalf("b1 waited for a1's run again: %v", r.all())
	}
	mu.Lock()
	defer mu.Unlock()
	if lastError != "the store is away" {
		t.Fatalf("its last error was %q when it ran again", lastError)
	}
	eventually(t, 5*time.Second, "the last error removed with the ACK", func() bool {
		return c.HLen(bg, ErrorsKey(PartitionStream(testTopic, 0), testGroup)).Val() == 0
	})
}

func TestPerKeyAtTheCapTheEntryIsNoLongerLeasedAndTheKeyGoesOnOnceItLeftThePendingList(t *testing.T) {
	c := newClient(t)
	describe(t, c, 1, "ordering", "PerKey", "minIdleMs", 300, "maxDeliveries", 2)
	r := &runs{}
	startMember(t, "a", 4, func(ctx context.Context, m Message) (Outcome, error) {
		recording(c, "a", r, nil)(ctx, m)
		if m.Get("n") == "a1" {
			return Retry(), nil
		}
		return Done(), nil
	})
	eventually(t, 3*testTTL, "a to own the partition", owning(c, map[string]int{"a": 1}))
	p := newTopicProducer(t)
	first, err := p.PublishKeyed(bg, "a", "n", "a1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.PublishKeyed(bg, "a", "n", "a2"); err != nil {
		t.Fatal(err)
	}
	stream := PartitionStream(testTopic, 0)
	eventually(t, 5*time.Second, "a1 to run twice", func() bool { return len(r.all()) >= 2 })
	// Leased every 100 ms while held; at the cap its idle time grows.
	eventually(t, 5*time.Second, "a1 to be idle for 1 s", func() bool {
		p := c.XPendingExt(bg, &redis.XPendingExtArgs{Stream: stream, Group: testGroup, Start: first.ID,
			End: first.ID, Count: 1}).Val()
		return len(p) == 1 && p[0].Idle > time.Second
	})
	if all := r.all(); len(all) != 2 || all[1].id != first.ID || all[1].deliveries != 2 {
		t.Fatalf("ran %v while a1 is at the cap", all)
	}
	// The operator's pass dead-letters it.
	c.XAck(bg, stream, testGroup, first.ID)
	eventually(t, 5*time.Second, "a2 to run", func() bool { return len(r.all()) == 3 })
	if last := r.all()[2]; last.id == first.ID || last.key != "a" {
		t.Fatalf("then ran %v", last)
	}
}

func TestATopicWorkerRefusesNamingWhatIsWrong(t *testing.T) {
	c := newClient(t)
	connect := func(ttl time.Duration) error {
		_, err := NewTopicWorker(bg, c, TopicWorkerOptions{
			WorkerOptions: WorkerOptions{Stream: testTopic, Group: testGroup, Consumer: "a"}, MembershipTTL: ttl})
		return err
	}
	var notATopic *NotATopicError
	if err := connect(0); !errors.As(err, &notATopic) ||
		!strings.Contains(err.Error(), `the settings of "orders" group "workers" describe no topic`) {
		t.Fatalf("no settings: %v", err)
	}
	c.HSet(bg, SettingsKey(testTopic, testGroup), "minIdleMs", 300, "retryAfterMs", 300)
	if err := connect(0); !errors.As(err, &notATopic) {
		t.Fatalf("a plain stream's settings: %v", err)
	}
	c.HSet(bg, SettingsKey(testTopic, testGroup), "contractVersion", 3, "partitions", 4)
	var contract *TopicContractError
	if err := connect(0); !errors.As(err, &contract) || !strings.Contains(err.Error(), `worker contract "3"`) {
		t.Fatalf("contract 3: %v", err)
	}
	c.HSet(bg, SettingsKey(testTopic, testGroup), "contractVersion", 2, "ordering", "Random")
	var ordering *OrderingError
	if err := connect(0); !errors.As(err, &ordering) || !strings.Contains(err.Error(), `ordering "Random"`) {
		t.Fatalf("ordering Random: %v", err)
	}
	c.HSet(bg, SettingsKey(testTopic, testGroup), "ordering", "PerKey")
	for _, ttl := range []time.Duration{500 * time.Millisecond, 25 * time.Hour} {
		if err := connect(ttl); err == nil || !strings.Contains(err.Error(), "MembershipTTL must be 1s .. 24h") {
			t.Fatalf("ttl %v: %v", ttl, err)
		}
	}
	if err := connect(0); err != nil {
		t.Fatal(err)
	}
}

func TestPerKeyRetriesAreSpacedByTheBackoffAndCapped(t *testing.T) {
	s := spacing{factor: 2, max: 5 * time.Second}
	for deliveries, want := range []time.Duration{time.Second, time.Second, 2 * time.Second, 4 * time.Second,
		5 * time.Second} {
		if got := s.after(time.Second, int64(deliveries)); got != want {
			t.Errorf("after %d deliveries: %v, not %v", deliveries, got, want)
		}
	}
	if got := (spacing{factor: 10}).after(time.Second, 1000); got != 24*time.Hour {
		t.Errorf("without a most: %v", got)
	}
}

func TestAPartitionWhoseSettingsChangeToAnUnknownContractStopsTheMember(t *testing.T) {
	c := newClient(t)
	describe(t, c, 2)
	r := &runs{}
	m := startMember(t, "a", 4, recording(c, "a", r, nil))
	eventually(t, 3*testTTL, "a to own the partitions", owning(c, map[string]int{"a": 2}))
	c.HSet(bg, SettingsKey(PartitionStream(testTopic, 1), testGroup), "contractVersion", 3)
	select {
	case <-m.done:
	case <-time.After(10 * time.Second):
		t.Fatal("the member still runs")
	}
	var version *ContractVersionError
	if !errors.As(m.err, &version) || version.Operator != "3" || !strings.Contains(m.err.Error(), "knows 2") {
		t.Fatalf("Run returned %v", m.err)
	}
	if n := c.HLen(bg, MembersKey(testTopic, testGroup)).Val(); n != 0 {
		t.Fatalf("%d members after it stopped", n)
	}
}
