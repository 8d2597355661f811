// Package metrics exports a worker's stats to Prometheus under the schema every Pelican library shares:
//
//	pelican_worker_messages_total{stream, group, outcome}  counter; outcome: done, terminal, failed, retried, abandoned
//	pelican_worker_in_flight{stream, group}                gauge: messages being handled now
//
// The consumer (the Pod) is the scrape target's own label, not the library's. The package is apart so that the
// worker itself does not depend on the Prometheus client:
//
//	prometheus.MustRegister(metrics.NewCollector(worker))
package metrics

import (
	pelican "github.com/pelican-io/pelican/sdks/go"
	"github.com/prometheus/client_golang/prometheus"
)

var (
	messagesDesc = prometheus.NewDesc("pelican_worker_messages_total",
		"Handler runs of a Pelican worker by how they ended.", []string{"stream", "group", "outcome"}, nil)
	inFlightDesc = prometheus.NewDesc("pelican_worker_in_flight",
		"Messages a Pelican worker is handling now.", []string{"stream", "group"}, nil)
)

// Collector is a prometheus.Collector of one worker's Stats, read at each scrape.
type Collector struct {
	worker *pelican.Worker
}

// NewCollector collects worker's stats; register it once per worker.
func NewCollector(worker *pelican.Worker) *Collector {
	return &Collector{worker: worker}
}

// Describe sends the two metrics' descriptions.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- messagesDesc
	ch <- inFlightDesc
}

// Collect sends the worker's stats as they are now.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	s := c.worker.Stats()
	stream, group := c.worker.Stream(), c.worker.Group()
	for _, o := range []struct {
		outcome string
		count   uint64
	}{
		{"done", s.Done}, {"terminal", s.Terminal}, {"failed", s.Failed}, {"retried", s.Retried},
		{"abandoned", s.Abandoned},
	} {
		ch <- prometheus.MustNewConstMetric(messagesDesc, prometheus.CounterValue, float64(o.count), stream, group,
			o.outcome)
	}
	ch <- prometheus.MustNewConstMetric(inFlightDesc, prometheus.GaugeValue, float64(s.InFlight), stream, group)
}
