package pelican

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"sync"

	"github.com/redis/go-redis/v9"
)

// Topics (contract/README.md, "Topics (contract version 2)"): a policy with spec.partitions makes its stream T a
// topic of N partition streams {T:0} .. {T:N-1}, which a Redis Cluster spreads over its shards.

// The test vector of PartitionOf, copied byte for byte (TestPartitionsVectorIsTheContracts fails while the copy
// differs).
//
//go:generate cp ../../contract/partitions.json testdata/

// TopicContractVersion is the worker contract of a topic: its settings and its description say it.
const TopicContractVersion = 2

// MaxPartitions is the most partitions a topic has (the operator's admission refuses more).
const MaxPartitions = 1024

// PartitionOf is the partition of key in a topic of partitions: CRC-32 (ISO-HDLC, zlib's) of its bytes, modulo
// partitions, as every library computes it (contract/partitions.json). It panics on partitions < 1.
func PartitionOf(key []byte, partitions int) int {
	if partitions < 1 {
		panic(fmt.Sprintf("pelican: a topic has 1 or more partitions, not %d", partitions))
	}
	return int(crc32.ChecksumIEEE(key) % uint32(partitions))
}

// NotATopicError: no policy with spec.partitions describes the topic (yet), for the group when Group is set (a
// worker) or for any group (a producer).
type NotATopicError struct {
	Topic, Group string
}

func (e *NotATopicError) Error() string {
	if e.Group != "" {
		return fmt.Sprintf("pelican: the settings of %q group %q describe no topic: apply its policy with "+
			"spec.partitions, or run a Worker for a stream", e.Topic, e.Group)
	}
	return fmt.Sprintf("pelican: %q is not a topic: no policy with spec.partitions describes it (yet); apply one, "+
		"or publish with a Producer if it is a plain stream", e.Topic)
}

// TopicContractError: the topic is described under a worker contract this library does not know for topics.
type TopicContractError struct {
	Topic string
	// Operator is the contractVersion the operator wrote ("" when there is none).
	Operator string
}

func (e *TopicContractError) Error() string {
	return fmt.Sprintf("pelican: topic %q is described under worker contract %q, this library knows topics of %d: "+
		"upgrade the library (go get -u github.com/pelican-io/pelican/sdks/go)", e.Topic, e.Operator,
		TopicContractVersion)
}

// topicPartitions reads N from a topic's description or settings hash, the version first: a later version may
// describe partitions anew. group is "" for the description.
func topicPartitions(topic, group string, fields map[string]string) (int, error) {
	version, hasVersion := fields["contractVersion"]
	partitions, err := decimal(fields["partitions"])
	if hasVersion && version != fmt.Sprint(TopicContractVersion) || !hasVersion && err == nil {
		return 0, &TopicContractError{Topic: topic, Operator: version}
	}
	if err != nil || partitions < 1 || partitions > MaxPartitions {
		return 0, &NotATopicError{Topic: topic, Group: group}
	}
	return int(partitions), nil
}

// TopicPublished is where a message went: its partition, and its entry id in that partition's stream.
type TopicPublished struct {
	Partition int
	ID        string
}

// TopicProducer publishes into the partitions of one topic: a message with a key to the key's partition (the key
// its first field, KeyField), one without round robin. Each partition is published to as a Producer publishes to
// its stream (bounded_publish.lua): a partition's bound refuses as a stream's does. Safe for concurrent use.
type TopicProducer struct {
	topic     string
	client    redis.UniversalClient
	producers []*Producer

	mu   sync.Mutex
	next int // the round robin's next partition
}

// NewTopicProducer reads the topic's description ({T}:pelican:T:topic) and returns its producer: a
// *NotATopicError when no policy describes it, a *TopicContractError when it is described under a contract this
// library does not know. The client must not resend a command after a lost reply (see NewProducer).
func NewTopicProducer(ctx context.Context, client redis.UniversalClient, topic string) (*TopicProducer, error) {
	if client == nil || topic == "" {
		return nil, errors.New("pelican: NewTopicProducer needs a client and a topic")
	}
	if err := checkNoResends(client); err != nil {
		return nil, err
	}
	description, err := client.HGetAll(ctx, TopicKey(topic)).Result()
	if err != nil {
		return nil, fmt.Errorf("pelican: could not read the description of topic %q: %w", topic, err)
	}
	partitions, err := topicPartitions(topic, "", description)
	if err != nil {
		return nil, err
	}
	p := &TopicProducer{topic: topic, client: client, producers: make([]*Producer, partitions)}
	for i := range p.producers {
		stream := PartitionStream(topic, i)
		p.producers[i] = &Producer{client: client, stream: stream,
			keys: []string{stream, BoundsKey(stream), RejectedKey(stream)}, meter: newProducerMeter(stream)}
	}
	return p, nil
}

