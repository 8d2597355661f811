package pelican

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// WorkerOptions configure a Worker. Zero fields take their defaults.
type WorkerOptions struct {
	Stream string
	Group  string
	// Consumer is the consumer name; default PodName(), which spec.consumers.pods matches.
	Consumer string
	// Concurrency is how many handlers run at once; default 16.
	Concurrency int
	// Block is how long one read waits for new entries; default 1 s (the zero value: never BLOCK 0, which waits for
	// ever). At least 1 ms and below the client's ReadTimeout (5 s by default), which the read waits for: NewWorker
	// refuses other values. A shutdown awaits the read in flight.
	Block time.Duration
	// ShutdownGrace is how long handlers may still run once Run's context is cancelled, before what is left is
	// given back; default 20 s (below Kubernetes' default terminationGracePeriodSeconds of 30). Negative: none.
	ShutdownGrace time.Duration
	// MaxHandling is how long a handler's lease is extended; past it the worker warns once and the operator's pass
	// may retry the message. Default 30 min.
	MaxHandling time.Duration
	// Logger receives the worker's warnings; default slog.Default().
	Logger *slog.Logger
}

// Stats are what a worker did so far.
type Stats struct {
	Done     uint64
	Terminal uint64
	// Failed counts handler errors and panics, and outcomes the server refused to record: left pending for the
	// operator's retry.
	Failed uint64
	// Retried counts Retry outcomes: given back to the operator's pass, the delivery counted.
	Retried uint64
	// Abandoned counts messages given back on shutdown (still running at the end of the grace, or read after the
	// stop), the delivery not counted.
	Abandoned uint64
	InFlight  int
}

const (
	// idBatch is the most ids one lease or give-back call carries.
	idBatch = 100
	// handOverMargin: an entry that failed here counts as handed back when its idle time is shorter than the time
	// since it failed by at least this (the operator hands over only entries idle minIdle, at least a second).
	handOverMargin = time.Second
	// errorsRemembered bounds the ids whose recorded error is removed with their ACK: a requeued message comes
	// back under a new id, so an old id may never be acknowledged here.
	errorsRemembered = 10_000
)

// Worker reads Stream as Consumer of Group and hands each message to a handler: the dispatch layer of the worker
// contract, the only place that acknowledges.
type Worker struct {
	client redis.UniversalClient
	opt    WorkerOptions
	log    *slog.Logger

	settingsKey, terminalKey, errorsKey, consumersKey string
	processName                                       string // the span of a handler run (trace.go)

	settings        atomic.Pointer[Settings]
	settingsProblem string // the last problem with the settings reported, so it is said once; lease goroutine only

	done, terminal, failed, retried, abandoned atomic.Uint64
	// meter records the same counts through OpenTelemetry's API (meter.go).
	meter   *workerMeter
	started atomic.Bool
	// versionMet: a lease tick met a contract version this library does not know; no handler starts after it.
	versionMet atomic.Bool

	// A topic's partition (TopicWorker): the contract versions read (TopicContractVersion), the partition its
	// messages carry (-1 for a plain stream), fresh (false once the membership may have expired: no handler
	// starts), and aborted: the partition was lost, its shutdown writes no outcome and gives nothing back.
	contract  []int
	partition int
	fresh     func() bool
	aborted   atomic.Bool
	cancelRun context.CancelFunc

	mu       sync.Mutex
	inFlight map[string]*flight
	settling int // entries in flight whose outcome is being written
	// wakeAt is how many free slots the read loop waits for; 0: the shutdown waits for every change.
	wakeAt int
	// failedHere: entry id -> when its handler failed or asked for a retry here; the pass retries it, never this
	// worker (unless the pass hands it back).
	failedHere     map[string]time.Time
	errorsRecorded map[string]struct{}
	ownPELRead     bool // the read loop read its own PEL to the end: hand-overs are looked for from then on
	// refused are the ids of messages whose handler did not start because of versionMet: given back on shutdown.
	refused []string
	// readSentAt is when the read on its way was sent (zero once what it brought is in flight): an entry delivered
	// since may be that read's, not a hand-over.
	readSentAt time.Time

	freed chan struct{} // a handler returned, or an entry left the flight: wakes the read loop and the shutdown
	// handlers holds a token per handler running: the hand-overs a lease tick takes up while a read is on its way
	// may bring more messages than slots for a moment; they wait here, never more than Concurrency run.
	handlers chan struct{}
	// handOverMu is held while a lease tick takes up hand-overs; the shutdown takes it once the read loop ended, so
	// that every hand-over taken is in flight before it looks.
	handOverMu sync.Mutex
	// leasing is held while a lease tick gathers the ids in flight, leases them and takes up hand-overs, and while a
	// retry marks its entry and gives it back. The pool keeps no order between two calls: a retry's give-back (which
	// sets the entry's idle time) must never reach the server before a lease that gathered its id (which would undo
	// that idle time), nor be answered while the own PEL's XPENDING is out (whose idle times are from before it): in
	// both cases the entry would look handed back and be run again, no delivery counted.
	leasing sync.Mutex

	ackMu         sync.Mutex
	acks          []ackRequest // waiting for the next read, or for the flush in progress to end
	flushing      bool
	readerWaiting bool // the read loop waits for slots: the read it sends next carries the ACKs
}

