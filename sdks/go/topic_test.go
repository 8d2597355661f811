package pelican

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// Topics' producers: the partition of a key, keyed and round-robin publishes, refusals.

const testTopic = "orders"

func TestPartitionsVectorIsTheContracts(t *testing.T) {
	inTheRepository(t)
	want, err := os.ReadFile(filepath.Join(contractDir, "partitions.json"))
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile("testdata/partitions.json")
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("testdata/partitions.json differs from contract/partitions.json (run go generate): %v", err)
	}
}

func TestPartitionOfMatchesEveryCaseOfTheContractsVector(t *testing.T) {
	text, err := os.ReadFile("testdata/partitions.json")
	if err != nil {
		t.Fatal(err)
	}
	var vector struct {
		Cases []struct {
			Key        *string
			KeyHex     *string
			CRC32      uint32
			Partitions int
			Partition  int
		}
	}
	if err := json.Unmarshal(text, &vector); err != nil {
		t.Fatal(err)
	}
	if len(vector.Cases) < 54 {
		t.Fatalf("%d cases", len(vector.Cases))
	}
	for _, c := range vector.Cases {
		var key []byte
		switch {
		case c.Key != nil && c.KeyHex == nil:
			key = []byte(*c.Key)
		case c.Key == nil && c.KeyHex != nil:
			if key, err = hex.DecodeString(*c.KeyHex); err != nil {
				t.Fatal(err)
			}
		default:
			t.Fatalf("a case has key or keyHex: %+v", c)
		}
		if got := PartitionOf(key, c.Partitions); got != c.Partition {
			t.Errorf("PartitionOf(%q, %d) = %d, the contract says %d (crc32 %d)", key, c.Partitions, got,
				c.Partition, c.CRC32)
		}
	}
	if got := PartitionOf([]byte("123456789"), MaxPartitions); got != 0xCBF43926%1024 {
		t.Fatalf("the check value of CRC-32/ISO-HDLC gives %d", got)
	}
}

func TestAKeyedPublishGoesToTheKeysPartitionWithTheKeyFirst(t *testing.T) {
	c := newClient(t)
	c.HSet(bg, TopicKey(testTopic), "partitions", 4, "contractVersion", 2)
	p, err := NewTopicProducer(bg, noRetries(t, server.Addr), testTopic)
	if err != nil {
		t.Fatal(err)
	}
	if p.Partitions() != 4 {
		t.Fatalf("%d partitions", p.Partitions())
	}
	for _, key := range []string{"order-42", "order-7", ""} {
		published, err := p.PublishKeyed(bg, key, "n", "1")
		if err != nil {
			t.Fatal(err)
		}
		want := PartitionOf([]byte(key), 4)
		entries := c.Do(bg, "XRANGE", PartitionStream(testTopic, want), published.ID, published.ID).Val()
		if published.Partition != want || len(entries.([]any)) != 1 {
			t.Fatalf("key %q went to %+v, its partition is %d", key, published, want)
		}
		fields := entries.([]any)[0].([]any)[1].([]any)
		if len(fields) != 4 || fields[0] != KeyField || fields[1] != key || fields[2] != "n" {
			t.Fatalf("fields %v", fields)
		}
	}
}

func TestAPublishWithoutAKeyGoesRoundRobin(t *testing.T) {
	c := newClient(t)
	c.HSet(bg, TopicKey(testTopic), "partitions", 3, "contractVersion", 2)
	p, err := NewTopicProducer(bg, noRetries(t, server.Addr), testTopic)
	if err != nil {
		t.Fatal(err)
	}
	var went []int
	for range 6 {
		published, err := p.Publish(bg, "n", "1")
		if err != nil {
			t.Fatal(err)
		}
		went = append(went, published.Partition)
	}
	if want := []int{0, 1, 2, 0, 1, 2}; !slices.Equal(went, want) {
		t.Fatalf("went to %v, not %v", went, want)
	}
	for i := range 3 {
		if n := c.XLen(bg, PartitionStream(testTopic, i)).Val(); n != 2 {
			t.Fatalf("partition %d has %d entries", i, n)
		}
	}
}

func TestAPartitionsBoundRefusesAsAStreamsDoes(t *testing.T) {
	c := newClient(t)
	c.HSet(bg, TopicKey(testTopic), "partitions", 1, "contractVersion", 2)
	stream := PartitionStream(testTopic, 0)
	c.XGroupCreateMkStream(bg, stream, testGroup, "0")
	c.HSet(bg, BoundsKey(stream), testGroup, 1)
	p, err := NewTopicProducer(bg, noRetries(t, server.Addr), testTopic)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.PublishKeyed(bg, "a", "n", "1"); err != nil {
		t.Fatal(err)
	}
	var refused *RefusedError
	if _, err := p.PublishKeyed(bg, "a", "n", "2"); !errors.As(err, &refused) {
		t.Fatalf("got %v, not refused", err)
	}
}

func TestATopicProducerRefusesWhatIsNoTopicOfItsContract(t *testing.T) {
	c := newClient(t)
	_, err := NewTopicProducer(bg, noRetries(t, server.Addr), testTopic)
	var notATopic *NotATopicError
	if !errors.As(err, &notATopic) || !strings.Contains(err.Error(), `"orders" is not a topic`) {
		t.Fatalf("no description: %v", err)
	}
	c.HSet(bg, TopicKey(testTopic), "partitions", 4, "contractVersion", 3)
	_, err = NewTopicProducer(bg, noRetries(t, server.Addr), testTopic)
	var contract *TopicContractError
	if !errors.As(err, &contract) || !strings.Contains(err.Error(), `topic "orders" is described under worker contract "3"`) {
		t.Fatalf("contract 3: %v", err)
	}
}

func TestAnIdempotentPublishWithoutAKeyGoesToTheMessageIdsPartitionOnce(t *testing.T) {
	c := idmpClient(t)
	c.HSet(bg, TopicKey(testTopic), "partitions", 4, "contractVersion", 2)
	p, err := NewTopicProducer(bg, noRetries(t, c.Options().Addr), testTopic)
	if err != nil {
		t.Fatal(err)
	}
	ip, err := p.Idempotent(bg, "producer-0")
	if err != nil {
		t.Fatal(err)
	}
	first, err := ip.Publish(bg, "m-1", "n", "1")
	if err != nil {
		t.Fatal(err)
	}
	again, err := ip.Publish(bg, "m-1", "n", "1")
	if err != nil || again != first || first.Partition != PartitionOf([]byte("m-1"), 4) {
		t.Fatalf("first %+v, again %+v (%v)", first, again, err)
	}
	if n := c.XLen(bg, PartitionStream(testTopic, first.Partition)).Val(); n != 1 {
		t.Fatalf("%d entries", n)
	}
	keyed, err := ip.PublishKeyed(bg, "m-2", "order-42", "n", "2")
	if err != nil || keyed.Partition != PartitionOf([]byte("order-42"), 4) {
		t.Fatalf("keyed %+v (%v)", keyed, err)
	}
	if again, err := ip.PublishKeyed(bg, "m-2", "order-42", "n", "2"); err != nil || again != keyed {
		t.Fatalf("keyed again %+v (%v)", again, err)
	}
	fields := c.XRange(bg, PartitionStream(testTopic, keyed.Partition), keyed.ID, keyed.ID).Val()
	if len(fields) != 1 || fields[0].Values[KeyField] != "order-42" {
		t.Fatalf("entries %v", fields)
	}
}
