// A go-redis worker whose handler may be slower than the group's minIdle, kept from looking abandoned with the
// lease call Pelican documents: the contract's `lease.lua` (the owner's `XCLAIM ... JUSTID` on the messages it is
// still handling, only those still its own: idle back to 0, the delivery count unchanged; and the worker's heartbeat,
// which `strategy: Reassign` reads), every third of the `minIdleMs` the operator publishes in
// `{T}:pelican:<stream>:<group>:settings`, also with nothing in flight. The Go twin of slow_worker.py. A library does
// all this and the rest of the contract: sdks/go.
//
//	go run . redis://127.0.0.1:6379 '{orders}:events' billing worker-1 12 100
//
// handles messages (each takes HANDLE_SECONDS, here 12) until it handled COUNT (here 100) or ran 120 s, printing
// `handled <entry id>` for every run of the handler.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// hashTag is the part of a key Redis Cluster hashes: the first non-empty {...}, else the whole key.
func hashTag(key string) string {
	if start := strings.Index(key, "{"); start >= 0 {
		if end := strings.Index(key[start+1:], "}"); end > 0 {
			return key[start+1 : start+1+end]
		}
	}
	return key
}

// leaseScript is the contract's lease.lua, read from the repository this example is built in.
func leaseScript() *redis.Script {
	_, source, _, _ := runtime.Caller(0)
	text, err := os.ReadFile(filepath.Join(filepath.Dir(source), "..", "..", "..", "contract", "scripts", "lease.lua"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	return redis.NewScript(string(text))
}

func main() {
	if len(os.Args) != 7 {
		fmt.Fprintln(os.Stderr, "usage: slow-worker URL STREAM GROUP CONSUMER HANDLE_SECONDS COUNT")
		os.Exit(2)
	}
	url, stream, group, consumer := os.Args[1], os.Args[2], os.Args[3], os.Args[4]
	seconds, _ := strconv.ParseFloat(os.Args[5], 64)
	count, _ := strconv.Atoi(os.Args[6])
	options, err := redis.ParseURL(url)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	ctx, rdb := context.Background(), redis.NewClient(options)
	keyPrefix := fmt.Sprintf("{%s}:pelican:%s:%s:", hashTag(stream), stream, group)
	settings, _ := rdb.HGetAll(ctx, keyPrefix+"settings").Result()
	lease := leaseScript()
	// Three leases per minIdle; every second when no policy publishes settings.
	minIdle, err := strconv.Atoi(settings["minIdleMs"])
	if err != nil {
		minIdle = 3000
	}
	every := time.Duration(minIdle) * time.Millisecond / 3

	var lock sync.Mutex
	inFlight, handled := map[string]bool{}, 0
	handle := func(id string) {
		time.Sleep(time.Duration(seconds * float64(time.Second))) // the slow part of the handler
		rdb.XAck(ctx, stream, group, id)
		lock.Lock()
		defer lock.Unlock()
		delete(inFlight, id)
		handled++
		fmt.Println("handled", id)
	}

	deadline, lastLease := time.Now().Add(120*time.Second), time.Now()
	for time.Now().Before(deadline) {
		lock.Lock()
		done := handled >= count
		lock.Unlock()
		if done {
			break
		}
		streams, err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{
			Group: group, Consumer: consumer, Streams: []string{stream, ">"}, Count: 16, Block: 100 * time.Millisecond,
		}).Result()
		if err != nil && err != redis.Nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		for _, s := range streams {
			for _, message := range s.Messages {
				lock.Lock()
				inFlight[message.ID] = true
				lock.Unlock()
				go handle(message.ID)
			}
		}
		if time.Since(lastLease) >= every {
			lastLease = time.Now()
			lock.Lock()
			ids := make([]string, 0, len(inFlight))
			for id := range inFlight {
				ids = append(ids, id)
			}
			lock.Unlock()
			// The lease (EVALSHA, EVAL the first time): Pelican's pass never takes an entry whose idle time stays
			// below minIdle, and the heartbeat it writes is how Reassign knows this worker is alive. At most 100 ids.
			args := append([]any{group, consumer}, toAny(ids[:min(len(ids), 100)])...)
			lease.Run(ctx, rdb, []string{stream, keyPrefix + "consumers"}, args...)
		}
	}
}

func toAny(ids []string) []any {
	out := make([]any, len(ids))
	for i, id := range ids {
		out[i] = id
	}
	return out
}