// flight is an entry being handled.
type flight struct {
	id      string
	started time.Time
	// Guarded by Worker.mu.
	settled   bool          // the handler returned: its outcome is being written
	ran       time.Duration // how long the handler ran, once it returned
	abandoned bool          // given back on shutdown: its outcome is not written
	overdue   bool          // past MaxHandling: no longer leased (said once)
	lost      bool          // the pass took it while its handler ran (said once)
}

// NewWorker checks the options and fills in their defaults. Run connects.
func NewWorker(client redis.UniversalClient, opt WorkerOptions) (*Worker, error) {
	if client == nil {
		return nil, errors.New("pelican: NewWorker needs a client")
	}
	if opt.Stream == "" || opt.Group == "" {
		return nil, errors.New("pelican: WorkerOptions needs a Stream and a Group")
	}
	if opt.Concurrency < 0 || opt.MaxHandling < 0 {
		return nil, errors.New("pelican: Concurrency and MaxHandling must not be negative")
	}
	opt.Block = orDefault(opt.Block, time.Second)
	if err := checkBlock(opt.Block, readTimeout(client)); err != nil {
		return nil, err
	}
	// go-redis hands each command a pooled connection of its own: the blocking read holds one for up to Block,
	// and leases, ACKs and give-backs take others, never queueing behind it. A pool of one would make them wait.
	if size := poolSize(client); size == 1 {
		return nil, errors.New("pelican: the client's PoolSize is 1: the blocking read would hold the only " +
			"connection and leases would wait behind it; give the worker a pool of at least 2")
	}
	if opt.Consumer == "" {
		opt.Consumer = PodName()
	}
	if opt.Consumer == "" {
		return nil, errors.New("pelican: no consumer name (no POD_NAME, HOSTNAME or host name): set Consumer")
	}
	opt.Concurrency = orDefault(opt.Concurrency, 16)
	opt.ShutdownGrace = max(orDefault(opt.ShutdownGrace, 20*time.Second), 0)
	opt.MaxHandling = orDefault(opt.MaxHandling, 30*time.Minute)
	if opt.Logger == nil {
		opt.Logger = slog.Default()
	}
	return &Worker{
		client:         client,
		opt:            opt,
		log:            opt.Logger.With("stream", opt.Stream, "group", opt.Group, "consumer", opt.Consumer),
		settingsKey:    SettingsKey(opt.Stream, opt.Group),
		terminalKey:    TerminalKey(opt.Stream, opt.Group),
		errorsKey:      ErrorsKey(opt.Stream, opt.Group),
		consumersKey:   ConsumersKey(opt.Stream, opt.Group),
		processName:    "process " + opt.Stream,
		meter:          newWorkerMeter(opt.Stream, opt.Group),
		handlers:       make(chan struct{}, opt.Concurrency),
		inFlight:       map[string]*flight{},
		failedHere:     map[string]time.Time{},
		errorsRecorded: map[string]struct{}{},
		freed:          make(chan struct{}, 1),
		contract:       KnownContractVersions,
		partition:      -1,
	}, nil
}

