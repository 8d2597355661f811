package pelican

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"
)

// The outcomes of a publish that returned no id. Tell them apart with errors.Is and errors.As:
//
//	*RefusedError          a bounded group's backlog is full: nothing written; publish later, with backoff and jitter
//	ErrUnavailable         the server cannot take writes now (READONLY, LOADING, ...): nothing written; try again
//	ErrFailed              the server refused with another error: nothing written; fix the cause
//	*OutcomeUnknownError   the connection broke or timed out after the call was sent: it may be written
var (
	ErrUnavailable = errors.New("pelican: unavailable, nothing written (try again)")
	ErrFailed      = errors.New("pelican: publish failed, nothing written")
	// ErrIdempotenceUnsupported: the server has no XADD ... IDMP (Redis 8.6 or later).
	ErrIdempotenceUnsupported = errors.New("pelican: the server has no XADD ... IDMP (Redis 8.6 or later): a " +
		"retried publish may duplicate; publish with Producer and reconcile by an id of your own in the fields")
)

// RefusedError: a bounded group's backlog is full, nothing was written (PELICAN_BACKLOG_FULL).
type RefusedError struct {
	Group   string
	Backlog int64
	Max     int64
}

func (e *RefusedError) Error() string {
	return fmt.Sprintf("pelican: refused: the backlog of group %q is %d, its bound is %d", e.Group, e.Backlog, e.Max)
}

// OutcomeUnknownError: the call may have reached the server and the entry may be in the stream. Publishing again
// may write it twice: reconcile first, or publish with an IdempotentProducer.
type OutcomeUnknownError struct{ Err error }

func (e *OutcomeUnknownError) Error() string {
	return "pelican: outcome unknown (may have been written): " + e.Err.Error()
}

func (e *OutcomeUnknownError) Unwrap() error { return e.Err }

// Published is what a batch wrote: its first len(IDs) entries, in order. When Refused is set the bound had no room
// for the rest, which were certainly not written.
type Published struct {
	IDs     []string
	Refused *RefusedError
}

// Producer publishes into a stream through bounded_publish.lua, which refuses a publish while a bounded group's
// backlog is full.
type Producer struct {
	client redis.UniversalClient
	stream string
	keys   []string
	meter  *producerMeter
}

// NewProducer returns a producer of stream on client. The client must not resend a command after a lost reply,
// or a publish would be written twice: NewProducer refuses a *redis.Client or *redis.Ring without MaxRetries: -1,
// and a *redis.ClusterClient without MaxRedirects: -1 as well (its redirect loop resends after a broken
// connection). Any other client is trusted to be configured so.
func NewProducer(client redis.UniversalClient, stream string) (*Producer, error) {
	if client == nil || stream == "" {
		return nil, errors.New("pelican: NewProducer needs a client and a stream")
	}
	if err := checkNoResends(client); err != nil {
		return nil, err
	}
	return &Producer{
		client: client,
		stream: stream,
		keys:   []string{stream, BoundsKey(stream), RejectedKey(stream)},
		meter:  newProducerMeter(stream),
	}, nil
}

// checkNoResends reads the options after go-redis applied its defaults, where -1 became 0 (no retry) and 0 became 3.
func checkNoResends(client redis.UniversalClient) error {
	var retries int
	var setting string
	switch c := client.(type) {
	case *redis.Client:
		retries, setting = c.Options().MaxRetries, "MaxRetries: -1"
	case *redis.Ring:
		retries, setting = c.Options().MaxRetries, "MaxRetries: -1"
	case *redis.ClusterClient:
		retries, setting = max(c.Options().MaxRetries, c.Options().MaxRedirects), "MaxRetries: -1 and MaxRedirects: -1"
	}
	if retries > 0 {
		return fmt.Errorf("pelican: the publishing client resends a command after a lost reply (%d times), which "+
			"would write a message twice: give the producer a client of its own with %s", retries, setting)
	}
	return nil
}

// Publish adds one entry of field/value pairs, in order, and returns its id.
func (p *Producer) Publish(ctx context.Context, fieldsAndValues ...string) (string, error) {
	if err := checkPairs(fieldsAndValues); err != nil {
		return "", err
	}
	return p.publish(ctx, stringArgs(nil, fieldsAndValues), sendDetails{})
}

// PublishBatch adds entries in order, with one backlog check for all, as many as every bounded group has room for.
// An *OutcomeUnknownError means any first part of the batch may be written.
func (p *Producer) PublishBatch(ctx context.Context, entries [][]string) (Published, error) {
	args := make([][]any, len(entries))
	for i, fields := range entries {
		if err := checkPairs(fields); err != nil {
			return Published{}, fmt.Errorf("entry %d: %w", i, err)
		}
		args[i] = stringArgs(nil, fields)
	}
	return p.publishBatch(ctx, args)
}

