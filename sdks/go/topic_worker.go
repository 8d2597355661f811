package pelican

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// A topic's worker (contract/README.md, "Topics (contract version 2)"): a member of the topic's group that owns the
// partitions membership.lua assigns it and runs a worker on each: its pending list taken over first, then new
// entries. Released partitions are finished and given back (as on SIGTERM); lost ones are dropped at once, no
// outcome written. On an ordering: PerKey topic each partition runs in order per key (in_order.go).

// DefaultMembershipTTL is how long a membership lives without a heartbeat unless TopicWorkerOptions say otherwise.
const DefaultMembershipTTL = 10 * time.Second

// TopicWorkerOptions configure a TopicWorker: WorkerOptions as for a stream, its Stream the topic (the policy's
// spec.stream), its Consumer the member's name (the consumer on every partition it owns), its Concurrency each
// partition's.
type TopicWorkerOptions struct {
	WorkerOptions
	// MembershipTTL is how long the membership lives without a heartbeat (1 s .. 24 h; default 10 s): a heartbeat
	// every third of it. A worker whose heartbeats go unanswered that long stops every partition it had. Keep it
	// well above the pauses the application can have (a long garbage collection, a stopped process).
	MembershipTTL time.Duration
}

// Ordering is how a topic's entries are handled, its settings' ordering.
type Ordering string

const (
	// OrderingNone: entries run as on a stream, up to the concurrency at once, retried by the operator's pass.
	OrderingNone Ordering = "None"
	// OrderingPerKey: the entries of one key run one at a time, in id order; a failure runs again in place.
	OrderingPerKey Ordering = "PerKey"
)

// OrderingError: the topic's settings name an ordering this library does not know.
type OrderingError struct {
	Topic, Ordering string
}

func (e *OrderingError) Error() string {
	return fmt.Sprintf("pelican: topic %q has ordering %q, which this library does not know (None, PerKey): "+
		"upgrade the library", e.Topic, e.Ordering)
}

// spacing is how PerKey retries are spaced in place: minIdle * factor^(n-1), at most max (0: no most).
type spacing struct {
	factor float64
	max    time.Duration
}

func (s spacing) after(minIdle time.Duration, deliveries int64) time.Duration {
	wait := float64(minIdle) * math.Pow(s.factor, float64(max(deliveries-1, 0)))
	d := time.Duration(min(wait, float64(24*time.Hour))) // no overflow
	if s.max > 0 {
		d = min(d, s.max)
	}
	return d
}

// TopicWorker is a member of a topic's group. Made by NewTopicWorker; Run runs it once.
type TopicWorker struct {
	client     redis.UniversalClient
	opt        TopicWorkerOptions
	log        *slog.Logger
	partitions int
	ordering   Ordering
	spacing    spacing
	started    atomic.Bool
	// beatAt is when the last answered heartbeat was sent (monotonic): past the ttl, no partition starts a message.
	beatAt atomic.Pointer[time.Time]
	// membership keys
	keys []string
}

// NewTopicWorker checks the options and reads the topic's settings ({T}:pelican:T:<group>:settings),
// contractVersion first. It refuses, naming what is wrong: a *NotATopicError (no policy with spec.partitions), a
// *TopicContractError (another contract), an *OrderingError, a MembershipTTL out of range.
func NewTopicWorker(ctx context.Context, client redis.UniversalClient, opt TopicWorkerOptions) (*TopicWorker, error) {
	opt.MembershipTTL = orDefault(opt.MembershipTTL, DefaultMembershipTTL)
	if opt.MembershipTTL < time.Second || opt.MembershipTTL > 24*time.Hour {
		return nil, fmt.Errorf("pelican: TopicWorkerOptions.MembershipTTL must be 1s .. 24h, got %v",
			opt.MembershipTTL)
	}
	// The options of every partition's worker, checked once here.
	if _, err := NewWorker(client, opt.WorkerOptions); err != nil {
		return nil, err
	}
	if opt.Consumer == "" {
		opt.Consumer = PodName()
	}
	topic, group := opt.Stream, opt.Group
	settings, err := client.HGetAll(ctx, SettingsKey(topic, group)).Result()
	if err != nil {
		return nil, fmt.Errorf("pelican: could not read the settings of topic %q: %w", topic, err)
	}
	if len(settings) == 0 {
		return nil, &NotATopicError{Topic: topic, Group: group}
	}
	partitions, err := topicPartitions(topic, group, settings)
	if err != nil {
		return nil, err
	}
	w := &TopicWorker{client: client, opt: opt, partitions: partitions, ordering: OrderingNone,
		keys: []string{MembersKey(topic, group), OwnersKey(topic, group), EpochsKey(topic, group)}}
	switch ordering := settings["ordering"]; ordering {
	case "", string(OrderingNone):
	case string(OrderingPerKey):
		w.ordering = OrderingPerKey
		w.spacing.factor = 1
		if f, err := strconv.ParseFloat(settings["backoffFactor"], 64); err == nil && f >= 1 {
			w.spacing.factor = f
		}
		if m, err := decimal(settings["backoffMaxMs"]); err == nil {
			w.spacing.max = time.Duration(m) * time.Millisecond
		}
	default:
		return nil, &OrderingError{Topic: topic, Ordering: ordering}
	}
	if opt.Logger == nil {
		opt.Logger = slog.Default()
	}
	w.log = opt.Logger.With("topic", topic, "group", group, "member", opt.Consumer)
	w.opt = opt
	return w, nil
}

