package main

import (
	"context"
	"errors"
	"testing"

	pelican "github.com/pelican-io/pelican/sdks/go"
)

type notifierFunc func(subscriberID, targetID string) error

func (f notifierFunc) Notify(_ context.Context, subscriberID, targetID string) error {
	return f(subscriberID, targetID)
}

// Not found is terminal (acknowledged, counted), an outage an error (no ACK, retried by the policy).
func TestTheOutcomes(t *testing.T) {
	outage := errors.New("provider unavailable")
	for subscriber, want := range map[string]struct {
		outcome pelican.Outcome
		err     error
	}{
		"42":   {pelican.Done(), nil},
		"gone": {pelican.Terminal("RecipientNotFound"), nil},
		"down": {pelican.Outcome{}, outage},
	} {
		h := handler(notifierFunc(func(subscriberID, targetID string) error {
			if subscriberID != subscriber || targetID != "7" {
				t.Errorf("notified %s about %s", subscriberID, targetID)
			}
			switch subscriberID {
			case "gone":
				return ErrRecipientNotFound
			case "down":
				return outage
			}
			return nil
		}))
		outcome, err := h(context.Background(), pelican.Message{ID: "1-0", Fields: []pelican.Field{
			{Name: "subscriberId", Value: subscriber}, {Name: "targetId", Value: "7"},
		}})
		if outcome != want.outcome || !errors.Is(err, want.err) {
			t.Errorf("%s: %v, %v; want %v, %v", subscriber, outcome, err, want.outcome, want.err)
		}
	}
}
