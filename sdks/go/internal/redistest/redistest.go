// Package redistest starts a real redis-server on a free loopback port for the tests and the bench.
package redistest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Server is a redis-server of the tests' own.
type Server struct {
	Addr string
	cmd  *exec.Cmd
}

// Binary is the redis-server to run: REDIS_SERVER, else the one on PATH.
func Binary() (string, error) {
	if b := os.Getenv("REDIS_SERVER"); b != "" {
		return b, nil
	}
	b, err := exec.LookPath("redis-server")
	if err != nil {
		return "", fmt.Errorf("no redis-server: put one on PATH or name it in REDIS_SERVER: %w", err)
	}
	return b, nil
}

// Start runs binary on a free loopback port, without persistence, and waits until it answers; args are more of
// its options.
func Start(binary string, args ...string) (*Server, error) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	port := listener.Addr().(*net.TCPAddr).Port
	listener.Close()
	cmd := exec.Command(binary, append([]string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "",
		"--appendonly", "no"}, args...)...)
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	s := &Server{Addr: fmt.Sprintf("127.0.0.1:%d", port), cmd: cmd}
	client := redis.NewClient(&redis.Options{Addr: s.Addr})
	defer client.Close()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		err := client.Ping(context.Background()).Err()
		if err == nil {
			return s, nil
		}
		if time.Now().After(deadline) {
			s.Stop()
			return nil, fmt.Errorf("%s did not answer on %s: %w", binary, s.Addr, err)
		}
	}
}

// Cluster is a Redis Cluster of the tests' own: primaries only, in a directory of its own.
type Cluster struct {
	Servers []*Server
	dir     string
}

// StartCluster runs n primaries of binary with cluster mode on, joins them (redis-cli --cluster create, the
// redis-cli beside binary or on PATH) and waits until every node says the cluster is ok.
func StartCluster(binary string, n int) (*Cluster, error) {
	dir, err := os.MkdirTemp("", "pelican-cluster-")
	if err != nil {
		return nil, err
	}
	c := &Cluster{dir: dir}
	args := []string{"--cluster", "create"}
	for i := range n {
		s, err := Start(binary, "--cluster-enabled", "yes", "--cluster-config-file",
			filepath.Join(dir, fmt.Sprintf("nodes-%d.conf", i)), "--dir", dir)
		if err != nil {
			c.Stop()
			return nil, err
		}
		c.Servers = append(c.Servers, s)
		args = append(args, s.Addr)
	}
	cli := filepath.Join(filepath.Dir(binary), "redis-cli")
	if _, err := os.Stat(cli); err != nil {
		cli = "redis-cli"
	}
	if out, err := exec.Command(cli, append(args, "--cluster-yes")...).CombinedOutput(); err != nil {
		c.Stop()
		return nil, fmt.Errorf("redis-cli --cluster create: %w: %s", err, out)
	}
	for _, s := range c.Servers {
		client := redis.NewClient(&redis.Options{Addr: s.Addr})
		err := waitFor(10*time.Second, func() error {
			info, err := client.ClusterInfo(context.Background()).Result()
			if err == nil && !strings.Contains(info, "cluster_state:ok") {
				err = fmt.Errorf("%s: cluster_state not ok", s.Addr)
			}
			return err
		})
		client.Close()
		if err != nil {
			c.Stop()
			return nil, err
		}
	}
	return c, nil
}

// Addrs are the addresses of the cluster's nodes.
func (c *Cluster) Addrs() []string {
	addrs := make([]string, len(c.Servers))
	for i, s := range c.Servers {
		addrs[i] = s.Addr
	}
	return addrs
}

// Stop ends every node and removes their directory.
func (c *Cluster) Stop() {
	for _, s := range c.Servers {
		s.Stop()
	}
	_ = os.RemoveAll(c.dir)
}

// waitFor calls check every 50 ms until it answers nil, for at most within; its last error otherwise.
func waitFor(within time.Duration, check func() error) error {
	for deadline := time.Now().Add(within); ; time.Sleep(50 * time.Millisecond) {
		err := check()
		if err == nil || time.Now().After(deadline) {
			return err
		}
	}
}

// URL is the server's redis:// URL.
func (s *Server) URL() string { return "redis://" + s.Addr }

// Stop ends the server.
func (s *Server) Stop() {
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
}

// FromEnv is the server REDIS_URL names, or else one started here on the binary Binary finds; stop is a no-op for
// the named one. The benchmarks' way to a server.
func FromEnv() (url string, stop func(), err error) {
	if url := os.Getenv("REDIS_URL"); url != "" {
		return url, func() {}, nil
	}
	binary, err := Binary()
	if err != nil {
		return "", nil, err
	}
	server, err := Start(binary)
	if err != nil {
		return "", nil, err
	}
	return server.URL(), server.Stop, nil
}
