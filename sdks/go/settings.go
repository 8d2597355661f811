package pelican

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"
)

// KnownContractVersions are the worker contract versions this library implements.
var KnownContractVersions = []int{1}

// Without settings (no policy yet, or an ACL that refuses the read) a worker leases every second and gives back
// with Pelican's default minIdle.
const (
	unpublishedIdle          = 300 * time.Second
	unpublishedLeaseInterval = time.Second
)

// Settings are the fields of the group's settings hash a worker reads.
type Settings struct {
	MinIdle    time.Duration
	RetryAfter time.Duration
	// MaxDeliveries is the policy's retry cap (0 when the hash has none); the operator's pass enforces it.
	MaxDeliveries   int
	ContractVersion int
}

// ContractVersionError: the operator speaks a worker contract this library does not know. A worker refuses to
// start (Run returns it before reading anything).
type ContractVersionError struct {
	// Operator is the contractVersion the operator published, as written.
	Operator string
	// known are the versions the reader speaks: KnownContractVersions, or TopicContractVersion on a partition.
	known []int
}

func (e *ContractVersionError) Error() string {
	versions := e.known
	if versions == nil {
		versions = KnownContractVersions
	}
	known := make([]string, len(versions))
	for i, v := range versions {
		known[i] = strconv.Itoa(v)
	}
	return fmt.Sprintf("the operator speaks worker contract %s, this library knows %s: upgrade the library "+
		"(go get -u github.com/pelican-io/pelican/sdks/go)", e.Operator, strings.Join(known, ", "))
}

// ErrInvalidSettings wraps what is wrong with a settings hash that is not the contract's.
var ErrInvalidSettings = errors.New("pelican: invalid group settings")

// ParseSettings reads an HGETALL reply of the settings hash, each field by name. An empty hash (no policy publishes
// settings yet) is nil, nil. A hash without contractVersion was written before the contract had one: version 1.
// An unknown version is a *ContractVersionError; a missing minIdleMs or retryAfterMs, or a field that is no decimal
// integer, wraps ErrInvalidSettings: never a silent default, which would lease at the wrong pace.
func ParseSettings(fields map[string]string) (*Settings, error) {
	return parseSettings(fields, KnownContractVersions)
}

// parseSettings is ParseSettings for a reader that speaks the versions known (a topic's partition: 2 only).
func parseSettings(fields map[string]string, known []int) (*Settings, error) {
	if len(fields) == 0 {
		return nil, nil
	}
	s := &Settings{ContractVersion: 1}
	if _, ok := fields["contractVersion"]; !ok && !slices.Contains(known, 1) {
		return nil, &ContractVersionError{Operator: "", known: known}
	}
	if text, ok := fields["contractVersion"]; ok {
		v, err := decimal(text)
		if err != nil || !slices.Contains(known, int(v)) {
			return nil, &ContractVersionError{Operator: text, known: known}
		}
		s.ContractVersion = int(v)
	}
	minIdle, hasMinIdle, err := field(fields, "minIdleMs")
	if err != nil {
		return nil, err
	}
	retryAfter, hasRetryAfter, err := field(fields, "retryAfterMs")
	if err != nil {
		return nil, err
	}
	maxDeliveries, _, err := field(fields, "maxDeliveries")
	if err != nil {
		return nil, err
	}
	if !hasMinIdle || !hasRetryAfter {
		var missing []string
		if !hasMinIdle {
			missing = append(missing, "minIdleMs")
		}
		if !hasRetryAfter {
			missing = append(missing, "retryAfterMs")
		}
		names := slices.Sorted(maps.Keys(fields))
		return nil, fmt.Errorf("%w: no %s (fields: %s)", ErrInvalidSettings, strings.Join(missing, " and "),
			strings.Join(names, ", "))
	}
	s.MinIdle = time.Duration(minIdle) * time.Millisecond
	s.RetryAfter = time.Duration(retryAfter) * time.Millisecond
	s.MaxDeliveries = int(maxDeliveries)
	return s, nil
}

// field is a decimal field of the hash, and whether it is there.
func field(fields map[string]string, name string) (int64, bool, error) {
	text, ok := fields[name]
	if !ok {
		return 0, false, nil
	}
	v, err := decimal(text)
	if err != nil {
		return 0, true, fmt.Errorf("%w: field %s is %q, not a decimal integer", ErrInvalidSettings, name, text)
	}
	return v, true, nil
}

// decimal parses digits only: no sign, no spaces, at most 18 of them (no overflow).
func decimal(text string) (int64, error) {
	if text == "" || len(text) > 18 || strings.TrimLeft(text, "0123456789") != "" {
		return 0, strconv.ErrSyntax
	}
	return strconv.ParseInt(text, 10, 64)
}

// LeaseInterval is the time between lease ticks: min(minIdle/3, 10 s), never under 100 ms; 1 s without settings.
func LeaseInterval(s *Settings) time.Duration {
	if s == nil {
		return unpublishedLeaseInterval
	}
	return min(max(s.MinIdle/3, 100*time.Millisecond), 10*time.Second)
}
