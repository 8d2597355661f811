// A go-redis worker whose handler may be slower than the group's minIdle, kept from looking abandoned with the
// lease call Pelican documents: the owner's `XCLAIM <stream> <group> <consumer> 0 <ids...> JUSTID` on the messages
// it is still handling (idle back to 0, the delivery count unchanged), every third of the `minIdleMs` the operator
// publishes in `{T}:pelican:<stream>:<group>:settings`. The Go twin of slow_worker.py.
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
	settings, _ := rdb.HGetAll(ctx, fmt.Sprintf("{%s}:pelican:%s:%s:settings", hashTag(stream), stream, group)).Result()
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
			if len(ids) > 0 {
				// The lease: Pelican's pass never takes an entry whose idle time stays below minIdle.
				rdb.XClaimJustID(ctx, &redis.XClaimArgs{
					Stream: stream, Group: group, Consumer: consumer, MinIdle: 0, Messages: ids,
				})
			}
		}
	}
}
