package pelican

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// The worker reads entries with raw commands and parses the replies itself: go-redis' XReadGroup and XRange answer
// an entry's fields as a map, which loses their order and all but the last value of a name that repeats.

// doer sends a raw command: a client or a pipeline.
type doer interface {
	Do(ctx context.Context, args ...any) *redis.Cmd
}

// xReadGroup sends XREADGROUP ... STREAMS stream id; block < 0: without BLOCK. Its reply waits at most the client's
// ReadTimeout, which NewWorker checks Block against.
func xReadGroup(ctx context.Context, c doer, group, consumer, stream, id string, count int,
	block time.Duration,
) *redis.Cmd {
	args := []any{"XREADGROUP", "GROUP", group, consumer, "COUNT", count}
	if block >= 0 {
		args = append(args, "BLOCK", block.Milliseconds())
	}
	return c.Do(ctx, append(args, "STREAMS", stream, id)...)
}

// readReply is the entries of an XREADGROUP reply of one stream (a map in RESP3, pairs in RESP2); none for the nil
// reply of a read that found nothing. An entry whose payload was deleted has nil Fields.
func readReply(cmd *redis.Cmd) ([]Message, error) {
	v, err := cmd.Result()
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	switch streams := v.(type) {
	case map[any]any:
		for _, entries := range streams {
			return parseEntries(entries)
		}
		return nil, nil
	case []any:
		if len(streams) == 0 {
			return nil, nil
		}
		if pair, ok := streams[0].([]any); ok && len(pair) == 2 {
			return parseEntries(pair[1])
		}
	}
	return nil, fmt.Errorf("pelican: unexpected XREADGROUP reply %v", v)
}

// rangeReply is the entries of an XRANGE reply.
func rangeReply(cmd *redis.Cmd) ([]Message, error) {
	v, err := cmd.Result()
	if err != nil {
		return nil, err
	}
	return parseEntries(v)
}

func parseEntries(v any) ([]Message, error) {
	list, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("pelican: unexpected list of entries %v", v)
	}
	found := make([]Message, 0, len(list))
	for _, item := range list {
		e, ok := item.([]any)
		if !ok || len(e) < 2 {
			return nil, fmt.Errorf("pelican: unexpected entry %v", item)
		}
		id, ok := e[0].(string)
		if !ok {
			return nil, fmt.Errorf("pelican: unexpected entry id %v", e[0])
		}
		m := Message{ID: id}
		if pairs, ok := e[1].([]any); ok { // nil: its payload was deleted
			m.Fields = make([]Field, 0, len(pairs)/2)
			for i := 0; i+1 < len(pairs); i += 2 {
				m.Fields = append(m.Fields, Field{Name: text(pairs[i]), Value: text(pairs[i+1])})
			}
		}
		found = append(found, m)
	}
	return found, nil
}

func text(v any) string {
	if s, ok := v.(string); ok {
		return s
	}
	return fmt.Sprint(v)
}

// payloads are the messages that still have one: an entry deleted while pending is no message (the operator's
// pass drops it).
func payloads(entries []Message) []Message {
	found := entries[:0:0]
	for _, m := range entries {
		if m.Fields != nil {
			found = append(found, m)
		}
	}
	return found
}