func orDefault[T comparable](v, def T) T {
	var zero T
	if v == zero {
		return def
	}
	return v
}

// checkBlock refuses a Block that rounds to BLOCK 0 (the server waits for ever while the client gives up) or that
// the client's ReadTimeout (0: none) cuts off: what the server then delivers to a read nobody awaits waits for
// the operator's pass.
func checkBlock(block, readTimeout time.Duration) error {
	if block < time.Millisecond {
		return fmt.Errorf("pelican: WorkerOptions.Block is %v: it must be at least 1ms (BLOCK 0 would wait for ever)",
			block)
	}
	if readTimeout > 0 && block >= readTimeout {
		return fmt.Errorf("pelican: WorkerOptions.Block is %v: it must be below the client's ReadTimeout (%v), "+
			"which would give up on a read the server still answers", block, readTimeout)
	}
	return nil
}

// readTimeout is how long the client waits for a reply (0: for ever).
func readTimeout(client redis.UniversalClient) time.Duration {
	switch c := client.(type) {
	case *redis.Client:
		return c.Options().ReadTimeout
	case *redis.ClusterClient:
		return c.Options().ReadTimeout
	case *redis.Ring:
		return c.Options().ReadTimeout
	}
	return 0
}

func poolSize(client redis.UniversalClient) int {
	switch c := client.(type) {
	case *redis.Client:
		return c.Options().PoolSize
	case *redis.ClusterClient:
		return c.Options().PoolSize
	case *redis.Ring:
		return c.Options().PoolSize
	}
	return 0
}

// Stream is the stream the worker reads.
func (w *Worker) Stream() string { return w.opt.Stream }

// Group is the consumer group the worker reads in.
func (w *Worker) Group() string { return w.opt.Group }

// Consumer is the consumer name the worker reads as.
func (w *Worker) Consumer() string { return w.opt.Consumer }

// Settings are the group's settings as last read; nil when none are published.
func (w *Worker) Settings() *Settings { return w.settings.Load() }

// Stats are what the worker did so far; safe to call at any time (to export them, see the README).
func (w *Worker) Stats() Stats {
	w.mu.Lock()
	inFlight := len(w.inFlight)
	w.mu.Unlock()
	return Stats{
		Done:      w.done.Load(),
		Terminal:  w.terminal.Load(),
		Failed:    w.failed.Load(),
		Retried:   w.retried.Load(),
		Abandoned: w.abandoned.Load(),
		InFlight:  inFlight,
	}
}

// Run reads and dispatches until ctx is cancelled (SIGTERM: signal.NotifyContext), then shuts down as the contract
// says: it stops reading (a blocking read already sent is awaited, and what it brought is given back unhandled),
// keeps leasing while handlers finish within ShutdownGrace, cancels the context of those still running, gives back
// what is left, and leaves the group. It returns the stats and nil; or a *ContractVersionError, before reading
// anything when the operator speaks a contract this library does not know (and after a graceful shutdown when it
// starts to while running). Read errors (a server restarting) are logged and retried; a Worker runs once.
func (w *Worker) Run(ctx context.Context, handler Handler) (Stats, error) {
	if handler == nil {
		return Stats{}, errors.New("pelican: Run needs a handler")
	}
	if !w.started.CompareAndSwap(false, true) {
		return w.Stats(), errors.New("pelican: this Worker already ran: create a new one")
	}
	// The worker's own Redis calls never see ctx's cancellation: a shutdown awaits them rather than cutting them.
	rctx := context.WithoutCancel(ctx)
	if err := w.firstSettings(ctx, rctx); err != nil {
		var version *ContractVersionError
		if errors.As(err, &version) {
			return w.Stats(), err
		}
		return w.Stats(), nil // stopped before the first read
	}
	runCtx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	// Goroutines kept for the handlers: a new one per message would grow its stack through go-redis' calls each
	// time. Up to Concurrency handlers run, and up to Concurrency outcomes are written meanwhile.
	q := newQueue()
	defer q.close()
	leaseCtx, stopLeases := context.WithCancel(rctx)
	leasesDone := make(chan struct{})
	go func() {
		defer close(leasesDone)
		w.holdLeases(leaseCtx, runCtx, rctx, stop, q)
	}()
	// Cancelled when the grace runs out, for the handlers still running then.
	handlerCtx, cancelHandlers := context.WithCancel(rctx)
	defer cancelHandlers()
	for range 2 * w.opt.Concurrency {
		go func() {
			for j, ok := q.take(); ok; j, ok = q.take() {
				w.dispatch(handlerCtx, rctx, handler, j.message, j.flight)
			}
		}()
	}

	unhandled := w.readLoop(runCtx, rctx, q)
	w.flushAcks(rctx)   // those left for a read that will not come
	w.handOverMu.Lock() // a hand-over being taken up is in flight once this returns; none is taken after
	w.handOverMu.Unlock()
	w.shutDown(rctx, unhandled, cancelHandlers, func() { stopLeases(); <-leasesDone })

	var version *ContractVersionError
	if errors.As(context.Cause(runCtx), &version) {
		return w.Stats(), version
	}
	return w.Stats(), nil
}

