// Package redistest starts a real redis-server on a free loopback port for the tests and the bench.
package redistest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
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

// Start runs binary on a free loopback port, without persistence, and waits until it answers.
func Start(binary string) (*Server, error) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	port := listener.Addr().(*net.TCPAddr).Port
	listener.Close()
	cmd := exec.Command(binary, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
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

// URL is the server's redis:// URL.
func (s *Server) URL() string { return "redis://" + s.Addr }

// Stop ends the server.
func (s *Server) Stop() {
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
}
