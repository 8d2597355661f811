package pelican

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// One partition of an ordering: PerKey topic (contract/README.md, "Order per key"): entries dispatched in id order
// into per-key queues, at most one entry of a key in flight, different keys side by side up to the concurrency. A
// failure or a retry holds its key: the entry stays pending, this worker's, and runs again in place after the
// backoff, its delivery counted on the server first (XCLAIM ... RETRYCOUNT). At the cap it is left to the
// operator's pass (DeadLetterOnly on such a topic), which dead-letters it once idle; the key goes on once it left
// the pending list.

// heldPerSlot is how many entries are held at once per unit of concurrency: read ahead, so that keys behind a slow
// one still run.
const heldPerSlot = 4

// held is an entry read and not yet done, terminal or dead-lettered.
type held struct {
	message Message
	failed  bool // it failed here: its next run counts a delivery first
	capped  bool // at the cap: no longer leased, left to the pass
}

// ran is how one run of a key's head ended; gone: the entry was no longer this worker's when its run was to count
// a delivery.
type ran struct {
	key     string
	outcome Outcome
	err     error
	gone    bool
	took    time.Duration // how long the handler ran
}

// next is what a key does after its head's run.
type next int

const (
	goOn     next = iota // the head left: the key's next entry may start
	wait                 // the head runs again in place after the backoff
	atTheCap             // left to the pass: the key waits until it left the pending list
)

// inOrder is the state of one PerKey partition; only runInOrder's goroutine touches it.
type inOrder struct {
	w       *Worker // the partition's plain worker, for its keys, leases, give-backs and counters
	spacing spacing
	queues  map[string][]*held
	ready   []string
	waiting map[string]time.Time
	room    chan struct{} // a token per entry held
}

// keyOf is an entry's key: its KeyField, or the entry alone.
func keyOf(m Message) string {
	if key, ok := m.Key(); ok {
		return "k" + key
	}
	return "i" + m.ID
}

// runInOrder takes the partition's pending list over, then runs it in order per key until ctx ends; lost (set
// before ctx is cancelled) says the partition is another's now: nothing more is written. fresh false: the
// membership may have expired, no entry starts and the partition stops as lost.
func runInOrder(ctx context.Context, client redis.UniversalClient, opt WorkerOptions, partition int, sp spacing,
	fresh func() bool, lost *atomic.Bool, handler Handler,
) (Stats, error) {
	w, err := NewWorker(client, opt)
	if err != nil {
		return Stats{}, err
	}
	w.contract, w.partition = []int{TopicContractVersion}, partition
	rctx := context.WithoutCancel(ctx)
	if err := takeOver(rctx, client, opt.Stream, opt.Group, w.opt.Consumer); err != nil {
		return Stats{}, err
	}
	if err := w.readSettings(rctx); err != nil {
		return Stats{}, err
	}
	settings := w.settings.Load()
	if settings == nil {
		return Stats{}, fmt.Errorf("pelican: partition %s has no settings of the topic's contract", opt.Stream)
	}
	concurrency := w.opt.Concurrency
	o := &inOrder{w: w, spacing: sp, queues: map[string][]*held{}, waiting: map[string]time.Time{},
		room: make(chan struct{}, concurrency*heldPerSlot)}
	readCtx, stopReading := context.WithCancel(ctx)
	defer stopReading()
	reads := make(chan []Message)
	leftover := make(chan []Message, 1)
	go o.read(readCtx, rctx, reads, leftover)
	handlerCtx, cancelHandlers := context.WithCancel(rctx)
	defer cancelHandlers()
	results := make(chan ran, concurrency) // never blocks a handler's goroutine, whoever still listens
	running := 0
	leases := time.NewTicker(LeaseInterval(settings))
	defer leases.Stop()
	due := time.NewTimer(time.Hour)
	defer due.Stop()
loop:
	for {
		for running < concurrency && len(o.ready) > 0 {
			if fresh != nil && !fresh() {
				w.log.Warn("no membership heartbeat answered within the ttl: the partition is stopped")
				lost.Store(true)
				break loop
			}
			key := o.ready[0]
			o.ready = o.ready[1:]
			head := o.queues[key][0]
			running++
			go func() { results <- o.run(handlerCtx, rctx, handler, key, head) }()
		}
		if at, ok := o.nextDue(); ok {
			due.Reset(time.Until(at))
		}
		select {
		case <-ctx.Done():
			break loop
		case found := <-reads:
			o.enqueue(found)
		case r := <-results:
			running--
			o.after(rctx, r)
		case <-due.C:
			now := time.Now()
			for key, at := range o.waiting {
				if !at.After(now) {
					delete(o.waiting, key)
					o.ready = append(o.ready, key)
				}
			}
		case <-leases.C:
			o.hold(rctx)
		}
	}
	stopReading()
	if lost.Load() {
		// Another's now: handlers still running are cancelled, nothing of this partition is written.
		w.log.Warn("partition lost: stopped at once, its messages left to the new owner")
		return w.Stats(), nil
	}
	// Handlers running finish within the grace and their outcomes are written; everything else held is given back
	// uncounted, its key's order kept for the next owner (it takes the pending list in id order).
	grace := time.NewTimer(w.opt.ShutdownGrace)
	defer grace.Stop()
finish:
	for ; running > 0; running-- {
		select {
		case r := <-results:
			o.after(rctx, r)
		case <-grace.C:
			break finish
		}
	}
	cancelHandlers()
	var left []string
	for _, m := range <-leftover {
		left = append(left, m.ID)
	}
	for _, queue := range o.queues {
		for _, h := range queue {
			if !h.capped {
				left = append(left, h.message.ID)
			}
		}
	}
	given, err := w.giveBack(rctx, left, w.retryAfter(), true)
	w.abandoned.Add(uint64(given))
	w.meter.abandonedGiven(given)
	if err != nil {
		w.log.Warn("could not give back what was left: it is retried after minIdle", "left", len(left), "error", err)
	}
	return w.Stats(), nil
}

