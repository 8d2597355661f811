//! The conformance workers as the suites run them (`tests/conformance.rs`, `tests/conformance_topics.rs`): each
//! library's program from `conformance/workers.txt`, started with its environment, its run lines collected.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The group every conformance scenario's policy names.
pub const GROUP: &str = "workers";

/// A library's conformance worker, as `conformance/workers.txt` lists it.
#[derive(Clone, Debug)]
pub struct Library {
    pub name: String,
    pub command: Vec<String>,
}

/// The listed libraries; `CONFORMANCE_WORKERS=a,b` narrows them (said on stderr, so a narrowed run is never taken
/// for a whole one). A listed program that is not built fails the scenario with how to build it.
pub fn libraries() -> Vec<Library> {
    let root = env!("CARGO_MANIFEST_DIR");
    let listed = std::fs::read_to_string(format!("{root}/conformance/workers.txt")).unwrap();
    let wanted = std::env::var("CONFORMANCE_WORKERS").ok();
    let libraries: Vec<Library> = listed
        .lines()
        .filter(|line| !line.trim().is_empty() && !line.starts_with('#'))
        .map(|line| {
            let mut words = line.split_whitespace().map(str::to_string);
            Library { name: words.next().unwrap(), command: words.collect() }
        })
        .filter(|library| wanted.as_deref().is_none_or(|w| w.split(',').any(|name| name == library.name)))
        .collect();
    if let Some(wanted) = &wanted {
        eprintln!("CONFORMANCE_WORKERS={wanted}: only {:?}", libraries.iter().map(|l| &l.name).collect::<Vec<_>>());
    }
    assert!(!libraries.is_empty(), "no conformance worker listed (or none of CONFORMANCE_WORKERS)");
    // Every path the command names (the program, a jar on a class path) must be there.
    for library in &libraries {
        let paths =
            library.command.iter().flat_map(|word| word.split(':')).filter(|p| p.contains('/') && !p.contains('*'));
        for path in paths.map(|p| std::path::Path::new(root).join(p)) {
            assert!(path.exists(), "{}: {} is not built: run scripts/conformance-build", library.name, path.display());
        }
    }
    libraries
}

/// One handler run, as a worker printed it.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct Run {
    pub id: String,
    pub consumer: String,
    pub outcome: String,
    /// On a topic: the partition the entry was read from, its key, and when the handler began and returned (ms).
    pub partition: Option<u32>,
    pub key: Option<String>,
    #[serde(rename = "startedAt")]
    pub started_at: Option<u64>,
    #[serde(rename = "endedAt")]
    pub ended_at: Option<u64>,
}

/// A running conformance worker; killed when dropped.
pub struct Running {
    pub child: Child,
    runs: Arc<Mutex<Vec<Run>>>,
    pub what: String,
}

impl Running {
    pub fn start(library: &Library, url: &str, stream: &str, consumer: &str, grace_ms: u64) -> Running {
        Running::start_with(library, url, stream, consumer, grace_ms, &[])
    }

    /// With `env` added to the worker's environment.
    pub fn start_with(
        library: &Library,
        url: &str,
        stream: &str,
        consumer: &str,
        grace_ms: u64,
        env: &[(&str, &str)],
    ) -> Running {
        let mut child = Command::new(&library.command[0])
            .args(&library.command[1..])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .envs(env.iter().copied())
            .env("REDIS_URL", url)
            .env("STREAM", stream)
            .env("GROUP", GROUP)
            .env("CONSUMER", consumer)
            .env("SHUTDOWN_GRACE_MS", grace_ms.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("{}: cannot start {:?}: {e}", library.name, library.command));
        let runs = Arc::new(Mutex::new(Vec::new()));
        let (out, seen) = (child.stdout.take().unwrap(), runs.clone());
        let what = format!("{} worker {consumer}", library.name);
        let name = what.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                match serde_json::from_str::<Run>(&line) {
                    Ok(run) => seen.lock().unwrap().push(run),
                    Err(e) => eprintln!("{name}: not a run line ({e}): {line}"),
                }
            }
        });
        Running { child, runs, what }
    }

    pub fn runs(&self) -> Vec<Run> {
        self.runs.lock().unwrap().clone()
    }

    /// SIGTERM, then the exit status once the worker's shutdown is complete.
    pub fn terminate(&mut self) -> ExitStatus {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        self.exit_within(Duration::from_secs(30), "after SIGTERM")
    }

    /// The exit status, once the worker exits within `limit`.
    pub fn exit_within(&mut self, limit: Duration, when: &str) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(started.elapsed() < limit, "{} did not exit within {limit:?} {when}", self.what);
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `scenario` on each lane (one per library, named) on a thread of its own, then reports each library's result
/// on stderr and panics naming every library that failed: `what` says which scenario and where.
pub fn side_by_side<L: Send>(what: &str, lanes: impl Iterator<Item = (String, L)>, scenario: fn(&L)) {
    let results: Vec<(String, Result<Duration, String>)> = std::thread::scope(|scope| {
        let running: Vec<_> = lanes
            .map(|(name, lane)| {
                let handle = scope.spawn(move || {
                    let started = Instant::now();
                    scenario(&lane);
                    started.elapsed()
                });
                (name, handle)
            })
            .collect();
        running.into_iter().map(|(name, handle)| (name, handle.join().map_err(|panic| panic_text(&panic)))).collect()
    });
    let report: Vec<String> = results
        .iter()
        .map(|(name, result)| match result {
            Ok(took) => format!("  {name}: passed in {:.1} s", took.as_secs_f64()),
            Err(why) => format!("  {name}: FAILED: {why}"),
        })
        .collect();
    eprintln!("{what}:\n{}", report.join("\n"));
    assert!(results.iter().all(|(_, r)| r.is_ok()), "{what}:\n{}", report.join("\n"));
}

/// A panic's message.
fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}