// publish sends one entry (its IDMP ids first, when idempotent) in a span of its own, whose context the entry
// carries after its fields.
func (p *Producer) publish(ctx context.Context, args []any, details sendDetails) (string, error) {
	if err := ctx.Err(); err != nil {
		return "", err // never sent
	}
	s := startSending(ctx, p.stream, details)
	id, err := boundedPublishScript.Run(ctx, p.client, p.keys, append(args, s.fields...)...).Text()
	if err != nil {
		err = classify(err)
		p.meter.notSent(1, err)
		s.failed(err)
		return "", err
	}
	p.meter.add(1, p.meter.written)
	s.sent(id)
	return id, nil
}

func (p *Producer) publishBatch(ctx context.Context, entries [][]any) (Published, error) {
	if len(entries) == 0 {
		return Published{}, nil
	}
	if err := ctx.Err(); err != nil {
		return Published{}, err // never sent
	}
	// One span for the batch, whose context every entry carries.
	s := startSending(ctx, p.stream, sendDetails{count: len(entries)})
	args := []any{len(entries)}
	for _, entry := range entries {
		args = append(append(append(args, len(entry)+len(s.fields)), entry...), s.fields...)
	}
	reply, err := boundedBatchScript.Run(ctx, p.client, p.keys, args...).Slice()
	if err != nil {
		err = classify(err)
		p.meter.notSent(len(entries), err)
		s.failed(err)
		return Published{}, err
	}
	s.sent("")
	// {ids, refusal}: refusal is empty, or {group, backlog, max}.
	if len(reply) != 2 {
		return Published{}, fmt.Errorf("%w: unexpected reply %v", ErrFailed, reply)
	}
	ids, _ := reply[0].([]any)
	published := Published{IDs: make([]string, len(ids))}
	for i, id := range ids {
		published.IDs[i] = fmt.Sprint(id)
	}
	if refusal, _ := reply[1].([]any); len(refusal) == 3 {
		backlog, _ := refusal[1].(int64)
		limit, _ := refusal[2].(int64)
		published.Refused = &RefusedError{Group: fmt.Sprint(refusal[0]), Backlog: backlog, Max: limit}
	}
	p.meter.add(len(published.IDs), p.meter.written)
	p.meter.add(len(entries)-len(published.IDs), p.meter.refused)
	return published, nil
}

// unavailable are the server's codes after which nothing was written and trying again may succeed; MOVED, ASK and
// CLUSTERDOWN too, on a cluster client that does not follow redirects.
var unavailable = []string{"READONLY", "LOADING", "MASTERDOWN", "BUSY", "TRYAGAIN", "MOVED", "ASK", "CLUSTERDOWN"}

