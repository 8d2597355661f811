// A topic beside one stream, on one server: the publish rate (one message after another, a key each of 1,000) and
// the consume rate (one member, or one worker, at concurrency 16, a handler that does nothing) of a plain stream and
// of topics of 1 and 8 partitions: go run ./bench/topic [-n 20000] [-rounds 3]. REDIS_URL names the server; without
// it a redis-server (REDIS_SERVER, else the one on PATH) is started on a free loopback port. Each round runs every
// case in turn; the medians are printed.
//
// The topic's settings are written here as the operator writes them (the tests' describe lives in a test file).
// Every message carries its number: the consume rate counts the messages a handler saw exactly once, timed from
// connecting (a member's join included) until each was seen; the messages seen more than once are printed.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	pelican "github.com/pelican-io/pelican/sdks/go"
	"github.com/pelican-io/pelican/sdks/go/internal/redistest"
	"github.com/redis/go-redis/v9"
)

const (
	group       = "g"
	keys        = 1000
	concurrency = 16
	// timeout fails a case that has not seen every message after this long.
	timeout = 2 * time.Minute
)

var ctx = context.Background()

// A plain stream (partitions 0) or a topic; the rates of each round, and the messages seen more than once.
type benchCase struct {
	label               string
	partitions          int
	ordering            pelican.Ordering
	published, consumed []float64
	seenAgain           int
}

// declare writes the settings the operator writes for the case's stream or topic, and creates the group on every
// stream.
func declare(c *redis.Client, stream string, bc *benchCase) error {
	settings := []any{"minIdleMs", 30000, "retryAfterMs", 1000, "maxDeliveries", 5}
	if bc.partitions == 0 {
		if err := c.HSet(ctx, pelican.SettingsKey(stream, group), append(settings, "contractVersion", 1)...).Err(); err != nil {
			return err
		}
		return c.XGroupCreateMkStream(ctx, stream, group, "0").Err()
	}
	settings = append(settings, "contractVersion", 2, "partitions", bc.partitions, "ordering", string(bc.ordering),
		"backoffFactor", 1, "backoffMaxMs", 0)
	if err := c.HSet(ctx, pelican.SettingsKey(stream, group), settings...).Err(); err != nil {
		return err
	}
	for p := range bc.partitions {
		partition := pelican.PartitionStream(stream, p)
		if err := c.HSet(ctx, pelican.SettingsKey(partition, group), settings...).Err(); err != nil {
			return err
		}
		if err := c.XGroupCreateMkStream(ctx, partition, group, "0").Err(); err != nil {
			return err
		}
	}
	return c.HSet(ctx, pelican.TopicKey(stream), "partitions", bc.partitions, "contractVersion", 2).Err()
}

// publish adds n messages one after another, message i with key i % keys, on c (a client that never resends a
// command, as a producer requires); messages per second.
func publish(c *redis.Client, stream string, bc *benchCase, n int) (float64, error) {
	began := time.Now()
	if bc.partitions == 0 {
		producer, err := pelican.NewProducer(c, stream)
		if err != nil {
			return 0, err
		}
		for i := range n {
			key := "key-" + strconv.Itoa(i%keys)
			if _, err := producer.Publish(ctx, pelican.KeyField, key, "n", strconv.Itoa(i)); err != nil {
				return 0, err
			}
		}
	} else {
		producer, err := pelican.NewTopicProducer(ctx, c, stream)
		if err != nil {
			return 0, err
		}
		for i := range n {
			key := "key-" + strconv.Itoa(i%keys)
			if _, err := producer.PublishKeyed(ctx, key, "n", strconv.Itoa(i)); err != nil {
				return 0, err
			}
		}
	}
	return float64(n) / time.Since(began).Seconds(), nil
}