// Topic is the topic published into.
func (p *TopicProducer) Topic() string { return p.topic }

// Partitions is N: {T:0} .. {T:N-1}.
func (p *TopicProducer) Partitions() int { return len(p.producers) }

// Publish adds one entry of field/value pairs to the next partition round robin (one step per call).
func (p *TopicProducer) Publish(ctx context.Context, fieldsAndValues ...string) (TopicPublished, error) {
	if err := checkPairs(fieldsAndValues); err != nil {
		return TopicPublished{}, err
	}
	p.mu.Lock()
	partition := p.next
	p.next = (p.next + 1) % len(p.producers)
	p.mu.Unlock()
	id, err := p.producers[partition].publish(ctx, stringArgs(nil, fieldsAndValues), sendDetails{})
	return TopicPublished{Partition: partition, ID: id}, err
}

// PublishKeyed adds one entry to the partition of key (its bytes; "" is a key too), with KeyField=key as its
// first field, then fieldsAndValues in order. The errors are a Producer's for that partition's stream.
func (p *TopicProducer) PublishKeyed(ctx context.Context, key string, fieldsAndValues ...string) (TopicPublished, error) {
	if err := checkPairs(fieldsAndValues); err != nil {
		return TopicPublished{}, err
	}
	partition := PartitionOf([]byte(key), len(p.producers))
	id, err := p.producers[partition].publish(ctx, stringArgs([]any{KeyField, key}, fieldsAndValues),
		sendDetails{key: &key})
	return TopicPublished{Partition: partition, ID: id}, err
}

// Idempotent returns this producer's idempotent form under producerID (default PodName()), as
// NewIdempotentProducer: it wraps ErrIdempotenceUnsupported on a server without XADD ... IDMP.
func (p *TopicProducer) Idempotent(ctx context.Context, producerID string) (*IdempotentTopicProducer, error) {
	// The check is the server's, the same for every partition.
	first, err := NewIdempotentProducer(ctx, p.client, PartitionStream(p.topic, 0), producerID)
	if err != nil {
		return nil, err
	}
	return &IdempotentTopicProducer{producer: p, producerID: first.ProducerID()}, nil
}

// IdempotentTopicProducer publishes into a topic with XADD ... IDMP, as an IdempotentProducer does into a stream.
// A message without a key goes to the partition of its message id rather than round robin, so that publishing it
// again reaches the partition that has it.
type IdempotentTopicProducer struct {
	producer   *TopicProducer
	producerID string
	carried    carriedFields
}

// ProducerID is the id every publish carries.
func (p *IdempotentTopicProducer) ProducerID() string { return p.producerID }

// Partitions is N.
func (p *IdempotentTopicProducer) Partitions() int { return p.producer.Partitions() }

// Publish adds the message messageID once within the window, to the partition of messageID; publishing it again
// answers the first entry's id.
func (p *IdempotentTopicProducer) Publish(ctx context.Context, messageID string, fieldsAndValues ...string) (TopicPublished, error) {
	if err := checkPairs(fieldsAndValues); err != nil {
		return TopicPublished{}, err
	}
	return p.publish(ctx, PartitionOf([]byte(messageID), p.Partitions()), messageID, nil, fieldsAndValues)
}

// PublishKeyed adds the message messageID once within the window, to the partition of key, with KeyField=key first.
func (p *IdempotentTopicProducer) PublishKeyed(ctx context.Context, messageID, key string, fieldsAndValues ...string) (TopicPublished, error) {
	if err := checkPairs(fieldsAndValues); err != nil {
		return TopicPublished{}, err
	}
	return p.publish(ctx, PartitionOf([]byte(key), p.Partitions()), messageID, &key,
		append([]string{KeyField, key}, fieldsAndValues...))
}

func (p *IdempotentTopicProducer) publish(ctx context.Context, partition int, messageID string, key *string, fields []string) (TopicPublished, error) {
	args := stringArgs([]any{"IDMP", p.producerID, messageID}, fields)
	id, err := p.producer.producers[partition].publish(ctx, args,
		sendDetails{key: key, messageID: messageID, carried: &p.carried})
	return TopicPublished{Partition: partition, ID: id}, err
}