// Settings

// firstSettings reads the settings before the first read; an error only for an unknown contract version or when
// ctx ends first.
func (w *Worker) firstSettings(ctx, rctx context.Context) error {
	for {
		err := w.readSettings(rctx)
		var version *ContractVersionError
		if err == nil || errors.As(err, &version) {
			return err
		}
		w.log.Warn("could not read the group's settings yet; retrying", "error", err)
		if !sleep(ctx, 500*time.Millisecond) {
			return ctx.Err()
		}
	}
}

// readSettings reads the settings hash. A refusal (an ACL without hgetall on it) or a malformed hash leaves the
// worker without settings (leasing every second), said once; a broken connection is returned and the last
// settings stay.
func (w *Worker) readSettings(ctx context.Context) error {
	fields, err := w.client.HGetAll(ctx, w.settingsKey).Result()
	var server redis.Error
	if err != nil && !errors.As(err, &server) {
		return err
	}
	var settings *Settings
	if err == nil {
		settings, err = parseSettings(fields, w.contract)
		var version *ContractVersionError
		if errors.As(err, &version) {
			return err
		}
	}
	problem := ""
	if err != nil {
		problem = err.Error()
		if problem != w.settingsProblem {
			w.log.Warn("no usable settings for the group: leasing every second, giving back with an idle of 300 s",
				"error", err)
		}
	}
	w.settingsProblem = problem
	w.settings.Store(settings)
	return nil
}

func (w *Worker) minIdle() time.Duration {
	if s := w.settings.Load(); s != nil {
		return s.MinIdle
	}
	return unpublishedIdle
}

func (w *Worker) retryAfter() time.Duration {
	if s := w.settings.Load(); s != nil {
		return s.RetryAfter
	}
	return unpublishedIdle
}

// Reading

