package pelican

import (
	"embed"

	"github.com/redis/go-redis/v9"
)

// The contract's scripts, copied byte for byte from contract/scripts (TestScriptsAreTheContracts fails while a copy
// differs): `go generate` copies them again.
//
//go:generate sh -c "cp ../../contract/scripts/*.lua scripts/"
//go:embed scripts/*.lua
var scriptFiles embed.FS

func script(name string) *redis.Script {
	src, err := scriptFiles.ReadFile("scripts/" + name + ".lua")
	if err != nil {
		panic("pelican: no embedded script " + name)
	}
	// Run sends EVALSHA and falls back to EVAL on NOSCRIPT (neither of which ran the script).
	return redis.NewScript(string(src))
}

var (
	leaseScript          = script("lease")
	giveBackScript       = script("give_back")
	terminalAckScript    = script("terminal_ack")
	boundedPublishScript = script("bounded_publish")
	boundedBatchScript   = script("bounded_publish_batch")
	membershipScript     = script("membership")
)
