package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	pelican "github.com/pelican-io/pelican/sdks/go"
	"github.com/pelican-io/pelican/sdks/go/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// The topic mode: TOPIC, MEMBERSHIP_TTL_MS; each run line with its partition, key, startedAt and endedAt.

const topic = "orders"

// topicWorker starts the conformance worker as member w1 of topic's group on the test server, or with env's
// REDIS_URL; its lines come on the channel, each as the JSON object it printed, closed at its exit.
func topicWorker(t *testing.T, env ...string) (*exec.Cmd, <-chan map[string]any) {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(append(os.Environ(), "PELICAN_CONFORMANCE_WORKER=1", "REDIS_URL="+server.URL(), "TOPIC="+topic,
		"GROUP="+group, "CONSUMER=w1", "MEMBERSHIP_TTL_MS=2000", "SHUTDOWN_GRACE_MS=1000"), env...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill() })
	lines := make(chan map[string]any, 100)
	go func() {
		defer close(lines)
		for scanner := bufio.NewScanner(out); scanner.Scan(); {
			var line map[string]any
			if err := json.Unmarshal(scanner.Bytes(), &line); err != nil {
				t.Errorf("not a run line (%v): %s", err, scanner.Text())
			}
			lines <- line
		}
	}()
	return cmd, lines
}

// describeTopic writes what the operator writes for a topic of n partitions on the emptied test server.
func describeTopic(t *testing.T, n int) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: server.Addr})
	t.Cleanup(func() { c.Close() })
	c.FlushAll(bg)
	describeOn(t, c, n)
	return c
}

func describeOn(t *testing.T, c redis.UniversalClient, n int) {
	settings := []any{"contractVersion", 2, "partitions", n, "ordering", "PerKey", "minIdleMs", 1000,
		"retryAfterMs", 1000, "maxDeliveries", 5, "backoffFactor", 1, "backoffMaxMs", 0}
	c.HSet(bg, pelican.TopicKey(topic), "partitions", n, "contractVersion", 2)
	c.HSet(bg, pelican.SettingsKey(topic, group), settings...)
	for p := range n {
		stream := pelican.PartitionStream(topic, p)
		c.HSet(bg, pelican.SettingsKey(stream, group), settings...)
		if err := c.XGroupCreateMkStream(bg, stream, group, "0").Err(); err != nil {
			t.Fatal(err)
		}
	}
}

func TestATopicsRunLinesSayThePartitionTheKeyAndTheTimes(t *testing.T) {
	c := describeTopic(t, 2)
	cmd, lines := topicWorker(t)
	publishing := redis.NewClient(&redis.Options{Addr: server.Addr, MaxRetries: -1})
	t.Cleanup(func() { publishing.Close() })
	producer, err := pelican.NewTopicProducer(bg, publishing, topic)
	if err != nil {
		t.Fatal(err)
	}
	keyed, err := producer.PublishKeyed(bg, "order-42", "handle", "done", "ms", "50")
	if err != nil {
		t.Fatal(err)
	}
	alone, err := producer.Publish(bg, "handle", "done", "ms", "0")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]map[string]any{}
	for len(got) < 2 {
		select {
		case line := <-lines:
			got[line["id"].(string)] = line
		case <-time.After(10 * time.Second):
			t.Fatalf("lines %v", got)
		}
	}
	k := got[keyed.ID]
	if k["partition"] != float64(pelican.PartitionOf([]byte("order-42"), 2)) || k["key"] != "order-42" ||
		k["outcome"] != "done" || k["consumer"] != "w1" || k["endedAt"].(float64)-k["startedAt"].(float64) < 50 {
		t.Fatalf("keyed: %v", k)
	}
	a := got[alone.ID]
	if key, has := a["key"]; !has || key != nil || a["partition"] != float64(alone.Partition) {
		t.Fatalf("without a key: %v", a)
	}
	if now := float64(time.Now().UnixMilli()); a["startedAt"].(float64) > now || a["startedAt"].(float64) < now-60_000 {
		t.Fatalf("startedAt %v is not the wall clock in ms", a["startedAt"])
	}
	cmd.Process.Signal(syscall.SIGTERM)
	if code := exitCode(t, cmd); code != 0 {
		t.Fatalf("exit status %d after SIGTERM", code)
	}
	if n := c.HLen(bg, pelican.MembersKey(topic, group)).Val(); n != 0 {
		t.Fatalf("%d members after it left", n)
	}
}

func TestATopicTheLibraryRefusesExitsWithStatus4(t *testing.T) {
	c := describeTopic(t, 2)
	c.HSet(bg, pelican.SettingsKey(topic, group), "contractVersion", 3)
	cmd, _ := topicWorker(t)
	if code := exitCode(t, cmd); code != 4 {
		t.Fatalf("exit status %d", code)
	}
	c.Del(bg, pelican.SettingsKey(topic, group))
	cmd, _ = topicWorker(t)
	if code := exitCode(t, cmd); code != 4 {
		t.Fatalf("no topic: exit status %d", code)
	}
}

func TestWithRedisClusterTheTopicWorkerReadsThePartitionsOfEveryShard(t *testing.T) {
	binary, err := redistest.Binary()
	if err != nil {
		t.Fatal(err)
	}
	cluster, err := redistest.StartCluster(binary, 3)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Stop)
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs(), MaxRetries: -1, MaxRedirects: -1})
	t.Cleanup(func() { c.Close() })
	describeOn(t, c, 6)
	cmd, lines := topicWorker(t, "REDIS_URL="+cluster.Servers[0].URL(), "REDIS_CLUSTER=1")
	producer, err := pelican.NewTopicProducer(bg, c, topic)
	if err != nil {
		t.Fatal(err)
	}
	shards, partitions := map[string]bool{}, map[float64]bool{}
	for k := range 30 {
		at, err := producer.PublishKeyed(bg, fmt.Sprintf("key-%d", k), "handle", "done")
		if err != nil {
			t.Fatal(err)
		}
		node, err := c.MasterForKey(bg, pelican.PartitionStream(topic, at.Partition))
		if err != nil {
			t.Fatal(err)
		}
		shards[node.Options().Addr] = true
	}
	for range 30 {
		select {
		case line := <-lines:
			partitions[line["partition"].(float64)] = true
		case <-time.After(10 * time.Second):
			t.Fatalf("lines of partitions %v only", partitions)
		}
	}
	if len(shards) < 2 || len(partitions) != 6 {
		t.Fatalf("published to %d shards, lines of partitions %v", len(shards), partitions)
	}
	cmd.Process.Signal(syscall.SIGTERM)
	if code := exitCode(t, cmd); code != 0 {
		t.Fatalf("exit status %d after SIGTERM", code)
	}
}
