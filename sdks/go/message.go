package pelican

import (
	"context"
	"fmt"
	"regexp"
)

// Field is one field of a stream entry.
type Field struct {
	Name, Value string
}

// Message is one stream entry as the handler sees it: its fields in the entry's order, every one of a name that
// repeats; a requeued copy ends with OriginIDField and DeliveriesField.
type Message struct {
	ID     string
	Fields []Field
	// Partition is the partition of a topic the entry was read from (a TopicWorker's), -1 for a plain stream's.
	Partition int
}

// Key answers the message's key (its KeyField, which a keyed publish writes first), and whether it has one.
func (m Message) Key() (string, bool) { return m.Lookup(KeyField) }

// Get answers the first value of the field name, "" when the message has none (as http.Header's Get).
func (m Message) Get(name string) string {
	v, _ := m.Lookup(name)
	return v
}

// Lookup answers the first value of the field name, and whether the message has one.
func (m Message) Lookup(name string) (string, bool) {
	for _, f := range m.Fields {
		if f.Name == name {
			return f.Value, true
		}
	}
	return "", false
}

// Handler handles one message. A non-nil error (or a panic) is a failure: no ACK, the error's text recorded as the
// entry's last error, and the operator's pass retries the message as the policy says. ctx is cancelled when the
// shutdown grace ran out and the message was given back: stop the work, nothing returned after that is written.
type Handler func(ctx context.Context, m Message) (Outcome, error)

type outcomeKind uint8

const (
	invalidOutcome outcomeKind = iota // the zero Outcome: a failure, never an ACK
	doneOutcome
	retryOutcome
	terminalOutcome
)

// Outcome is how a handler ended a message: Done, Retry or Terminal. The zero Outcome is no outcome: returned
// without an error, it fails the message.
type Outcome struct {
	kind   outcomeKind
	reason string
}

// Done: processed, acknowledge (XACK).
func Done() Outcome { return Outcome{kind: doneOutcome} }

// Retry: failed, retry it under the policy's backoff without waiting minIdle; the delivery counts.
func Retry() Outcome { return Outcome{kind: retryOutcome} }

// Terminal: it will never succeed (the record it names is gone): acknowledge and count under reason, a CamelCase
// code such as "RecordNotFound". An invalid reason fails the message (never a silent ACK); see CheckReason.
func Terminal(reason string) Outcome { return Outcome{kind: terminalOutcome, reason: reason} }

func (o Outcome) String() string {
	switch o.kind {
	case doneOutcome:
		return "done"
	case retryOutcome:
		return "retry"
	case terminalOutcome:
		return "terminal(" + o.reason + ")"
	}
	return "no outcome"
}

var reasonPattern = regexp.MustCompile(`^[A-Z][A-Za-z0-9]{0,62}$`)

// InvalidReasonError: a terminal reason that is not CamelCase.
type InvalidReasonError struct{ Reason string }

func (e *InvalidReasonError) Error() string {
	return fmt.Sprintf("invalid terminal reason %q: it must be CamelCase, match %s (e.g. RecordNotFound)",
		e.Reason, reasonPattern)
}

// CheckReason returns an *InvalidReasonError unless reason matches ^[A-Z][A-Za-z0-9]{0,62}$. The operator's own
// reasons (MaxDeliveriesExceeded, InvalidDeliveryCount, NackedFatal, PayloadDeleted) should not be used.
func CheckReason(reason string) error {
	if !reasonPattern.MatchString(reason) {
		return &InvalidReasonError{Reason: reason}
	}
	return nil
}
