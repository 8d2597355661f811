//! The real test bed, as tests see it: the control plane started by `scripts/testenv up` ([`bed`]), and in
//! [`kubernetes`] kubectl, namespaces, policies and the operator as a local process; in [`servers`] private
//! Redis/Valkey servers, Clusters and sentinels per test; in [`node`] the bed's node, for tests that run pods; in
//! [`streams`] what tests read back from them. A scenario usually starts with [`ready_policy`].
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;

mod conformance;
mod jaeger;
mod kubernetes;
mod node;
mod servers;
mod streams;

// Each test file uses a part of the harness.
#[allow(unused_imports)]
pub use conformance::*;
#[allow(unused_imports)]
pub use jaeger::*;
#[allow(unused_imports)]
pub use kubernetes::*;
#[allow(unused_imports)]
pub use node::*;
#[allow(unused_imports)]
pub use servers::*;
#[allow(unused_imports)]
pub use streams::*;

/// The files below `dir` (every level) whose name ends with `suffix` (`""`: all), sorted; what builds and package
/// managers write there (`target`, `dist`, `node_modules`, `.venv`, `__pycache__`) left out, so a check reads the
/// repository's own files, the same on every machine, whatever was built or installed beside them.
pub fn files_below(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    const BUILT: [&str; 5] = ["target", "dist", "node_modules", ".venv", "__pycache__"];
    let mut found = vec![];
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() && BUILT.contains(&entry.file_name().to_string_lossy().as_ref()) {
            continue;
        }
        if path.is_dir() {
            found.extend(files_below(&path, suffix));
        } else if path.to_string_lossy().ends_with(suffix) {
            found.push(path);
        }
    }
    found.sort();
    found
}

/// Paths and addresses written by `scripts/testenv up` into `$PELICAN_TESTENV/env`.
pub struct Bed {
    vars: HashMap<String, String>,
}

pub fn bed() -> &'static Bed {
    static BED: OnceLock<Bed> = OnceLock::new();
    BED.get_or_init(|| {
        let dir = std::env::var("PELICAN_TESTENV").unwrap_or_else(|_| "/tmp/pelican-testenv".into());
        let file = Path::new(&dir).join("env");
        let text = std::fs::read_to_string(&file).unwrap_or_else(|_| {
            panic!("the test bed is not up ({} missing): run `scripts/testenv up` first", file.display())
        });
        let vars = text
            .lines()
            .filter_map(|l| l.strip_prefix("export ")?.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Bed { vars }
    })
}

impl Bed {
    pub fn var(&self, name: &str) -> &str {
        self.vars.get(name).unwrap_or_else(|| panic!("{name} missing from the test bed env; run `scripts/testenv up`"))
    }

    pub fn kubeconfig(&self) -> &str {
        self.var("KUBECONFIG")
    }

    /// Installs the CRDs from `crds/` once per test binary, the way a user would.
    pub fn install_crd(&self) {
        static CRD: Once = Once::new();
        CRD.call_once(|| {
            let crds = concat!(env!("CARGO_MANIFEST_DIR"), "/crds/");
            kubectl_ok(&["apply", "--server-side", "--force-conflicts", "-f", crds]);
            kubectl_ok(&[
                "wait",
                "--for=condition=Established",
                "--timeout=60s",
                "crd/consumergrouppolicies.pelican.io",
                "crd/deadletterredrives.pelican.io",
                "crd/groupseeks.pelican.io",
                "crd/redisservers.pelican.io",
            ]);
        });
    }
}

/// A loopback port for a server the test is about to start, with its cluster bus port (`port + 10000`) free too.
///
/// Ports come from 10000-19999 (buses 20000-29999), below the kernel's ephemeral range (32768 and up here): a port
/// the kernel picks for `bind(0)` can go to any process's outgoing connection before the server binds it, and Redis
/// refuses cluster mode above port 55535. A counter keeps a process from handing out a port twice; its start is
/// spread by process id, and each candidate is checked free against other processes.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 10_000;
    const COUNT: u32 = 10_000;
    static NEXT: OnceLock<AtomicU32> = OnceLock::new();
    let next = NEXT.get_or_init(|| AtomicU32::new(std::process::id().wrapping_mul(7_919) % COUNT));
    for _ in 0..COUNT {
        let port = (FIRST + next.fetch_add(1, Ordering::Relaxed) % COUNT) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {FIRST}-{}", FIRST + COUNT - 1);
}

/// Polls `probe` until it returns `Some`, or panics with `what` and the last value seen.
pub fn wait_for<T>(what: &str, timeout: Duration, mut probe: impl FnMut() -> Result<T, String>) -> T {
    let start = Instant::now();
    let mut last = String::new();
    while start.elapsed() < timeout {
        match probe() {
            Ok(v) => return v,
            Err(e) => last = e,
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("timed out after {timeout:?} waiting for {what}; last: {last}");
}

/// Declares one test per server flavor, each calling `fn name(flavor: Flavor)` of the enclosing file.
#[macro_export]
macro_rules! on_both_servers {
    ($($name:ident),* $(,)?) => {
        mod redis_7 { $( #[test] fn $name() { super::$name(super::Flavor::Redis) } )* }
        mod valkey_9 { $( #[test] fn $name() { super::$name(super::Flavor::Valkey) } )* }
    };
}

/// [`on_both_servers!`], Redis 8.2 and Redis 8.6: for the suites that prove a topology (Sentinel, Cluster) or a
/// capability on every server the matrix names.
#[macro_export]
macro_rules! on_every_server {
    ($($name:ident),* $(,)?) => {
        on_both_servers!($($name),*);
        mod redis_8_2 { $( #[test] fn $name() { super::$name(super::Flavor::Redis82) } )* }
        mod redis_8_6 { $( #[test] fn $name() { super::$name(super::Flavor::Redis86) } )* }
    };
}

/// A runtime for the async SDK and client calls of a test, on the test's thread.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// A tiny deterministic generator for kill instants (no need for a crate).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next_in(&mut self, low: u64, high: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        low + (self.0 >> 33) % (high - low)
    }
}

/// The rows of a `kubectl get` table as column name -> cell, cut at the header's column offsets
/// (an empty cell stays empty instead of shifting the others).
pub fn table_rows(table: &str) -> Vec<HashMap<String, String>> {
    let mut lines = table.lines();
    let header = lines.next().unwrap_or_default();
    let mut starts: Vec<(usize, &str)> = Vec::new();
    let mut offset = 0;
    for word in header.split_whitespace() {
        let at = header[offset..].find(word).unwrap() + offset;
        starts.push((at, word));
        offset = at + word.len();
    }
    lines
        .map(|line| {
            starts
                .iter()
                .enumerate()
                .map(|(i, (start, name))| {
                    let end = starts.get(i + 1).map_or(line.len(), |(s, _)| (*s).min(line.len()));
                    let cell = line.get((*start).min(line.len())..end).unwrap_or_default().trim();
                    (name.to_string(), cell.to_string())
                })
                .collect()
        })
        .collect()
}