// read reads the partition while there is room: its own pending list first (what it took over), then new entries.
// What a read brings after ctx ended goes to leftover, to be given back.
func (o *inOrder) read(ctx, rctx context.Context, reads chan<- []Message, leftover chan<- []Message) {
	w := o.w
	cursor := "0"
	var last []Message
	defer func() { leftover <- last }()
	for {
		select {
		case o.room <- struct{}{}:
		case <-ctx.Done():
			return
		}
		count := 1
		for full := false; count < idBatch && !full; {
			select {
			case o.room <- struct{}{}:
				count++
			default:
				full = true
			}
		}
		var found []Message
		var err error
		if cursor != "" {
			var entries []Message
			entries, err = readReply(xReadGroup(rctx, w.client, w.opt.Group, w.opt.Consumer, w.opt.Stream, cursor,
				count, -1))
			if err == nil && len(entries) == 0 {
				cursor = ""
			} else if err == nil {
				cursor = entries[len(entries)-1].ID
				found = payloads(entries)
			}
		} else {
			found, err = readReply(xReadGroup(rctx, w.client, w.opt.Group, w.opt.Consumer, w.opt.Stream, ">", count,
				w.opt.Block))
			found = payloads(found)
		}
		for range count - len(found) {
			<-o.room
		}
		if err != nil {
			w.log.Warn("read failed; retrying", "error", err)
			sleep(ctx, 500*time.Millisecond)
			continue
		}
		for i := range found {
			found[i].Partition = w.partition
		}
		if len(found) == 0 {
			continue
		}
		select {
		case reads <- found:
		case <-ctx.Done():
			last = found
			return
		}
	}
}

// enqueue puts entries read, in id order, behind their keys.
func (o *inOrder) enqueue(found []Message) {
	for _, m := range found {
		key := keyOf(m)
		if len(o.queues[key]) == 0 {
			o.ready = append(o.ready, key)
		}
		o.queues[key] = append(o.queues[key], &held{message: m})
	}
}

func (o *inOrder) nextDue() (time.Time, bool) {
	var first time.Time
	for _, at := range o.waiting {
		if first.IsZero() || at.Before(first) {
			first = at
		}
	}
	return first, !first.IsZero()
}

// run runs a key's head: a run again in place counts its delivery on the server first.
func (o *inOrder) run(hctx, rctx context.Context, handler Handler, key string, h *held) ran {
	if h.failed && !o.countDelivery(rctx, h.message.ID) {
		return ran{key: key, gone: true}
	}
	o.w.meter.started(1)
	began := time.Now()
	outcome, err := o.w.handle(hctx, handler, h.message)
	return ran{key: key, outcome: outcome, err: err, took: time.Since(began)}
}

// after writes the outcome of a key's head, and lets the key go on, wait or stay at the cap.
func (o *inOrder) after(ctx context.Context, r ran) {
	switch then, deliveries := o.settle(ctx, r); then {
	case goOn:
		o.pop(r.key)
	case wait:
		o.waiting[r.key] = time.Now().Add(o.spacing.after(o.w.minIdle(), deliveries))
	case atTheCap:
	}
}

