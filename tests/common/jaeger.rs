//! A tracing backend per test: Jaeger (v2, built from its Go module by `scripts/testenv jaeger` into the bed's
//! cache), its OTLP/HTTP receiver and query API on loopback ports of its own, spans kept in memory. Programs export to
//! [`Jaeger::otlp_endpoint`] as `OTEL_EXPORTER_OTLP_ENDPOINT`; the test reads back what a user would see in Jaeger's
//! UI through the same HTTP API the UI uses.

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use super::{Operator, free_port, wait_for};

pub struct Jaeger {
    child: Child,
    otlp_port: u16,
    query_port: u16,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Jaeger {
    pub fn start() -> Jaeger {
        let binary = std::env::var("PELICAN_JAEGER").unwrap_or_else(|_| {
            panic!(
                "PELICAN_JAEGER is not set: build the tracing backend with `eval \"$(scripts/testenv jaeger)\"` \
                 (scripts/test does) and run this test again"
            )
        });
        let dir = tempfile::tempdir().unwrap();
        let (otlp_port, query_port, query_grpc_port) = (free_port(), free_port(), free_port());
        let config = dir.path().join("jaeger.yaml");
        std::fs::write(
            &config,
            format!(
                "service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  jaeger_storage:
    backends:
      memory:
        memory:
          max_traces: 10000
  jaeger_query:
    storage:
      traces: memory
    http:
      endpoint: 127.0.0.1:{query_port}
    grpc:
      endpoint: 127.0.0.1:{query_grpc_port}
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{otlp_port}
processors:
  batch:
    timeout: 100ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memory
"
            ),
        )
        .unwrap();
        let log = dir.path().join("jaeger.log");
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(binary)
            .arg("--config")
            .arg(format!("file:{}", config.display()))
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .stdin(Stdio::null())
            .spawn()
            .expect("start jaeger");
        let mut jaeger = Jaeger { child, otlp_port, query_port, log, _dir: dir };
        wait_for("Jaeger's query API", Duration::from_secs(30), || {
            if let Some(status) = jaeger.child.try_wait().unwrap() {
                panic!("jaeger exited ({status}): {}", std::fs::read_to_string(&jaeger.log).unwrap_or_default());
            }
            match Operator::http_get(jaeger.query_port, "/api/services") {
                (200, _) => Ok(()),
                (code, body) => Err(format!("{code} {body}")),
            }
        });
        jaeger
    }

    /// `OTEL_EXPORTER_OTLP_ENDPOINT` for a program that exports here (OTLP over HTTP).
    pub fn otlp_endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.otlp_port)
    }

    /// The traces in which `service` has a span (the last hour, at most 100).
    pub fn traces_of(&self, service: &str) -> Vec<Trace> {
        let (code, body) =
            Operator::http_get(self.query_port, &format!("/api/traces?service={service}&limit=100&lookback=1h"));
        assert_eq!(code, 200, "Jaeger's trace search: {body}");
        let value: Value = serde_json::from_str(&body).unwrap();
        value["data"].as_array().into_iter().flatten().map(Trace::from_jaeger).collect()
    }

    /// One trace by its id (hex), as the UI shows it; `None` while Jaeger has none of its spans.
    pub fn trace(&self, trace_id: &str) -> Option<Trace> {
        let value: Value = serde_json::from_str(&self.trace_json(trace_id)?).ok()?;
        value["data"].as_array()?.first().map(Trace::from_jaeger)
    }

    /// The API's own JSON of a trace (`hack/trace-svg` draws it).
    pub fn trace_json(&self, trace_id: &str) -> Option<String> {
        let (code, body) = Operator::http_get(self.query_port, &format!("/api/traces/{trace_id}"));
        (code == 200).then_some(body)
    }
}

impl Drop for Jaeger {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- jaeger's log ---\n{}", std::fs::read_to_string(&self.log).unwrap_or_default());
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A trace as Jaeger returns it, its spans in start order.
#[derive(Debug, Clone)]
pub struct Trace {
    pub id: String,
    pub spans: Vec<Span>,
}

#[derive(Debug, Clone)]
pub struct Span {
    pub id: String,
    pub name: String,
    pub service: String,
    /// The parent span's id (a CHILD_OF reference), `None` for the trace's root.
    pub parent: Option<String>,
    /// Microseconds since the epoch.
    pub start: u64,
    pub duration: u64,
    /// Tags and process-independent attributes: `span.kind`, `otel.status_code`, `messaging.*`, `pelican.*`, ...
    pub tags: BTreeMap<String, String>,
}

impl Span {
    pub fn tag(&self, key: &str) -> Option<&str> {
        self.tags.get(key).map(String::as_str)
    }
}

impl Trace {
    fn from_jaeger(trace: &Value) -> Trace {
        let services: BTreeMap<String, String> = trace["processes"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(id, process)| (id.clone(), process["serviceName"].as_str().unwrap_or_default().to_string()))
            .collect();
        let mut spans: Vec<Span> = trace["spans"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|span| Span {
                id: span["spanID"].as_str().unwrap_or_default().to_string(),
                name: span["operationName"].as_str().unwrap_or_default().to_string(),
                service: services.get(span["processID"].as_str().unwrap_or_default()).cloned().unwrap_or_default(),
                parent: span["references"].as_array().into_iter().flatten().find_map(|r| {
                    (r["refType"] == "CHILD_OF").then(|| r["spanID"].as_str().unwrap_or_default().to_string())
                }),
                start: span["startTime"].as_u64().unwrap_or_default(),
                duration: span["duration"].as_u64().unwrap_or_default(),
                tags: span["tags"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|tag| {
                        let value = match &tag["value"] {
                            Value::String(text) => text.clone(),
                            other => other.to_string(),
                        };
                        (tag["key"].as_str().unwrap_or_default().to_string(), value)
                    })
                    .collect(),
            })
            .collect();
        spans.sort_by_key(|span| span.start);
        Trace { id: trace["traceID"].as_str().unwrap_or_default().to_string(), spans }
    }

    /// `service: name` of each span, in start order: what the UI's timeline lists.
    pub fn outline(&self) -> Vec<String> {
        self.spans.iter().map(|span| format!("{}: {}", span.service, span.name)).collect()
    }
}
