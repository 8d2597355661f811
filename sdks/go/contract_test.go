package pelican

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// The contract's pieces without a server: script copies, key names, settings, reasons, error texts.

// contractDir is the repository's contract, when the module is tested in the repository (not from a copy of its
// own: then the copies are checked there).
const contractDir = "../../contract"

func inTheRepository(t *testing.T) {
	t.Helper()
	if _, err := os.Stat(filepath.Join(contractDir, "VERSION")); err != nil {
		t.Skipf("no %s: the module is tested out of the repository (%v)", contractDir, err)
	}
}

func TestScriptsAreTheContracts(t *testing.T) {
	inTheRepository(t)
	theirs, err := filepath.Glob(filepath.Join(contractDir, "scripts", "*.lua"))
	if err != nil || len(theirs) == 0 {
		t.Fatalf("no scripts under %s/scripts: %v", contractDir, err)
	}
	ours, err := scriptFiles.ReadDir("scripts")
	if err != nil {
		t.Fatal(err)
	}
	if len(ours) != len(theirs) {
		t.Fatalf("%d scripts embedded, the contract has %d: run go generate", len(ours), len(theirs))
	}
	for _, path := range theirs {
		want, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		got, err := scriptFiles.ReadFile("scripts/" + filepath.Base(path))
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("scripts/%s differs from contract/scripts (run go generate): %v", filepath.Base(path), err)
		}
	}
}

func TestTheLibraryKnowsTheContractsVersion(t *testing.T) {
	inTheRepository(t)
	text, err := os.ReadFile(filepath.Join(contractDir, "VERSION"))
	if err != nil {
		t.Fatal(err)
	}
	version, err := strconv.Atoi(strings.TrimSpace(string(text)))
	if err != nil || !slices.Contains(KnownContractVersions, version) {
		t.Fatalf("contract/VERSION is %q, this library knows %v", text, KnownContractVersions)
	}
}

func TestHashTagIsTheFirstNonEmptyBracedPartElseTheName(t *testing.T) {
	for stream, tag := range map[string]string{
		"{orders}:events": "orders",
		"a{b}c{d}":        "b",
		"{a{b}x":          "a{b",
		"notifications":   "notifications",
		"empty{}tag":      "empty{}tag",
		"open{only":       "open{only",
	} {
		if got := HashTag(stream); got != tag {
			t.Errorf("HashTag(%q) = %q, want %q", stream, got, tag)
		}
	}
}

func TestKeyNames(t *testing.T) {
	for got, want := range map[string]string{
		SettingsKey("{orders}:events", "billing"):  "{orders}:pelican:{orders}:events:billing:settings",
		TerminalKey("{orders}:events", "billing"):  "{orders}:pelican:{orders}:events:billing:terminal",
		ErrorsKey("jobs", "w"):                     "{jobs}:pelican:jobs:w:errors",
		ConsumersKey("{orders}:events", "billing"): "{orders}:pelican:{orders}:events:billing:consumers",
		BoundsKey("{orders}:events"):               "{orders}:pelican:{orders}:events:bounds",
		RejectedKey("jobs"):                        "{jobs}:pelican:jobs:rejected",
	} {
		if got != want {
			t.Errorf("got %q, want %q", got, want)
		}
	}
}

func TestSettingsAreParsedByName(t *testing.T) {
	s, err := ParseSettings(map[string]string{
		"minIdleMs": "4000", "retryAfterMs": "9000", "maxDeliveries": "5", "contractVersion": "1", "newField": "x",
	})
	want := Settings{MinIdle: 4 * time.Second, RetryAfter: 9 * time.Second, MaxDeliveries: 5, ContractVersion: 1}
	if err != nil || *s != want {
		t.Fatalf("got %+v, %v; want %+v", s, err, want)
	}
	// Without contractVersion: written before the contract had one, version 1.
	s, err = ParseSettings(map[string]string{"minIdleMs": "4000", "retryAfterMs": "9000"})
	if err != nil || *s != (Settings{MinIdle: 4 * time.Second, RetryAfter: 9 * time.Second, ContractVersion: 1}) {
		t.Fatalf("got %+v, %v", s, err)
	}
	if s, err := ParseSettings(map[string]string{}); s != nil || err != nil {
		t.Fatalf("an empty hash is no settings, got %+v, %v", s, err)
	}
}