// consume runs one member (a topic) or one worker (a stream) until a handler saw every message; the messages seen
// exactly once per second.
func consume(c *redis.Client, stream string, bc *benchCase, n int) (float64, error) {
	sights := make([]atomic.Int32, n)
	var seen atomic.Int64
	everySeen := make(chan struct{})
	handler := func(_ context.Context, m pelican.Message) (pelican.Outcome, error) {
		i, err := strconv.Atoi(m.Get("n"))
		if err != nil || i < 0 || i >= n {
			return pelican.Outcome{}, fmt.Errorf("not a message of this case: n=%q", m.Get("n"))
		}
		if sights[i].Add(1) == 1 && seen.Add(1) == int64(n) {
			close(everySeen)
		}
		return pelican.Done(), nil
	}
	options := pelican.WorkerOptions{Stream: stream, Group: group, Consumer: "m1", Concurrency: concurrency,
		Block: 50 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	ended := make(chan error, 1)
	began := time.Now()
	if bc.partitions == 0 {
		w, err := pelican.NewWorker(c, options)
		if err != nil {
			return 0, err
		}
		go func() { _, err := w.Run(runCtx, handler); ended <- err }()
	} else {
		w, err := pelican.NewTopicWorker(ctx, c, pelican.TopicWorkerOptions{WorkerOptions: options,
			MembershipTTL: 3 * time.Second})
		if err != nil {
			return 0, err
		}
		go func() { _, err := w.Run(runCtx, handler); ended <- err }()
	}
	select {
	case <-everySeen:
	case err := <-ended:
		return 0, fmt.Errorf("%s: the worker ended with %d of %d messages seen: %v", stream, seen.Load(), n, err)
	case <-time.After(timeout):
		return 0, fmt.Errorf("%s: %d of %d messages seen after %v", stream, seen.Load(), n, timeout)
	}
	took := time.Since(began)
	stop()
	if err := <-ended; err != nil {
		return 0, err
	}
	once := 0
	for i := range sights {
		if sights[i].Load() == 1 {
			once++
		}
	}
	bc.seenAgain += n - once
	return float64(once) / took.Seconds(), nil
}

func median(values []float64) float64 {
	sorted := slices.Sorted(slices.Values(values))
	return sorted[len(sorted)/2]
}

func main() {
	n := flag.Int("n", 20000, "messages a case")
	rounds := flag.Int("rounds", 3, "rounds, each running every case in turn")
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
	noRetries := *options
	noRetries.MaxRetries = -1
	publisher := redis.NewClient(&noRetries)
	defer publisher.Close()
	info, err := c.InfoMap(ctx, "server").Result()
	if err != nil {
		log.Fatal(err)
	}

	cases := []*benchCase{
		{label: "one stream", ordering: pelican.OrderingNone},
		{label: "topic, 1 partition PerKey", partitions: 1, ordering: pelican.OrderingPerKey},
		{label: "topic, 8 partitions PerKey", partitions: 8, ordering: pelican.OrderingPerKey},
		{label: "topic, 8 partitions None", partitions: 8, ordering: pelican.OrderingNone},
	}
	fmt.Printf("%d messages a case, %d keys, one member / worker at concurrency %d, redis-server %s; "+
		"medians of %d rounds, each running every case in turn\n",
		*n, keys, concurrency, info["Server"]["redis_version"], *rounds)
	for round := range *rounds {
		for i, bc := range cases {
			stream := fmt.Sprintf("topic-bench-%d-%d-%d", os.Getpid(), round, i)
			if err := declare(c, stream, bc); err != nil {
				log.Fatal(err)
			}
			published, err := publish(publisher, stream, bc, *n)
			if err != nil {
				log.Fatal(err)
			}
			consumed, err := consume(c, stream, bc, *n)
			if err != nil {
				log.Fatal(err)
			}
			bc.published, bc.consumed = append(bc.published, published), append(bc.consumed, consumed)
			fmt.Fprintf(os.Stderr, "round %d: %s: publish %.0f msgs/s, consume %.0f msgs/s\n", round+1, bc.label,
				published, consumed)
		}
	}
	fmt.Println("| case | publish msgs/s | consume msgs/s | messages seen more than once |")
	fmt.Println("| --- | --- | --- | --- |")
	for _, bc := range cases {
		fmt.Printf("| %s | %.0f | %.0f | %d |\n", bc.label, median(bc.published), median(bc.consumed), bc.seenAgain)
	}
}
