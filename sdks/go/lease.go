package pelican

import (
	"context"
	"errors"
	"time"
)

// holdLeases extends, every tick, every entry in flight for less than MaxHandling, after re-reading the settings
// (a lowered minIdle is leased at its new pace before the operator applies it), then takes up hand-overs until
// runCtx ends. It stops when ctx ends.
func (w *Worker) holdLeases(ctx, runCtx, rctx context.Context, stop context.CancelCauseFunc, q *queue) {
	timer := time.NewTimer(LeaseInterval(w.settings.Load()))
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		if err := w.readSettings(rctx); err != nil {
			var version *ContractVersionError
			if !errors.As(err, &version) {
				w.log.Warn("could not re-read the group's settings; the last ones stay", "error", err)
			} else if !w.versionMet.Swap(true) {
				w.log.Error("the operator speaks a worker contract this library does not know: shutting down",
					"error", err)
				stop(err)
			}
		}
		// Leased and the own PEL looked at before a retry gives an entry back (see leasing).
		w.leasing.Lock()
		if w.leaseTick(rctx) {
			w.takeUpHandOvers(runCtx, rctx, q)
		}
		w.leasing.Unlock()
		timer.Reset(LeaseInterval(w.settings.Load()))
	}
}

// leaseTick runs lease.lua, also with no ids: its heartbeat says the worker is alive. False when it failed.
func (w *Worker) leaseTick(ctx context.Context) bool {
	// Before the ids are gathered: a handler that fails after its id was taken for this lease fails after sent, and
	// the lease, which may reach the server after the failure, is then accounted for below. Called with leasing held.
	now := time.Now()
	sent := now
	var ids []string
	w.mu.Lock()
	for id, f := range w.inFlight {
		switch {
		case f.settled: // its outcome is being written: a lease after a give-back would undo its idle
		case now.Sub(f.started) < w.opt.MaxHandling:
			ids = append(ids, id)
		case !f.overdue:
			f.overdue = true
			w.log.Warn("handler still running after MaxHandling: its lease is no longer extended, and the "+
				"operator's pass may retry the message", "entry_id", id, "max_handling", w.opt.MaxHandling)
		}
	}
	w.mu.Unlock()
	kept, err := w.lease(ctx, ids)
	answered := time.Now()
	w.mu.Lock()
	defer w.mu.Unlock()
	// A handler that failed while this lease was on its way (a paused server answers late): the lease may have reset
	// the entry's idle time after the failure, so the entry looks untouched since now, not since it failed; else the
	// own-PEL check would take it for a hand-over and run it again here. (A retry's time is set back by minIdle: its
	// give-back waited for this lease to be answered, see leasing.)
	for _, id := range ids {
		if at, ok := w.failedHere[id]; ok && !at.Before(sent) {
			w.failedHere[id] = answered
		}
	}
	if err != nil {
		w.log.Warn("could not extend the leases of the messages being handled; retrying", "error", err)
		return false
	}
	extended := make(map[string]bool, len(kept))
	for _, id := range kept {
		extended[id] = true
	}
	for _, id := range ids {
		// No longer this consumer's while its handler runs: the pass took it. Said; never acknowledged twice by
		// this worker's doing.
		if f := w.inFlight[id]; f != nil && !extended[id] && !f.settled && !f.lost {
			f.lost = true
			w.log.Warn("a message being handled was taken by the operator's pass: it may be handled twice",
				"entry_id", id)
		}
	}
	return true
}

// lease runs lease.lua over ids, and so writes the heartbeat (once also without ids); it answers the ids still
// this consumer's.
func (w *Worker) lease(ctx context.Context, ids []string) ([]string, error) {
	var kept []string
	for start := 0; start == 0 || start < len(ids); start += idBatch {
		args := []any{w.opt.Group, w.opt.Consumer}
		for _, id := range ids[start:min(start+idBatch, len(ids))] {
			args = append(args, id)
		}
		extended, err := leaseScript.Run(ctx, w.client, []string{w.opt.Stream, w.consumersKey}, args...).StringSlice()
		if err != nil {
			return kept, err
		}
		kept = append(kept, extended...)
	}
	return kept, nil
}

// giveBack runs give_back.lua over ids with an idle time; uncount: the worker is leaving, the deliveries do not
// count and the consumer is deleted once it owns nothing (so it is called once even without ids). It answers how
// many were still this consumer's.
func (w *Worker) giveBack(ctx context.Context, ids []string, idle time.Duration, uncount bool) (int64, error) {
	flag := 0
	if uncount {
		flag = 1
	}
	var given int64
	for start := 0; start == 0 || start < len(ids); start += idBatch {
		args := []any{w.opt.Group, w.opt.Consumer, idle.Milliseconds(), flag}
		for _, id := range ids[start:min(start+idBatch, len(ids))] {
			args = append(args, id)
		}
		n, err := giveBackScript.Run(ctx, w.client, []string{w.opt.Stream}, args...).Int64()
		if err != nil {
			return given, err
		}
		given += n
	}
	return given, nil
}