func TestAnUnknownContractVersionNamesBothVersions(t *testing.T) {
	for _, version := range []string{"2", "0", "v1", "", "2.0", " 1", "1x", "１"} {
		_, err := ParseSettings(map[string]string{"minIdleMs": "4000", "retryAfterMs": "9000", "contractVersion": version})
		var cv *ContractVersionError
		if !errors.As(err, &cv) {
			t.Fatalf("contractVersion %q: got %v", version, err)
		}
		text := err.Error()
		if !strings.Contains(text, "the operator speaks worker contract "+version+", this library knows 1") ||
			!strings.Contains(text, "upgrade the library") {
			t.Errorf("contractVersion %q: %s", version, text)
		}
	}
}

func TestTheContractVersionIsCheckedBeforeAnyOtherField(t *testing.T) {
	for _, fields := range []map[string]string{
		{"contractVersion": "2"},
		{"contractVersion": "2.0", "minIdleMs": "soon"},
		{"contractVersion": "2", "retryAfterMs": "9000", "maxDeliveries": "many"},
	} {
		_, err := ParseSettings(fields)
		var cv *ContractVersionError
		if !errors.As(err, &cv) || cv.Operator != fields["contractVersion"] {
			t.Errorf("%v: got %v, want the contract version error", fields, err)
		}
	}
}

func TestMalformedSettingsAreAnErrorNeverASilentDefault(t *testing.T) {
	for _, fields := range []map[string]string{
		{"retryAfterMs": "9000"},
		{"minIdleMs": "4s", "retryAfterMs": "9000"},
		{"minIdleMs": "-1", "retryAfterMs": "9000"},
		{"minIdleMs": "4000", "retryAfterMs": "9000", "maxDeliveries": "many"},
	} {
		if _, err := ParseSettings(fields); !errors.Is(err, ErrInvalidSettings) {
			t.Errorf("%v: got %v", fields, err)
		}
	}
}

func TestLeaseIntervalIsAThirdOfMinIdleWithin100msAnd10s(t *testing.T) {
	for minIdle, want := range map[time.Duration]time.Duration{
		3 * time.Second:        time.Second,
		120 * time.Millisecond: 100 * time.Millisecond,
		300 * time.Second:      10 * time.Second,
	} {
		if got := LeaseInterval(&Settings{MinIdle: minIdle}); got != want {
			t.Errorf("minIdle %v: %v, want %v", minIdle, got, want)
		}
	}
	if got := LeaseInterval(nil); got != time.Second {
		t.Errorf("without settings: %v", got)
	}
}

func TestReasonsAreCamelCaseUpTo63Characters(t *testing.T) {
	for _, good := range []string{"RecordNotFound", "X", "A" + strings.Repeat("b", 62)} {
		if err := CheckReason(good); err != nil {
			t.Errorf("%q: %v", good, err)
		}
	}
	for _, bad := range []string{"", "recordNotFound", "Record_Not_Found", "Record Not", "Ünicode", "RecordNotFound\n",
		"A" + strings.Repeat("b", 63)} {
		var invalid *InvalidReasonError
		if err := CheckReason(bad); !errors.As(err, &invalid) || !strings.Contains(err.Error(), `^[A-Z][A-Za-z0-9]{0,62}$`) {
			t.Errorf("%q: %v", bad, err)
		}
	}
}

func TestErrorTextIsCutAtACharacterBoundary(t *testing.T) {
	if got := cutUTF8("short", ErrorTextMax); got != "short" {
		t.Fatal(got)
	}
	long := cutUTF8("x: "+strings.Repeat("€", 1000), ErrorTextMax)
	if !utf8.ValidString(long) || len(long) != 3+3*((ErrorTextMax-3)/3) {
		t.Fatalf("%d bytes, valid %v", len(long), utf8.ValidString(long))
	}
}