// readLoop reads and hands the messages to the slots' goroutines until ctx ends; it answers the ids a read brought
// after the stop, unhandled.
func (w *Worker) readLoop(ctx, rctx context.Context, q *queue) []string {
	cursor := "0" // own PEL first: entries delivered to this name before a restart
	var groupWait time.Duration
	// A read waits up to a millisecond for half the slots to be free, so that handlers that return together share
	// it (a read per slot would double the round trips of short handlers).
	gather := time.NewTimer(time.Millisecond)
	defer gather.Stop()
	gathered := false
	for ctx.Err() == nil {
		want := 1
		if !gathered {
			want = (w.opt.Concurrency + 1) / 2
		}
		w.mu.Lock()
		free := w.freeLocked()
		w.wakeAt = want
		if free <= 0 {
			w.wakeAt = 1 // then gathers
		}
		w.mu.Unlock()
		if free < want {
			var expired <-chan time.Time
			if free > 0 {
				gather.Reset(time.Millisecond)
				expired = gather.C
			} else {
				w.flushAcks(rctx) // no read to carry them soon
			}
			w.setReaderWaiting(true)
			select {
			case <-w.freed:
			case <-expired:
				gathered = true
			case <-ctx.Done():
			}
			w.setReaderWaiting(false)
			continue
		}
		gathered = false
		var found []Message
		var err error
		w.mu.Lock()
		w.readSentAt = time.Now()
		w.mu.Unlock()
		if cursor != "" {
			found, cursor, err = w.readOwn(rctx, free, cursor)
		} else {
			found, err = w.readNew(rctx, free)
		}
		if err != nil {
			w.mu.Lock()
			w.readSentAt = time.Time{}
			w.mu.Unlock()
			if !redis.HasErrorPrefix(err, "NOGROUP") {
				w.log.Warn("read failed; retrying", "error", err)
				sleep(ctx, 500*time.Millisecond)
				continue
			}
			// The group is the operator's to create: wait for it, say so once, never create it.
			if groupWait == 0 {
				w.log.Warn("the consumer group does not exist yet: waiting for the operator to create it",
					"error", err)
				groupWait = time.Second
			}
			sleep(ctx, groupWait)
			groupWait = min(groupWait*2, 10*time.Second)
			continue
		}
		if groupWait != 0 {
			w.log.Info("the consumer group exists now: reading")
			groupWait = 0
		}
		if ctx.Err() != nil {
			// The read was sent before the stop, and the server delivered to this consumer all the same.
			ids := make([]string, len(found))
			for i, m := range found {
				ids[i] = m.ID
			}
			return ids
		}
		w.mu.Lock()
		jobs := w.flyLocked(found)
		w.readSentAt = time.Time{}
		w.ownPELRead = cursor == ""
		w.mu.Unlock()
		q.put(jobs)
	}
	return nil
}

// flyLocked puts messages in flight: the jobs for the handlers' goroutines.
func (w *Worker) flyLocked(found []Message) []job {
	jobs := make([]job, len(found))
	now := time.Now()
	for i, m := range found {
		m.Partition = w.partition
		jobs[i] = job{message: m, flight: &flight{id: m.ID, started: now}}
		w.inFlight[m.ID] = jobs[i].flight
	}
	w.meter.started(len(found))
	return jobs
}

// takeUpHandOvers, at a lease tick once the own PEL was read, takes up what strategy: Reassign handed over, as
// many as slots are free (the rest at the next tick), and queues them as new messages. None once ctx (Run's) ends.
func (w *Worker) takeUpHandOvers(ctx, rctx context.Context, q *queue) {
	w.handOverMu.Lock()
	defer w.handOverMu.Unlock()
	w.mu.Lock()
	free := 0
	if w.ownPELRead && ctx.Err() == nil {
		free = w.freeLocked()
	}
	w.mu.Unlock()
	if free <= 0 {
		return
	}
	found, err := w.takeHandedOver(rctx, free)
	if err != nil {
		w.log.Warn("could not take up hand-overs; looking again at the next tick", "error", err)
		return
	}
	w.mu.Lock()
	jobs := w.flyLocked(found)
	w.mu.Unlock()
	q.put(jobs)
}

// readOwn reads the own PEL after cursor; next is where to go on, "" once it is empty.
func (w *Worker) readOwn(ctx context.Context, count int, cursor string) (found []Message, next string, err error) {
	entries, err := readReply(w.readCarrying(ctx, cursor, count, w.takeAcks()))
	if err != nil {
		return nil, cursor, err
	}
	if len(entries) == 0 {
		return nil, "", nil
	}
	return payloads(entries), entries[len(entries)-1].ID, nil
}

// readNew reads new entries. The ACKs that wait for it go first, in the same round trip, with a read that does not
// block (an ACK never waits behind a blocking read); the blocking read follows when that one brought nothing.
func (w *Worker) readNew(ctx context.Context, count int) ([]Message, error) {
	if acks := w.takeAcks(); len(acks) > 0 {
		if found, err := readReply(w.readCarrying(ctx, ">", count, acks)); err != nil || len(found) > 0 {
			return payloads(found), err
		}
	}
	found, err := readReply(xReadGroup(ctx, w.client, w.opt.Group, w.opt.Consumer, w.opt.Stream, ">", count,
		w.opt.Block))
	return payloads(found), err
}

