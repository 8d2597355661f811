// Seed 001's notification worker: each message asks to notify a subscriber about a target. No reclaim loop and no
// dead-letter table: the ConsumerGroupPolicy (examples/notifications.yaml) retries failures after minIdle and
// dead-letters a message at maxDeliveries, with its last error.
package main

import (
	"cmp"
	"context"
	"errors"
	"log"
	"os"
	"os/signal"
	"syscall"

	pelican "github.com/pelican-io/pelican/sdks/go"
	"github.com/redis/go-redis/v9"
)

// ErrRecipientNotFound: the subscriber no longer exists.
var ErrRecipientNotFound = errors.New("recipient not found")

// Notifier sends notifications (push, mail, ...): ErrRecipientNotFound for a subscriber that is gone, another
// error when the provider is down.
type Notifier interface {
	Notify(ctx context.Context, subscriberID, targetID string) error
}

func handler(n Notifier) pelican.Handler {
	return func(ctx context.Context, m pelican.Message) (pelican.Outcome, error) {
		err := n.Notify(ctx, m.Get("subscriberId"), m.Get("targetId"))
		if errors.Is(err, ErrRecipientNotFound) {
			return pelican.Terminal("RecipientNotFound"), nil // no retry will find them
		}
		if err != nil {
			return pelican.Outcome{}, err // a provider outage: retried by the policy
		}
		return pelican.Done(), nil
	}
}

// logNotifier stands for the provider.
type logNotifier struct{}

func (logNotifier) Notify(_ context.Context, subscriberID, targetID string) error {
	log.Printf("notify subscriber %s about %s", subscriberID, targetID)
	return nil
}

func main() {
	options, err := redis.ParseURL(cmp.Or(os.Getenv("REDIS_URL"), "redis://127.0.0.1:6379"))
	if err != nil {
		log.Fatal(err)
	}
	worker, err := pelican.NewWorker(redis.NewClient(options), pelican.WorkerOptions{Stream: "notifications", Group: "notifier"})
	if err != nil {
		log.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	stats, err := worker.Run(ctx, handler(logNotifier{})) // until SIGTERM: finishes or gives back within the grace
	log.Printf("%+v %v", stats, err)
}