// pop takes the key's head out; its next entry, if any, is ready.
func (o *inOrder) pop(key string) {
	<-o.room
	if queue := o.queues[key][1:]; len(queue) > 0 {
		o.queues[key] = queue
		o.ready = append(o.ready, key)
	} else {
		delete(o.queues, key)
	}
}

// settle writes the outcome of a key's head; a failure or a retry answers the entry's deliveries so far.
func (o *inOrder) settle(ctx context.Context, r ran) (next, int64) {
	w := o.w
	h := o.queues[r.key][0]
	id := h.message.ID
	if r.gone {
		return goOn, 0
	}
	w.meter.landed(1)
	switch {
	case r.err == nil && r.outcome.kind == doneOutcome:
		pipe := w.client.Pipeline()
		ack := pipe.XAck(ctx, w.opt.Stream, w.opt.Group, id)
		if h.failed {
			pipe.HDel(ctx, w.errorsKey, id)
		}
		_, _ = pipe.Exec(ctx)
		if err := ack.Err(); err != nil {
			// The key goes on: the entry stays pending, and whoever takes the partition over runs it again.
			w.writeFailed("XACK", []handlerRun{{id: id, ran: r.took}}, err)
		} else {
			w.count(countedDone, r.took, nil)
		}
		return goOn, 0
	case r.err == nil && r.outcome.kind == terminalOutcome:
		w.ackTerminal(ctx, id, r.outcome.reason, r.took)
		return goOn, 0
	case r.err == nil:
		w.count(countedRetried, r.took, nil)
	default:
		text := cutUTF8(r.err.Error(), ErrorTextMax)
		w.log.Warn("handler failed; run again in place after the backoff", "entry_id", id, "error", text)
		w.count(countedFailed, r.took, r.err)
		if err := w.client.HSet(ctx, w.errorsKey, id, text).Err(); err != nil {
			w.log.Warn("could not record the message's last error", "entry_id", id, "error", err)
		}
	}
	h.failed = true
	deliveries, pending, err := o.deliveries(ctx, id)
	switch {
	case err != nil:
		w.log.Warn("could not read the delivery count; run again after the backoff", "entry_id", id, "error", err)
		return wait, deliveries
	case !pending: // no longer this worker's (the pass took it, the partition moved): the key goes on
		return goOn, 0
	case w.Settings() != nil && w.Settings().MaxDeliveries > 0 && deliveries >= int64(w.Settings().MaxDeliveries):
		w.log.Info("at the cap: left to the operator's pass, which dead-letters it; its key waits",
			"entry_id", id, "deliveries", deliveries)
		h.capped = true
		return atTheCap, deliveries
	}
	return wait, deliveries
}

// hold extends the leases of every entry held but those at the cap (the consumer's heartbeat too), and lets the keys
// whose capped head left the pending list go on.
func (o *inOrder) hold(ctx context.Context) {
	var leased []string
	var capped []string
	for key, queue := range o.queues {
		for _, h := range queue {
			if !h.capped {
				leased = append(leased, h.message.ID)
			}
		}
		if queue[0].capped {
			capped = append(capped, key)
		}
	}
	if _, err := o.w.lease(ctx, leased); err != nil {
		o.w.log.Warn("could not extend the leases; retrying at the next tick", "error", err)
		return
	}
	for _, key := range capped {
		if _, pending, err := o.deliveries(ctx, o.queues[key][0].message.ID); err == nil && !pending {
			o.pop(key)
		}
	}
}

// deliveries is the entry's delivery count while it is this consumer's; pending false once it is not
// (acknowledged, dead-lettered, another's).
func (o *inOrder) deliveries(ctx context.Context, id string) (count int64, pending bool, err error) {
	w := o.w
	p, err := w.client.XPendingExt(ctx, &redis.XPendingExtArgs{
		Stream: w.opt.Stream, Group: w.opt.Group, Start: id, End: id, Count: 1, Consumer: w.opt.Consumer,
	}).Result()
	if err != nil || len(p) == 0 {
		return 0, false, err
	}
	return p[0].RetryCount, true, nil
}

// countDelivery counts the delivery of a run in place (XCLAIM ... RETRYCOUNT n+1 JUSTID, only while the entry is
// this consumer's); false when it no longer is.
func (o *inOrder) countDelivery(ctx context.Context, id string) bool {
	w := o.w
	deliveries, pending, err := o.deliveries(ctx, id)
	if err != nil || !pending {
		return false
	}
	claimed, err := w.client.Do(ctx, "XCLAIM", w.opt.Stream, w.opt.Group, w.opt.Consumer, 0, id, "RETRYCOUNT",
		deliveries+1, "JUSTID").Slice()
	return err == nil && len(claimed) > 0
}