// readCarrying reads after id without blocking, with acks in the same round trip.
func (w *Worker) readCarrying(ctx context.Context, id string, count int, acks []ackRequest) *redis.Cmd {
	if len(acks) == 0 {
		return xReadGroup(ctx, w.client, w.opt.Group, w.opt.Consumer, w.opt.Stream, id, count, -1)
	}
	pipe := w.client.Pipeline()
	written := w.queueAcks(ctx, pipe, acks)
	read := xReadGroup(ctx, pipe, w.opt.Group, w.opt.Consumer, w.opt.Stream, id, count, -1)
	_, _ = pipe.Exec(ctx) // each command's error is its own
	w.acked(acks, written)
	return read
}

// takeHandedOver answers up to count entries of the own PEL that are neither in flight nor failed here (or failed
// here and handed back since) nor delivered since the read on its way was sent (they may be its own): the ones
// strategy: Reassign handed over. They are taken with lease.lua, which
// leaves alone what the pass meanwhile gave to someone else (a plain XCLAIM would take it back), then read with
// XRANGE.
func (w *Worker) takeHandedOver(ctx context.Context, count int) ([]Message, error) {
	w.mu.Lock()
	asked := count + len(w.inFlight) + len(w.failedHere)
	w.mu.Unlock()
	// Taken before the server measures idle times: an entry untouched since it failed is idle at least this long.
	askedAt := time.Now()
	pending, err := w.client.XPendingExt(ctx, &redis.XPendingExtArgs{
		Stream: w.opt.Stream, Group: w.opt.Group, Start: "-", End: "+", Count: int64(asked), Consumer: w.opt.Consumer,
	}).Result()
	if err != nil {
		return nil, err
	}
	var candidates []string
	w.mu.Lock()
	// Taken after the reply: an entry delivered by the read on its way is idle at most this long, give or take the
	// server's whole milliseconds (an entry delivered within a millisecond of the read's sending may be listed
	// idle a millisecond longer), and delivered once. A hand-over raises the count (Reassign's RETRYCOUNT) and is
	// taken at once; one whose count a shutdown's give-back had lowered to 0, like an entry whose read's reply was
	// lost, is taken once it is older than the read on its way.
	sinceRead := time.Duration(-1)
	if !w.readSentAt.IsZero() {
		sinceRead = time.Since(w.readSentAt) + time.Millisecond
	}
	if len(pending) < asked {
		// The whole own PEL: what failed here and left it (requeued, dead-lettered, handed on) is forgotten.
		listed := make(map[string]bool, len(pending))
		for _, p := range pending {
			listed[p.ID] = true
		}
		maps.DeleteFunc(w.failedHere, func(id string, _ time.Time) bool { return !listed[id] })
	}
	for _, p := range pending {
		if len(candidates) == count {
			break
		}
		if _, busy := w.inFlight[p.ID]; busy {
			continue
		}
		// Read now, not before the call: one that failed while the XPENDING was out (its outcome written, so no
		// longer in flight) failed after askedAt, and is not handed back.
		if at, ok := w.failedHere[p.ID]; ok && p.Idle+handOverMargin > askedAt.Sub(at) {
			continue // failed here and not handed back since: the pass retries it
		}
		if p.RetryCount == 1 && p.Idle <= sinceRead {
			continue // perhaps the read's: looked at again at the next tick
		}
		candidates = append(candidates, p.ID)
	}
	w.mu.Unlock()
	if len(candidates) == 0 {
		return nil, nil
	}
	taken, err := w.lease(ctx, candidates)
	if err != nil || len(taken) == 0 {
		return nil, err
	}
	w.mu.Lock()
	for _, id := range taken {
		delete(w.failedHere, id)
	}
	w.mu.Unlock()
	pipe := w.client.Pipeline()
	ranges := make([]*redis.Cmd, len(taken))
	for i, id := range taken {
		ranges[i] = pipe.Do(ctx, "XRANGE", w.opt.Stream, id, id)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, err
	}
	var found []Message
	for _, r := range ranges {
		entries, err := rangeReply(r)
		if err != nil {
			return nil, err
		}
		found = append(found, payloads(entries)...)
	}
	return found, nil
}

