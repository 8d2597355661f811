package pelican

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"
)

// queue hands messages to the handlers' goroutines. It wakes one idle goroutine at a time, and a goroutine that
// takes a message wakes another while more wait: short handlers are run by the few goroutines already awake,
// long ones each get their own at once.
type queue struct {
	mu     sync.Mutex
	ready  sync.Cond
	jobs   []job
	idle   int
	closed bool
}

type job struct {
	message Message
	flight  *flight
}

func newQueue() *queue {
	q := &queue{}
	q.ready.L = &q.mu
	return q
}

func (q *queue) put(jobs []job) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.jobs = append(q.jobs, jobs...)
	if q.idle > 0 {
		q.ready.Signal()
	}
}

// take waits for a job; false once the queue is closed and empty.
func (q *queue) take() (job, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for len(q.jobs) == 0 && !q.closed {
		q.idle++
		q.ready.Wait()
		q.idle--
	}
	if len(q.jobs) == 0 {
		return job{}, false
	}
	j := q.jobs[0]
	q.jobs = q.jobs[1:]
	if len(q.jobs) > 0 && q.idle > 0 {
		q.ready.Signal()
	}
	return j, true
}

func (q *queue) close() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.closed = true
	q.ready.Broadcast()
}

// dispatch runs the handler and writes its outcome (with wctx, which no shutdown cancels).
func (w *Worker) dispatch(hctx, wctx context.Context, handler Handler, m Message, f *flight) {
	select {
	case w.handlers <- struct{}{}:
	case <-hctx.Done():
		return // taken after the grace ran out: given back unhandled
	}
	if hctx.Err() != nil {
		<-w.handlers
		return
	}
	if w.fresh != nil && !w.fresh() {
		<-w.handlers
		// The membership may have expired: the partition may be another's. Stopped; the topic worker starts it
		// again once a heartbeat answers.
		w.log.Warn("no membership heartbeat answered within the ttl: the partition is stopped")
		w.abort()
		return
	}
	if w.versionMet.Load() {
		<-w.handlers
		// Never handled under a contract this library does not know: out of the flight, given back on shutdown.
		w.mu.Lock()
		if !f.abandoned {
			f.abandoned = true
			delete(w.inFlight, f.id)
			w.meter.landed(1)
			w.refused = append(w.refused, f.id)
			w.wakeLocked()
		}
		w.mu.Unlock()
		return
	}
	began := time.Now()
	outcome, err := w.handle(hctx, handler, m)
	ran := time.Since(began)
	<-w.handlers
	w.mu.Lock()
	if f.abandoned || w.aborted.Load() { // given back on shutdown, or lost: no longer in flight
		w.mu.Unlock()
		return
	}
	f.settled = true
	f.ran = ran
	w.settling++
	w.wakeLocked() // its slot is free: the next read need not wait for the outcome's write
	w.mu.Unlock()
	if err == nil && outcome.kind == doneOutcome {
		w.ack(wctx, m, f) // finished with its batch
		return
	}
	switch {
	case err != nil:
		w.fail(wctx, m.ID, err, ran)
	case outcome.kind == terminalOutcome:
		w.ackTerminal(wctx, m.ID, outcome.reason, ran)
	default:
		w.retry(wctx, m.ID, ran)
	}
	w.finish(f)
}

// handle runs the handler on m inside its run's span (trace.go), which ends with what it returned: the zero
// Outcome, or a terminal one of an invalid reason, is an error (refused before anything is written: never a silent
// ACK).
func (w *Worker) handle(ctx context.Context, handler Handler, m Message) (Outcome, error) {
	ctx, span := startProcessing(ctx, w, m)
	outcome, err := runHandler(ctx, handler, m)
	if err == nil {
		switch outcome.kind {
		case invalidOutcome:
			err = errors.New("the handler returned the zero Outcome and no error: return pelican.Done(), " +
				"pelican.Retry() or pelican.Terminal(reason)")
		case terminalOutcome:
			err = CheckReason(outcome.reason)
		}
	}
	endProcessing(span, outcome, err)
	return outcome, err
}

// runHandler calls the handler; a panic is a failure of the message like an error.
func runHandler(ctx context.Context, handler Handler, m Message) (outcome Outcome, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = &panicError{value: r}
		}
	}()
	return handler(ctx, m)
}

type panicError struct{ value any }

func (e *panicError) Error() string { return fmt.Sprintf("panic: %v", e.value) }