// Partitions is the topic's N.
func (w *TopicWorker) Partitions() int { return w.partitions }

// Ordering is the topic's ordering, as its settings say.
func (w *TopicWorker) Ordering() Ordering { return w.ordering }

// assignment is what a heartbeat answers: the partitions owned with their epochs, those to release.
type assignment struct {
	owned   map[int]int64
	release []int
}

// heartbeat runs membership.lua: renews the membership, frees the partitions released, answers the assignment.
// leaving: the member is done and leaves the group.
func (w *TopicWorker) heartbeat(ctx context.Context, leaving bool, released []int) (assignment, error) {
	flag := 0
	if leaving {
		flag = 1
	}
	args := []any{w.opt.Consumer, w.opt.MembershipTTL.Milliseconds(), w.partitions, flag}
	for _, p := range released {
		args = append(args, p)
	}
	reply, err := membershipScript.Run(ctx, w.client, w.keys, args...).Slice()
	if err != nil {
		return assignment{}, err
	}
	if len(reply) != 3 {
		return assignment{}, fmt.Errorf("pelican: unexpected membership reply %v", reply)
	}
	a := assignment{owned: map[int]int64{}}
	owned, _ := reply[0].([]any)
	for _, pair := range owned {
		p, _ := pair.([]any)
		if len(p) != 2 {
			return assignment{}, fmt.Errorf("pelican: unexpected owned partition %v", pair)
		}
		partition, _ := p[0].(int64)
		epoch, _ := p[1].(int64)
		a.owned[int(partition)] = epoch
	}
	release, _ := reply[1].([]any)
	for _, r := range release {
		partition, _ := r.(int64)
		a.release = append(a.release, int(partition))
	}
	return a, nil
}

// fresh tells whether the last answered heartbeat was sent less than the ttl ago.
func (w *TopicWorker) fresh() bool {
	at := w.beatAt.Load()
	return at != nil && time.Since(*at) < w.opt.MembershipTTL
}

// ownedPartition is a partition's worker while it runs.
type ownedPartition struct {
	partition int
	epoch     int64
	stop      context.CancelFunc // as on SIGTERM: finish within the grace, give back the rest
	abort     func()             // lost: at once, no outcome written
	releasing bool
}

// ended is how a partition's worker ended.
type ended struct {
	run   *ownedPartition
	stats Stats
	err   error
}

// Run joins the group, heartbeats every MembershipTTL/3 and runs a worker on each partition it owns, until ctx is
// cancelled (SIGTERM: signal.NotifyContext); then it stops them all as a Worker stops (handlers finish within the
// grace, the rest is given back) and leaves the group. It returns every partition's counts summed; an error when
// the first heartbeat fails (PELICAN_TOO_MANY_MEMBERS included), or a *ContractVersionError when the settings change
// to a contract this library does not know (after the shutdown).
func (w *TopicWorker) Run(ctx context.Context, handler Handler) (Stats, error) {
	if handler == nil {
		return Stats{}, errors.New("pelican: Run needs a handler")
	}
	if !w.started.CompareAndSwap(false, true) {
		return Stats{}, errors.New("pelican: this TopicWorker already ran: create a new one")
	}
	rctx := context.WithoutCancel(ctx)
	owned := map[int]*ownedPartition{}
	ends := make(chan ended)
	live := 0 // partition workers not yet ended
	var released []int
	var stats Stats
	var failure error
	beats := time.NewTimer(0)
	defer beats.Stop()
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case e := <-ends:
			live--
			stats = addStats(stats, e.stats)
			if owned[e.run.partition] != e.run {
				continue // lost, and aborted
			}
			delete(owned, e.run.partition)
			var version *ContractVersionError
			if errors.As(e.err, &version) {
				failure = e.err
				break loop
			}
			if e.err != nil {
				w.log.Warn("the partition's worker could not run; started again at the next heartbeat",
					"partition", e.run.partition, "error", e.err)
			}
			if e.run.releasing {
				released = append(released, e.run.partition)
				beats.Reset(0) // said at once
			}
		case <-beats.C:
			sent := time.Now()
			a, err := w.heartbeat(rctx, false, released)
			switch {
			case err == nil:
				released = nil
				w.beatAt.Store(&sent)
				live += w.follow(rctx, a, owned, handler, ends)
			case w.beatAt.Load() == nil:
				return stats, fmt.Errorf("pelican: could not join the group of topic %q: %w", w.opt.Stream, err)
			default:
				w.log.Warn("membership heartbeat failed; retrying", "error", err)
				if !w.fresh() && len(owned) > 0 {
					w.log.Warn("no heartbeat answered within the ttl: the partitions may be another's, stopped at once")
					for p, r := range owned {
						r.abort()
						delete(owned, p)
					}
				}
			}
			beats.Reset(w.opt.MembershipTTL / 3)
		}
	}
	// Every partition stops as a worker does on SIGTERM, then the member leaves.
	for _, r := range owned {
		r.stop()
	}
	for ; live > 0; live-- {
		stats = addStats(stats, (<-ends).stats)
	}
	if _, err := w.heartbeat(rctx, true, nil); err != nil {
		w.log.Warn("could not leave the group: its partitions move when the membership expires", "error", err)
	} else {
		w.log.Info("left the topic's group")
	}
	return stats, failure
}