func (w *Worker) inFlightCount() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.inFlight)
}

// freeLocked is how many messages the next read may bring. A slot is free once its handler returned: its outcome
// is written while the next read is on its way. Up to Concurrency entries whose outcome is being written are let
// through, so that a server slow to take them stops the reads.
func (w *Worker) freeLocked() int {
	running := len(w.inFlight) - w.settling
	return min(w.opt.Concurrency-running, 2*w.opt.Concurrency-len(w.inFlight))
}

// wakeLocked wakes the read loop once as many slots are free as it waits for (the shutdown at every change).
func (w *Worker) wakeLocked() {
	if w.freeLocked() >= w.wakeAt {
		select {
		case w.freed <- struct{}{}:
		default: // a wake-up is already pending
		}
	}
}

// Shutdown

// shutDown lets handlers finish within the grace (leases go on meanwhile), cancels the context of those still
// running, then gives back what is left, uncounted. The give-back runs also when nothing is left: it deletes the
// consumer once it owns nothing, so that strategy: Reassign never hands work to a worker that left.
func (w *Worker) shutDown(ctx context.Context, unhandled []string, cancelHandlers, stopLeases func()) {
	w.mu.Lock()
	w.wakeAt = 0
	w.mu.Unlock()
	if w.aborted.Load() {
		w.abandonAll(cancelHandlers, stopLeases)
		return
	}
	grace := time.NewTimer(w.opt.ShutdownGrace)
	defer grace.Stop()
wait:
	for w.inFlightCount() > 0 {
		select {
		case <-w.freed:
		case <-grace.C:
			break wait
		}
	}
	w.mu.Lock()
	left := append(unhandled, w.refused...)
	for id, f := range w.inFlight {
		if !f.settled {
			// No longer this worker's, though its handler may still run: neither leased nor counted in flight.
			f.abandoned = true
			delete(w.inFlight, id)
			w.meter.landed(1)
			left = append(left, id)
		}
	}
	w.mu.Unlock()
	cancelHandlers()
	// Outcomes being written finish first, so that the consumer owns nothing they would still remove.
	for w.inFlightCount() > 0 {
		<-w.freed
	}
	stopLeases()
	given, err := w.giveBack(ctx, left, w.retryAfter(), true)
	// Only what the give-back released: an entry the pass took meanwhile is not this worker's to count.
	w.abandoned.Add(uint64(given))
	w.meter.abandonedGiven(given)
	if err != nil {
		w.log.Warn("shutdown: could not give back (and leave the group): what is left is retried after minIdle",
			"left", len(left), "error", err)
		return
	}
	w.log.Info("shutdown: messages given back for the next pass (not finished within the grace, or read "+
		"unhandled), their delivery not counted", "given", given)
}

// abort stops a topic's lost partition at once: no handler starts, no outcome is written, nothing is given back
// (its new owner takes the pending list over).
func (w *Worker) abort() {
	w.aborted.Store(true)
	w.cancelRun()
}

// abandonAll is an aborted worker's shutdown: its entries in flight are another's now.
func (w *Worker) abandonAll(cancelHandlers, stopLeases func()) {
	w.mu.Lock()
	for id, f := range w.inFlight {
		if !f.settled {
			f.abandoned = true
			delete(w.inFlight, id)
			w.meter.landed(1)
		}
	}
	w.mu.Unlock()
	cancelHandlers()
	// Outcomes already being written when the partition was lost end first (takeAcks drops those not sent yet).
	for w.inFlightCount() > 0 {
		<-w.freed
	}
	stopLeases()
	w.log.Warn("partition lost: stopped at once, its messages in flight left to the new owner")
}

// sleep waits d, or less when ctx ends; false when it did.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
