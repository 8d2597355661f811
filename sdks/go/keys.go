package pelican

import (
	"os"
	"strconv"
	"strings"
)

// Fields the operator's pass adds last to a requeued copy, after the application's own.
const (
	// OriginIDField holds the id the message was first published under.
	OriginIDField = "pelican-origin-id"
	// DeliveriesField holds the deliveries before this copy: a copy is a retry, and may have a last error.
	DeliveriesField = "pelican-deliveries"
)

// ErrorTextMax is the most bytes of a message's last error a worker writes.
const ErrorTextMax = 1024

// HashTag is the stream's hash tag: the content of the first {...} of the name when it is not empty, else the
// whole name (Redis Cluster's rule: the first '{' and the first '}' after it). Every Pelican key of a stream
// lives in the stream's hash slot.
func HashTag(stream string) string {
	if open := strings.IndexByte(stream, '{'); open >= 0 {
		if close := strings.IndexByte(stream[open+1:], '}'); close > 0 {
			return stream[open+1 : open+1+close]
		}
	}
	return stream
}

func streamPrefix(stream string) string {
	return "{" + HashTag(stream) + "}:pelican:" + stream + ":"
}

// SettingsKey is {T}:pelican:<stream>:<group>:settings, the group's settings written by the operator.
func SettingsKey(stream, group string) string { return streamPrefix(stream) + group + ":settings" }

// TerminalKey is {T}:pelican:<stream>:<group>:terminal: reason -> messages ended as terminal.
func TerminalKey(stream, group string) string { return streamPrefix(stream) + group + ":terminal" }

// ErrorsKey is {T}:pelican:<stream>:<group>:errors: pending entry id -> the text of its last failure.
func ErrorsKey(stream, group string) string { return streamPrefix(stream) + group + ":errors" }

// ConsumersKey is {T}:pelican:<stream>:<group>:consumers: consumer -> its last lease tick (the server's time, ms),
// the heartbeat strategy: Reassign hands work to live workers by.
func ConsumersKey(stream, group string) string { return streamPrefix(stream) + group + ":consumers" }

// BoundsKey is {T}:pelican:<stream>:bounds: group -> backlog.maxLength, read by the bounded publish scripts.
func BoundsKey(stream string) string { return streamPrefix(stream) + "bounds" }

// RejectedKey is {T}:pelican:<stream>:rejected: group -> publishes refused for it.
func RejectedKey(stream string) string { return streamPrefix(stream) + "rejected" }

// PodName is the default consumer (and producer) name: POD_NAME, else HOSTNAME, else the host name.
// spec.consumers.pods matches consumers to Pods by this name.
func PodName() string {
	for _, name := range []string{"POD_NAME", "HOSTNAME"} {
		if v := os.Getenv(name); v != "" {
			return v
		}
	}
	host, _ := os.Hostname()
	return host
}

// KeyField is the first field of a message published with a key: the key's bytes. A worker of a PerKey topic
// handles the entries of one key in order; an entry without it is a key of its own.
const KeyField = "pelican-key"

// PartitionStream is {T:i}, partition i of topic T: the whole name is its hash tag, so each partition has a slot
// of its own. Every per-stream key (SettingsKey, ErrorsKey, ...) applies to it unchanged. A topic name holds no
// '{' or '}' (the operator's admission refuses one).
func PartitionStream(topic string, partition int) string {
	return "{" + topic + ":" + strconv.Itoa(partition) + "}"
}

// TopicKey is {T}:pelican:T:topic, what a producer needs of topic T whatever the group: partitions and
// contractVersion.
func TopicKey(topic string) string { return streamPrefix(topic) + "topic" }

// MembersKey is {T}:pelican:T:<group>:members: member -> its lease deadline (membership.lua).
func MembersKey(topic, group string) string { return streamPrefix(topic) + group + ":members" }

// OwnersKey is {T}:pelican:T:<group>:owners: partition index -> the member that owns it (membership.lua).
func OwnersKey(topic, group string) string { return streamPrefix(topic) + group + ":owners" }

// EpochsKey is {T}:pelican:T:<group>:epochs: partition index -> its epoch, incremented at every hand-over.
func EpochsKey(topic, group string) string { return streamPrefix(topic) + group + ":epochs" }