// classify turns an error of a publish into its outcome.
func classify(err error) error {
	var server redis.Error
	if errors.As(err, &server) {
		text := server.Error()
		code, rest, _ := strings.Cut(text, " ")
		switch {
		case code == "PELICAN_BACKLOG_FULL":
			if refused := parseRefusal(rest); refused != nil {
				return refused
			}
		case code == "PELICAN_PARTIAL": // a batch that failed after its first entries were added
			return &OutcomeUnknownError{Err: err}
		}
		for _, c := range unavailable {
			if code == c {
				return fmt.Errorf("%w: %w", ErrUnavailable, err)
			}
		}
		return fmt.Errorf("%w: %w", ErrFailed, err)
	}
	// Nothing was sent when no connection could be had: none could be opened, or the pool had none free.
	var op *net.OpError
	if (errors.As(err, &op) && op.Op == "dial") || errors.Is(err, redis.ErrPoolTimeout) ||
		errors.Is(err, redis.ErrPoolExhausted) {
		return fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	if errors.Is(err, redis.ErrClosed) {
		return fmt.Errorf("%w: %w", ErrFailed, err)
	}
	// A broken connection, a timeout, a cancelled context: the call may have reached the server.
	return &OutcomeUnknownError{Err: err}
}

// parseRefusal reads "<group> <backlog> <max>"; the group's name may hold spaces.
func parseRefusal(text string) *RefusedError {
	rest, limitText, ok1 := cutLast(text)
	group, backlogText, ok2 := cutLast(rest)
	backlog, err1 := strconv.ParseInt(backlogText, 10, 64)
	limit, err2 := strconv.ParseInt(limitText, 10, 64)
	if !ok1 || !ok2 || err1 != nil || err2 != nil {
		return nil
	}
	return &RefusedError{Group: group, Backlog: backlog, Max: limit}
}

func cutLast(s string) (before, after string, found bool) {
	i := strings.LastIndexByte(s, ' ')
	if i < 0 {
		return s, "", false
	}
	return s[:i], s[i+1:], true
}

func checkPairs(fieldsAndValues []string) error {
	if len(fieldsAndValues) == 0 || len(fieldsAndValues)%2 != 0 {
		return fmt.Errorf("pelican: an entry needs field/value pairs, got %d strings", len(fieldsAndValues))
	}
	return nil
}

func stringArgs(args []any, values []string) []any {
	for _, v := range values {
		args = append(args, v)
	}
	return args
}

// IdempotentProducer publishes with XADD ... IDMP <producer id> <message id> (Redis 8.6+): within the stream's
// window, a publish of a message id this producer already published writes nothing and answers the first entry's
// id, so a publish that ended *OutcomeUnknownError is simply published again with the same message id.
type IdempotentProducer struct {
	producer   *Producer
	producerID string
	carried    carriedFields
}

// IdempotentEntry is one entry of an idempotent batch.
type IdempotentEntry struct {
	// MessageID is the application's (an order number), never random per attempt.
	MessageID string
	// Fields are field/value pairs, in order.
	Fields []string
}

// NewIdempotentProducer returns an idempotent producer of stream under producerID (default PodName(): stable
// across restarts, unique among the stream's producers). It asks the server whether XADD takes IDMP (COMMAND DOCS
// XADD: by the command's arguments, not by the server's version) and wraps ErrIdempotenceUnsupported when not.
func NewIdempotentProducer(ctx context.Context, client redis.UniversalClient, stream, producerID string) (*IdempotentProducer, error) {
	producer, err := NewProducer(client, stream)
	if err != nil {
		return nil, err
	}
	if producerID == "" {
		producerID = PodName()
	}
	if producerID == "" {
		return nil, errors.New("pelican: the producer id is empty: give one stable across restarts, e.g. the Pod's name")
	}
	docs, err := client.Do(ctx, "COMMAND", "DOCS", "XADD").Result()
	var server redis.Error
	if errors.As(err, &server) {
		return nil, fmt.Errorf("%w (COMMAND DOCS XADD: %w)", ErrIdempotenceUnsupported, err)
	}
	if err != nil {
		return nil, err
	}
	if !hasToken(docs, "IDMP") {
		return nil, ErrIdempotenceUnsupported
	}
	return &IdempotentProducer{producer: producer, producerID: producerID}, nil
}

// ProducerID is the id every publish carries.
func (p *IdempotentProducer) ProducerID() string { return p.producerID }

// Publish adds the entry unless this producer published messageID within the window; either way it answers the id
// of the one entry that holds it.
func (p *IdempotentProducer) Publish(ctx context.Context, messageID string, fieldsAndValues ...string) (string, error) {
	if err := checkPairs(fieldsAndValues); err != nil {
		return "", err
	}
	return p.producer.publish(ctx, stringArgs([]any{"IDMP", p.producerID, messageID}, fieldsAndValues),
		sendDetails{messageID: messageID, carried: &p.carried})
}

// PublishBatch is Producer.PublishBatch with a message id per entry; a batch that ended *OutcomeUnknownError is
// simply published again whole.
func (p *IdempotentProducer) PublishBatch(ctx context.Context, entries []IdempotentEntry) (Published, error) {
	args := make([][]any, len(entries))
	for i, e := range entries {
		if err := checkPairs(e.Fields); err != nil {
			return Published{}, fmt.Errorf("entry %d: %w", i, err)
		}
		args[i] = stringArgs([]any{"IDMP", p.producerID, e.MessageID}, e.Fields)
	}
	return p.producer.publishBatch(ctx, args)
}

// hasToken tells whether a COMMAND DOCS reply (RESP2 flat lists or RESP3 maps) has an argument of that token.
func hasToken(reply any, token string) bool {
	switch r := reply.(type) {
	case map[any]any:
		for k, v := range r {
			if isWord(k, "token") && isWord(v, token) || hasToken(v, token) {
				return true
			}
		}
	case []any:
		// RESP2 spells a map as a flat list: a name is followed by its value.
		for i, v := range r {
			if i+1 < len(r) && isWord(v, "token") && isWord(r[i+1], token) || hasToken(v, token) {
				return true
			}
		}
	}
	return false
}

func isWord(v any, word string) bool {
	s, ok := v.(string)
	return ok && strings.EqualFold(s, word)
}