// finish takes settled entries out of the flight.
func (w *Worker) finish(flights ...*flight) {
	w.mu.Lock()
	for _, f := range flights {
		delete(w.inFlight, f.id)
		w.settling--
	}
	w.meter.landed(len(flights))
	w.wakeLocked()
	w.mu.Unlock()
}

type ackRequest struct {
	flight     *flight
	clearError bool
}

// ack is XACK, with HDEL of the entry's last error in the same round trip when it may have one. ACKs go together:
// with the next read when the read loop waits for slots (one round trip for both), else in a flush, which takes
// also those of handlers that return while it is on its way.
func (w *Worker) ack(ctx context.Context, m Message, f *flight) {
	// A message that failed before, here or elsewhere before it was requeued as a copy, may have a last error.
	_, copied := m.Lookup(DeliveriesField)
	w.mu.Lock()
	_, recorded := w.errorsRecorded[m.ID]
	delete(w.errorsRecorded, m.ID)
	// The read loop waits for slots, and a free one wakes it (or its gathering ends within a millisecond): its next
	// read carries the ACK. Without a free slot it would wait for this ACK: flush.
	readerReads := w.freeLocked() >= 1
	w.ackMu.Lock() // before w.mu is let go, so that the read loop cannot read meanwhile
	w.mu.Unlock()
	w.acks = append(w.acks, ackRequest{flight: f, clearError: recorded || copied})
	if (w.readerWaiting && readerReads) || w.flushing {
		w.ackMu.Unlock()
		return
	}
	w.flushing = true
	w.ackMu.Unlock()
	// Handlers that return at the same time as this one add their ACKs to the first flush.
	runtime.Gosched()
	for {
		w.flushAcks(ctx)
		w.ackMu.Lock()
		if len(w.acks) == 0 {
			w.flushing = false
			w.ackMu.Unlock()
			return
		}
		w.ackMu.Unlock()
	}
}

func (w *Worker) setReaderWaiting(waiting bool) {
	w.ackMu.Lock()
	defer w.ackMu.Unlock()
	w.readerWaiting = waiting
}

func (w *Worker) takeAcks() []ackRequest {
	w.ackMu.Lock()
	acks := w.acks
	w.acks = nil
	w.ackMu.Unlock()
	if len(acks) > 0 && w.aborted.Load() {
		// The partition was lost: no outcome is written.
		flights := make([]*flight, len(acks))
		for i, r := range acks {
			flights[i] = r.flight
		}
		w.finish(flights...)
		return nil
	}
	return acks
}

// flushAcks writes the ACKs waiting, until none is left.
func (w *Worker) flushAcks(ctx context.Context) {
	for acks := w.takeAcks(); len(acks) > 0; acks = w.takeAcks() {
		pipe := w.client.Pipeline()
		written := w.queueAcks(ctx, pipe, acks)
		_, _ = pipe.Exec(ctx)
		w.acked(acks, written)
	}
}

type ackCommands struct{ ack, hdel *redis.IntCmd }

// queueAcks adds one XACK of the batch, and one HDEL of the last errors to remove, to pipe.
func (w *Worker) queueAcks(ctx context.Context, pipe redis.Pipeliner, acks []ackRequest) ackCommands {
	ids := make([]string, len(acks))
	var clearing []string
	for i, r := range acks {
		ids[i] = r.flight.id
		if r.clearError {
			clearing = append(clearing, r.flight.id)
		}
	}
	c := ackCommands{ack: pipe.XAck(ctx, w.opt.Stream, w.opt.Group, ids...)}
	if len(clearing) > 0 {
		c.hdel = pipe.HDel(ctx, w.errorsKey, clearing...)
	}
	return c
}

// acked counts the written ACKs and takes their entries out of the flight.
func (w *Worker) acked(acks []ackRequest, c ackCommands) {
	flights := make([]*flight, len(acks))
	runs := make([]handlerRun, len(acks))
	for i, r := range acks {
		flights[i], runs[i] = r.flight, handlerRun{id: r.flight.id, ran: r.flight.ran}
	}
	switch {
	case c.ack.Err() != nil:
		w.writeFailed("XACK", runs, c.ack.Err())
	case c.hdel != nil && c.hdel.Err() != nil:
		// Acknowledged; only the last errors stay (the operator's passes remove them).
		w.log.Warn("could not remove the last errors of acknowledged messages", "error", c.hdel.Err())
		fallthrough
	default:
		for _, r := range runs {
			w.count(countedDone, r.ran, nil)
		}
	}
	w.finish(flights...)
}