// follow starts a worker on each partition newly owned (or owned under a new epoch: it was lost and came back),
// drops the ones lost at once, and stops the ones to release as on SIGTERM. It answers how many it started.
func (w *TopicWorker) follow(ctx context.Context, a assignment, owned map[int]*ownedPartition, handler Handler,
	ends chan<- ended,
) int {
	for p, r := range owned {
		if epoch, ok := a.owned[p]; !ok || epoch != r.epoch {
			w.log.Warn("partition lost (its membership expired): stopped at once", "partition", p)
			r.abort()
			delete(owned, p)
		}
	}
	started := 0
	for p, epoch := range a.owned {
		if owned[p] != nil {
			continue
		}
		r, run := w.startPartition(ctx, p, epoch, handler)
		owned[p] = r
		started++
		go func() {
			stats, err := run()
			ends <- ended{run: r, stats: stats, err: err}
		}()
		w.log.Info("partition taken", "partition", p, "epoch", epoch)
	}
	for _, p := range a.release {
		if r := owned[p]; r != nil && !r.releasing {
			w.log.Info("releasing the partition: its messages in flight finish first", "partition", p)
			r.releasing = true
			r.stop()
		}
	}
	return started
}

// startPartition makes partition p's worker: run takes the pending list over, then runs until stopped.
func (w *TopicWorker) startPartition(ctx context.Context, p int, epoch int64, handler Handler) (*ownedPartition, func() (Stats, error)) {
	opt := w.opt.WorkerOptions
	opt.Stream = PartitionStream(w.opt.Stream, p)
	runCtx, stop := context.WithCancel(ctx)
	r := &ownedPartition{partition: p, epoch: epoch, stop: stop}
	if w.ordering == OrderingPerKey {
		lost := &atomic.Bool{}
		r.abort = func() { lost.Store(true); stop() }
		return r, func() (Stats, error) {
			defer stop()
			return runInOrder(runCtx, w.client, opt, p, w.spacing, w.fresh, lost, handler)
		}
	}
	worker, err := NewWorker(w.client, opt)
	if err != nil { // the options were checked in NewTopicWorker
		r.abort = stop
		return r, func() (Stats, error) { return Stats{}, err }
	}
	worker.contract, worker.partition, worker.fresh, worker.cancelRun = []int{TopicContractVersion}, p, w.fresh, stop
	r.abort = worker.abort
	return r, func() (Stats, error) {
		defer stop()
		if err := takeOver(context.WithoutCancel(runCtx), w.client, opt.Stream, opt.Group, opt.Consumer); err != nil {
			return Stats{}, err
		}
		return worker.Run(runCtx, handler)
	}
}

// takeOverBatch is the most entries one XAUTOCLAIM of a take-over moves.
const takeOverBatch = 100

// takeOver moves the partition's whole pending list to this member (XAUTOCLAIM ... 0 ... JUSTID, a page at a time
// from the cursor it answers): the previous owner's entries, this member's own from before, those given back
// without an owner. The first read of the own pending list then hands them out in id order, each counted as one
// delivery there (JUSTID counts none).
func takeOver(ctx context.Context, client redis.UniversalClient, stream, group, consumer string) error {
	cursor := "0-0"
	for {
		reply, err := client.Do(ctx, "XAUTOCLAIM", stream, group, consumer, 0, cursor, "COUNT", takeOverBatch,
			"JUSTID").Slice()
		if err != nil {
			return err
		}
		if len(reply) == 0 {
			return nil
		}
		if cursor, _ = reply[0].(string); cursor == "0-0" || cursor == "" {
			return nil
		}
	}
}

func addStats(total, s Stats) Stats {
	total.Done += s.Done
	total.Terminal += s.Terminal
	total.Failed += s.Failed
	total.Retried += s.Retried
	total.Abandoned += s.Abandoned
	return total
}
