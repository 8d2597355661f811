package pelican

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/pelican-io/pelican/sdks/go/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// A Redis Cluster of three primaries the tests start once: a plain stream's worker and producer, and a topic whose
// partitions the Cluster spreads over its shards, through go-redis' ClusterClient.

var (
	clusterOnce sync.Once
	cluster     *redistest.Cluster
	clusterErr  error
)

// clusterClient is a client of the tests' Cluster; options adjust its options.
func clusterClient(t *testing.T, options ...func(*redis.ClusterOptions)) *redis.ClusterClient {
	t.Helper()
	clusterOnce.Do(func() {
		binary, err := redistest.Binary()
		if err == nil {
			cluster, err = redistest.StartCluster(binary, 3)
		}
		clusterErr = err
	})
	if clusterErr != nil {
		t.Fatal(clusterErr)
	}
	opt := &redis.ClusterOptions{Addrs: cluster.Addrs()}
	for _, o := range options {
		o(opt)
	}
	c := redis.NewClusterClient(opt)
	t.Cleanup(func() { c.Close() })
	return c
}

// emptiedCluster is a client of the tests' Cluster, emptied first.
func emptiedCluster(t *testing.T) *redis.ClusterClient {
	t.Helper()
	c := clusterClient(t)
	err := c.ForEachMaster(bg, func(ctx context.Context, node *redis.Client) error {
		return node.FlushAll(ctx).Err()
	})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func noResends(o *redis.ClusterOptions) { o.MaxRetries, o.MaxRedirects = -1, -1 }

func TestOnAClusterAWorkerHandlesAStreamAndRecordsItsOutcomes(t *testing.T) {
	c := emptiedCluster(t)
	stream := "jobs"
	if err := c.XGroupCreateMkStream(bg, stream, testGroup, "0").Err(); err != nil {
		t.Fatal(err)
	}
	c.HSet(bg, SettingsKey(stream, testGroup), "minIdleMs", 3000, "retryAfterMs", 3000, "maxDeliveries", 5)
	producer, err := NewProducer(clusterClient(t, noResends), stream)
	if err != nil {
		t.Fatal(err)
	}
	var failing string
	for i := range 20 {
		handle := "done"
		if i == 7 {
			handle = "fail"
		}
		id, err := producer.Publish(bg, "n", fmt.Sprint(i), "handle", handle)
		if err != nil {
			t.Fatal(err)
		}
		if i == 7 {
			failing = id
		}
	}
	logger, _ := testLogger(t)
	w, err := NewWorker(clusterClient(t), WorkerOptions{Stream: stream, Group: testGroup, Consumer: "w1",
		Block: 200 * time.Millisecond, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	r := start(t, w, func(ctx context.Context, m Message) (Outcome, error) {
		if m.Get("handle") == "fail" {
			return Outcome{}, fmt.Errorf("failed on purpose")
		}
		return Done(), nil
	})
	eventually(t, 10*time.Second, "19 done, 1 failed", func() bool {
		s := w.Stats()
		return s.Done == 19 && s.Failed == 1
	})
	if text := c.HGet(bg, ErrorsKey(stream, testGroup), failing).Val(); text != "failed on purpose" {
		t.Fatalf("last error %q", text)
	}
	p := c.XPendingExt(bg, &redis.XPendingExtArgs{Stream: stream, Group: testGroup, Start: "-", End: "+",
		Count: 100}).Val()
	if len(p) != 1 || p[0].ID != failing || p[0].Consumer != "w1" {
		t.Fatalf("pending %v", p)
	}
	eventually(t, 3*time.Second, "the lease tick's heartbeat", func() bool {
		return c.HExists(bg, ConsumersKey(stream, testGroup), "w1").Val()
	})
	if _, err := r.stop(t); err != nil {
		t.Fatal(err)
	}
}

func TestOnAClusterATopicsPartitionsSpreadOverTheShardsAndAMemberHandlesThemAll(t *testing.T) {
	c := emptiedCluster(t)
	const n = 6
	settings := []any{"contractVersion", 2, "partitions", n, "ordering", "PerKey", "backoffFactor", 1,
		"backoffMaxMs", 0, "minIdleMs", 300, "retryAfterMs", 300, "maxDeliveries", 5}
	c.HSet(bg, TopicKey(testTopic), "partitions", n, "contractVersion", 2)
	c.HSet(bg, SettingsKey(testTopic, testGroup), settings...)
	shards := map[string]bool{}
	for p := range n {
		stream := PartitionStream(testTopic, p)
		c.HSet(bg, SettingsKey(stream, testGroup), settings...)
		if err := c.XGroupCreateMkStream(bg, stream, testGroup, "0").Err(); err != nil {
			t.Fatal(err)
		}
		node, err := c.MasterForKey(bg, stream)
		if err != nil {
			t.Fatal(err)
		}
		shards[node.Options().Addr] = true
	}
	if len(shards) < 2 {
		t.Fatalf("the %d partitions are on %d shard(s)", n, len(shards))
	}
	logger, _ := testLogger(t)
	w, err := NewTopicWorker(bg, clusterClient(t), TopicWorkerOptions{
		WorkerOptions: WorkerOptions{Stream: testTopic, Group: testGroup, Consumer: "a", Block: 200 * time.Millisecond,
			Logger: logger},
		MembershipTTL: testTTL,
	})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	seen := map[string][]string{}
	ctx, cancel := context.WithCancel(bg)
	done := make(chan struct{})
	go func() {
		defer close(done)
		w.Run(ctx, func(ctx context.Context, m Message) (Outcome, error) {
			key, _ := m.Key()
			mu.Lock()
			defer mu.Unlock()
			seen[key] = append(seen[key], m.Get("n"))
			return Done(), nil
		})
	}()
	t.Cleanup(func() { cancel(); <-done })
	producer, err := NewTopicProducer(bg, clusterClient(t, noResends), testTopic)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		for k := range 10 {
			if _, err := producer.PublishKeyed(bg, fmt.Sprintf("key-%d", k), "n", fmt.Sprint(i)); err != nil {
				t.Fatal(err)
			}
		}
	}
	eventually(t, 10*time.Second, "40 runs", func() bool {
		mu.Lock()
		defer mu.Unlock()
		total := 0
		for _, runs := range seen {
			total += len(runs)
		}
		return total == 40
	})
	mu.Lock()
	defer mu.Unlock()
	for key, runs := range seen {
		if fmt.Sprint(runs) != "[0 1 2 3]" {
			t.Errorf("key %s ran %v", key, runs)
		}
	}
}