func (w *Worker) ackTerminal(ctx context.Context, id, reason string, ran time.Duration) {
	w.log.Warn("message ended as terminal", "entry_id", id, "reason", reason)
	w.mu.Lock()
	delete(w.errorsRecorded, id)
	w.mu.Unlock()
	keys := []string{w.opt.Stream, w.terminalKey, w.errorsKey}
	if err := terminalAckScript.Run(ctx, w.client, keys, w.opt.Group, id, reason).Err(); err != nil {
		w.writeFailed("terminal ACK", []handlerRun{{id: id, ran: ran}}, err)
		return
	}
	w.count(countedTerminal, ran, nil)
}

// retry gives the entry back with an idle of minIdle, the delivery counted: the pass retries it under the backoff.
func (w *Worker) retry(ctx context.Context, id string, ran time.Duration) {
	// Not read again here: the give-back makes it look idle, not handed over. It looks untouched since idle ago: a
	// hand-over back to this worker (the only live one) may come within a second, and is told by its idle all the same.
	idle := w.minIdle()
	w.leasing.Lock()
	w.mu.Lock()
	w.failedHere[id] = time.Now().Add(-idle)
	w.mu.Unlock()
	_, err := w.giveBack(ctx, []string{id}, idle, false)
	w.leasing.Unlock()
	if err != nil {
		w.log.Warn("could not give the message back for a retry: it is retried after minIdle",
			"entry_id", id, "error", err)
		// Not given back: untouched since it failed here, never since idle ago.
		w.mu.Lock()
		w.failedHere[id] = time.Now()
		w.mu.Unlock()
	}
	w.count(countedRetried, ran, nil)
}

// fail records the error's text as the entry's last error, without an ACK: the pass retries it.
func (w *Worker) fail(ctx context.Context, id string, err error, ran time.Duration) {
	text := cutUTF8(err.Error(), ErrorTextMax)
	// One line per failure, never a stack trace: a store outage fails every message, and the logs stay readable.
	kind := fmt.Sprintf("%T", err)
	var p *panicError
	if errors.As(err, &p) {
		kind = fmt.Sprintf("panic(%T)", p.value)
	}
	w.log.Warn("handler failed; the message stays pending for the operator's retry",
		"entry_id", id, "error_type", kind, "error", text)
	w.mu.Lock()
	w.failedHere[id] = time.Now()
	w.mu.Unlock()
	w.count(countedFailed, ran, err)
	if err := w.client.HSet(ctx, w.errorsKey, id, text).Err(); err != nil {
		w.log.Warn("could not record the message's last error", "entry_id", id, "error", err)
		return
	}
	w.mu.Lock()
	if len(w.errorsRecorded) >= errorsRemembered {
		clear(w.errorsRecorded)
	}
	w.errorsRecorded[id] = struct{}{}
	w.mu.Unlock()
}

// writeFailed counts the messages whose outcome could not be written; each is left pending for the pass, and this
// worker takes it up again only once it is handed back.
func (w *Worker) writeFailed(what string, runs []handlerRun, err error) {
	// A server's error reply means nothing was written (the scripts check everything before their first write);
	// a broken connection leaves it open.
	ids := make([]string, len(runs))
	for i, r := range runs {
		ids[i] = r.id
	}
	listed := strings.Join(ids, ",")
	var server redis.Error
	if errors.As(err, &server) {
		w.log.Warn(what+" refused; the message stays pending", "entry_id", listed, "error", err)
	} else {
		w.log.Warn(what+" outcome unknown (the connection failed): the message may be acknowledged, or stays "+
			"pending", "entry_id", listed, "error", err)
	}
	now := time.Now()
	w.mu.Lock()
	for _, id := range ids {
		w.failedHere[id] = now
	}
	w.mu.Unlock()
	for _, r := range runs {
		w.count(countedFailed, r.ran, nil)
	}
}

// handlerRun is an entry whose handler ran for ran.
type handlerRun struct {
	id  string
	ran time.Duration
}

// count counts a handler run that took ran as e, in the stats and their metrics; handlerErr is what the handler
// failed with.
func (w *Worker) count(e counted, ran time.Duration, handlerErr error) {
	counters := [...]*atomic.Uint64{countedDone: &w.done, countedTerminal: &w.terminal, countedFailed: &w.failed,
		countedRetried: &w.retried}
	counters[e].Add(1)
	w.meter.ended(e, ran, handlerErr)
}

// cutUTF8 cuts text to at most n bytes, at a character boundary.
func cutUTF8(text string, n int) string {
	if len(text) <= n {
		return text
	}
	for n > 0 && !utf8.RuneStart(text[n]) {
		n--
	}
	return text[:n]
}
