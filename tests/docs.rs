//! `docs/` against the code: every condition and Event reason the code writes is documented (and nothing
//! documented is gone from the code), the generated reference pages (`pelican` commands from clap, the chart's
//! `values.yaml`) are current, every environment variable the code reads is documented, and every relative link of
//! the README, the chart's README and the book resolves. What the pages tell a user to run or read is checked too:
//! metric names, reason-like names, counts of CRDs and controllers, `kubectl get` columns, waits that work for a
//! sharded release, quoted `--set` lists, the book built with its repository files. No bed needed.
//!
//! A stale generated page is rewritten by `PELICAN_WRITE_DOCS=1 cargo test --test docs` (then review the diff).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use regex::Regex;

mod common;
use common::files_below;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The Rust sources and the Lua scripts.
fn source() -> String {
    let roots = ["src", "contract/scripts"].map(|dir| Path::new(ROOT).join(dir));
    let files =
        roots.iter().flat_map(|root| [".rs", ".lua"].into_iter().flat_map(move |suffix| files_below(root, suffix)));
    files.map(|p| read(&p)).collect::<Vec<_>>().join("\n")
}

/// The reasons the code writes: the errors' `reason()`, the Events published, the announcements of the plan, the
/// redrive's phases, a seek's refusals, the `Saturated` condition's, and the condition constants.
fn reasons_in_code(code: &str) -> BTreeSet<String> {
    let errors = read(&Path::new(ROOT).join("src/error.rs"));
    let reason_fn = &errors[errors.find("pub fn reason(").expect("Error::reason in src/error.rs")..];
    let mut found: BTreeSet<String> =
        Regex::new(r#"=> "([A-Z]\w+)","#).unwrap().captures_iter(reason_fn).map(|c| c[1].to_string()).collect();
    let patterns = [
        // publish(.., EventType::X, "Reason", ..), and the pass's (type, reason) match arms
        r#"EventType::\w+,\s*"([A-Z]\w+)""#,
        // the plan's announcements
        r#"Announcement \{ type_: EventType::\w+, reason: "(\w+)""#,
        // a redrive's phase and reason; a redrive waiting
        r#"RedrivePhase::\w+, "([A-Z]\w+)""#,
        r#"\.pending\([^;]*?"([A-Z]\w+)""#,
        // a seek refused by the operator, or by its script
        r#"\.fail\([^;]*?"([A-Z]\w+)""#,
        r#"refused\('([A-Z]\w+)'"#,
        // (status, reason, message) of Saturated
        r#""(?:True|False|Unknown)",\s*"([A-Z]\w+)""#,
    ];
    for pattern in patterns {
        for captures in Regex::new(pattern).unwrap().captures_iter(code) {
            found.insert(captures[1].to_string());
        }
    }
    // The condition types and reasons named as constants (src/api/mod.rs).
    let api = read(&Path::new(ROOT).join("src/api/mod.rs"));
    for c in Regex::new(r#"pub const [A-Z_]+: &str = "([A-Z][a-z]\w+)""#).unwrap().captures_iter(&api) {
        found.insert(c[1].to_string());
    }
    assert!(found.len() > 40, "the patterns found only {found:?}: did the code's shape change?");
    found
}

#[test]
fn every_reason_in_the_code_is_documented_and_every_documented_one_is_in_the_code() {
    let page_path = Path::new(ROOT).join("docs/src/reference/conditions.md");
    let page = read(&page_path);
    let documented: BTreeSet<String> =
        Regex::new(r"`([A-Z][A-Za-z]+)`").unwrap().captures_iter(&page).map(|c| c[1].to_string()).collect();
    let source = source();
    let code = reasons_in_code(&source);
    let missing: Vec<&String> = code.iter().filter(|r| !documented.contains(*r)).collect();
    assert!(missing.is_empty(), "reasons the code writes that {} does not document: {missing:?}", page_path.display());
    // The other way: a documented reason the code no longer has anywhere (as a string or a name).
    let gone: Vec<&String> =
        documented.iter().filter(|r| !Regex::new(&format!(r"\b{r}\b")).unwrap().is_match(&source)).collect();
    assert!(gone.is_empty(), "{} documents what the code does not have: {gone:?}", page_path.display());
}

/// Every instruction to build the book for serving runs `hack/book-files` after `mdbook build docs`: without it the
/// pages' links to repository files (`../../examples/...`) lead out of the site wherever it is served on its own
/// (installing.md told teams to host the runbooks built by `mdbook build docs` alone).
#[test]
fn every_book_build_copies_the_repository_files_it_links() {
    let root = Path::new(ROOT);
    let mut pages = files_below(&root.join("docs/src"), ".md");
    pages.extend(["README.md", "charts/pelican/README.md", "charts/pelican/values.yaml"].map(|p| root.join(p)));
    let mut alone = vec![];
    for page in &pages {
        let text = read(page).replace("\n  # ", " ").replace('\n', " ");
        for (at, _) in text.match_indices("mdbook build docs") {
            let after = text[at + "mdbook build docs".len()..].trim_start_matches(['`', ' ']);
            if !after.starts_with("&& hack/book-files") && !after.starts_with("alone") {
                let context: String = text[at..].chars().take(60).collect();
                alone.push(format!("{}: {context}", page.strip_prefix(root).unwrap().display()));
            }
        }
    }
    assert!(alone.is_empty(), "`mdbook build docs` without `&& hack/book-files target/book`:\n{}", alone.join("\n"));
}

/// Every instruction to wait for the operator works for a sharded release and before its Pods exist: a rollout is
/// awaited by the release's label (`kubectl rollout status deploy -l app.kubernetes.io/instance=<release>`), never by
/// the name `deploy/pelican`, which names none of a sharded release's Deployments (`<release>-<shard>`,
/// `<release>-unlabelled`); and a `kubectl wait` on Pods by label waits only for their deletion: for a condition it
/// fails at once with `no matching resources found` while the Deployment has not created them.
#[test]
fn waiting_for_the_operator_works_for_every_release_shape() {
    let root = Path::new(ROOT);
    let mut pages = files_below(&root.join("docs/src"), ".md");
    pages.extend(
        ["README.md", "charts/pelican/README.md", "charts/pelican/templates/NOTES.txt", "charts/pelican/values.yaml"]
            .map(|p| root.join(p)),
    );
    let by_name = Regex::new(r"rollout status (?:deploy|deployment|deployments)/").unwrap();
    let wait_on_pods = Regex::new(r"kubectl wait\b[^`\n]*\bpods?\b[^`\n]*").unwrap();
    let mut wrong = vec![];
    let mut waits = 0;
    for page in &pages {
        let name = page.strip_prefix(root).unwrap().display().to_string();
        for (n, line) in read(page).lines().enumerate() {
            if by_name.is_match(line) {
                wrong.push(format!("{name}:{}: {}", n + 1, line.trim()));
            }
            for wait in wait_on_pods.find_iter(line).map(|m| m.as_str()) {
                waits += 1;
                // A line that says why such a wait fails is no instruction.
                if !wait.contains("--for=delete") && !line.contains("fails") {
                    wrong.push(format!("{name}:{}: {}", n + 1, line.trim()));
                }
            }
        }
    }
    assert!(waits >= 1, "no kubectl wait on Pods found: did the pages' shape change?");
    assert!(wrong.is_empty(), "waits that fail for a sharded release or before the Pods exist:\n{}", wrong.join("\n"));
}

/// The pages count the CRDs `crds/` holds and the controllers `src/main.rs` starts as they are ("three CRDs" and
/// "two controllers" outlived `GroupSeek`).
#[test]
fn counts_of_crds_and_controllers_are_the_codes() {
    let root = Path::new(ROOT);
    let crds = files_below(&root.join("crds"), ".yaml").len();
    let controllers =
        Regex::new(r"pelican::\w+::run\(shared").unwrap().find_iter(&read(&root.join("src/main.rs"))).count();
    assert!(crds >= 4 && controllers >= 4, "{crds} CRDs, {controllers} controllers: did main.rs's shape change?");
    let words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"];
    let count = Regex::new(r"(?i)\b(one|two|three|four|five|six|seven|eight|nine)\s+(CRDs|controllers|resources of)\b")
        .unwrap();
    let mut pages = files_below(&root.join("docs/src"), ".md");
    pages.extend(["README.md", "charts/pelican/README.md"].map(|p| root.join(p)));
    let mut wrong = vec![];
    for page in &pages {
        for c in count.captures_iter(&read(page)) {
            let said = words.iter().position(|w| w.eq_ignore_ascii_case(&c[1])).unwrap();
            let is = if c[2].eq_ignore_ascii_case("controllers") { controllers } else { crds };
            if said != is {
                wrong.push(format!("{}: \"{}\" (there are {is})", page.strip_prefix(root).unwrap().display(), &c[0]));
            }
        }
    }
    assert!(wrong.is_empty(), "counts that are not the code's:\n{}", wrong.join("\n"));
}

/// A list given to `helm --set` (`key={a,b}`) is quoted: unquoted, the shell's brace expansion turns
/// `--set rbac.secretNamespaces={a,b}` into `--set rbac.secretNamespaces=a rbac.secretNamespaces=b`, and Helm takes
/// the second word for a chart (troubleshooting.md and installing.md gave it so).
#[test]
fn helm_set_lists_are_quoted() {
    let root = Path::new(ROOT);
    let mut pages = files_below(&root.join("docs/src"), ".md");
    pages.extend(["README.md", "charts/pelican/README.md", "charts/pelican/values.yaml"].map(|p| root.join(p)));
    let unquoted = Regex::new(r"--set(?:-string)? [\w.\[\]-]+=\{").unwrap();
    let found: Vec<String> = pages
        .iter()
        .flat_map(|page| {
            let name = page.strip_prefix(root).unwrap().display().to_string();
            read(page)
                .lines()
                .enumerate()
                .filter(|(_, line)| unquoted.is_match(line))
                .map(|(n, line)| format!("{name}:{}: {}", n + 1, line.trim()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        found.is_empty(),
        "`--set key={{...}}` without quotes (write `--set 'key={{a,b}}'`):\n{}",
        found.join("\n")
    );
}

/// Every `$ kubectl get <resource>` sample of the README and the book prints the columns the CRD declares, in its
/// order (`-o wide`: all, else those of priority 0; `-A`: NAMESPACE first), and a `kubectl get` whose comment names
/// columns shows them: the README's `kubectl get cgp -o wide` had no PARTITIONS column after topics added one, and a
/// runbook read REASON off `kubectl get redisservers -A`, which prints it only with `-o wide`.
#[test]
fn kubectl_get_samples_show_the_crds_printer_columns() {
    let root = Path::new(ROOT);
    let mut columns = std::collections::HashMap::new();
    for file in files_below(&root.join("crds"), ".yaml") {
        let crd: serde_json::Value = serde_yaml::from_str(&read(&file)).unwrap();
        let names = &crd["spec"]["names"];
        let printed: Vec<(String, i64)> = crd["spec"]["versions"][0]["additionalPrinterColumns"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| (c["name"].as_str().unwrap().to_uppercase(), c["priority"].as_i64().unwrap_or(0)))
            .collect();
        let mut known = vec![names["plural"].as_str().unwrap(), names["singular"].as_str().unwrap()];
        known.extend(names["shortNames"].as_array().into_iter().flatten().filter_map(|n| n.as_str()));
        for name in known {
            columns.insert(name.to_string(), printed.clone());
        }
    }
    let mut pages = files_below(&root.join("docs/src"), ".md");
    pages.push(root.join("README.md"));
    let column_word = Regex::new(r"\b[A-Z][A-Z-]*[A-Z]\b").unwrap();
    let (mut samples, mut comments) = (0, 0);
    let mut wrong = vec![];
    for page in &pages {
        let text = read(page);
        let lines: Vec<&str> = text.lines().collect();
        for (n, line) in lines.iter().enumerate() {
            let Some(at) = line.find("kubectl get ") else { continue };
            let rest = &line[at + "kubectl get ".len()..];
            let (command, comment) = rest.split_once('#').unwrap_or((rest, ""));
            let words: Vec<&str> = command.split_whitespace().collect();
            let Some(printed) = words.first().and_then(|kind| columns.get(*kind)) else { continue };
            let wide = command.contains("-o wide");
            let mut shown: Vec<String> = vec!["NAME".into()];
            if words.contains(&"-A") || words.contains(&"--all-namespaces") {
                shown.insert(0, "NAMESPACE".into());
            }
            shown.extend(printed.iter().filter(|(_, p)| wide || *p == 0).map(|(c, _)| c.clone()));
            let place = format!("{}:{}", page.strip_prefix(root).unwrap().display(), n + 1);
            if line.trim_start().starts_with("$ kubectl get ") {
                samples += 1;
                let header: Vec<String> =
                    lines.get(n + 1).unwrap_or(&"").split_whitespace().map(str::to_string).collect();
                if header != shown {
                    wrong.push(format!("{place}: `{}` prints {shown:?}, the page shows {header:?}", line.trim()));
                }
            }
            for word in column_word.find_iter(comment).map(|m| m.as_str()) {
                comments += 1;
                if printed.iter().any(|(c, _)| c == word) && !shown.iter().any(|c| c == word) {
                    wrong.push(format!("{place}: `{}` does not print {word} (only {shown:?})", line.trim()));
                }
            }
        }
    }
    assert!(
        samples >= 4 && comments >= 5,
        "only {samples} samples and {comments} column names found: did the pages' shape change?"
    );
    assert!(
        wrong.is_empty(),
        "`kubectl get` samples and comments whose columns are not what it prints:\n{}",
        wrong.join("\n")
    );
}

/// Names Kubernetes itself writes, which the book quotes but no file of the repository has.
const KUBERNETES_NAMES: [&str; 4] = ["ErrImageNeverPull", "ErrImagePull", "ImagePullBackOff", "ExternalName"];

/// Every name the book writes as a reason would be (`CamelCase` in backquotes: a condition or Event reason, a dead
/// letter's `pelican-reason`, a metric's `result`, a type) is in the repository's code, scripts, chart or tests: a
/// page that names a reason nothing writes sends a reader to wait for it (monitoring.md named a redrive failing
/// with `NamespaceNotAllowed`, telemetry.md a dead letter's `MaxHandlingExceeded`; neither was ever written).
#[test]
fn every_reason_like_name_in_the_book_is_in_the_repository() {
    let root = Path::new(ROOT);
    let mut files = vec![];
    for (dir, suffixes) in [
        ("src", &[".rs", ".lua"][..]),
        ("contract", &[".lua", ".json"]),
        ("tests", &[".rs", ".py", ".ts"]),
        ("charts/pelican", &[".yaml", ".json", ".tpl", ".txt"]),
        ("gitops", &[".lua", ".yaml"]),
        ("examples", &[".yaml", ".rs", ".acl"]),
        ("sdks", &[".ts", ".py", ".go", ".java", ".lua"]),
    ] {
        for suffix in suffixes {
            // This file names the wrong reasons it was written against.
            files.extend(files_below(&root.join(dir), suffix).into_iter().filter(|f| !f.ends_with("tests/docs.rs")));
        }
    }
    let code: String = files.iter().map(|f| read(f)).collect::<Vec<_>>().join("\n");
    let words: BTreeSet<&str> = Regex::new(r"\w+").unwrap().find_iter(&code).map(|m| m.as_str()).collect();
    assert!(words.contains("MaxDeliveriesExceeded") && words.contains("ReconcileTimeout"), "the code was not read");
    let name = Regex::new(r"`([A-Z][a-z]+(?:[A-Z][a-z0-9]+)+)`").unwrap();
    let mut unknown = vec![];
    for page in files_below(&root.join("docs/src"), ".md") {
        for (n, line) in read(&page).lines().enumerate() {
            for c in name.captures_iter(line) {
                if !words.contains(&c[1]) && !KUBERNETES_NAMES.contains(&&c[1]) {
                    unknown.push(format!("{}:{}: {}", page.strip_prefix(root).unwrap().display(), n + 1, &c[1]));
                }
            }
        }
    }
    assert!(unknown.is_empty(), "names the book gives that nothing in the repository has:\n{}", unknown.join("\n"));
}

/// Compares a generated page with what it should hold now; rewrites it under `PELICAN_WRITE_DOCS=1`.
fn generated(page: &str, expected: String) {
    let path = Path::new(ROOT).join(page);
    if std::env::var_os("PELICAN_WRITE_DOCS").is_some() {
        std::fs::write(&path, &expected).unwrap();
    }
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    if current != expected {
        let first = current.lines().zip(expected.lines()).position(|(a, b)| a != b);
        panic!(
            "{page} is stale (first difference at line {}): regenerate it with `PELICAN_WRITE_DOCS=1 cargo test --test \
             docs` and document what changed",
            first.map_or(current.lines().count().min(expected.lines().count()), |n| n) + 1
        );
    }
}

fn help(binary: &str, args: &[&str]) -> String {
    let out = Command::new(binary).args(args).arg("--help").env_clear().output().unwrap();
    assert!(out.status.success(), "{binary} {args:?} --help: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_command_reference_is_what_clap_prints() {
    let pelican = env!("CARGO_BIN_EXE_pelican");
    let mut page = String::from(
        "# Commands, flags and environment variables\n\n<!-- Generated by `PELICAN_WRITE_DOCS=1 cargo test --test docs` \
         from the binaries' --help; tests/docs.rs fails when it is stale. -->\n\n`pelican` is the operator's binary \
         (the image runs `pelican run`); its `status`, `dlq`, `redrive` and `seek` are also the `kubectl pelican` \
         plugin (`kubectl-pelican`, the same commands). Every flag of `pelican run` can be set by the environment variable \
         shown with it; the chart sets them from its values. Besides those, the operator reads `RUST_LOG` (a \
         `tracing` filter that overrides the level, default `info`), `POD_NAME` (the Pod's name: the leader Lease's \
         holder identity, and the Pod the KEDA scaler labels; `HOSTNAME` when unset) and `POD_NAMESPACE` (the \
         Lease's namespace, and the scaler's Pod); the chart sets both from the downward API.\n",
    );
    // Each binary, then each of its subcommands as its --help lists them (a new one cannot be left out); the plugin's
    // commands once, under `kubectl pelican`.
    let plugin = env!("CARGO_BIN_EXE_kubectl-pelican");
    let commands = |top: &str| -> Vec<String> {
        let listed = top.lines().skip_while(|l| *l != "Commands:").skip(1).take_while(|l| !l.trim().is_empty());
        listed.filter_map(|l| l.split_whitespace().next()).filter(|c| *c != "help").map(str::to_string).collect()
    };
    let plugin_commands = commands(&help(plugin, &[]));
    for (name, binary) in [("pelican", pelican), ("kubectl pelican", plugin)] {
        let top = help(binary, &[]);
        page += &format!("\n## `{name}`\n\n```text\n{top}```\n");
        let own = commands(&top).into_iter().filter(|c| binary == plugin || !plugin_commands.contains(c));
        for command in own {
            page += &format!("\n## `{name} {command}`\n\n```text\n{}```\n", help(binary, &[&command]));
        }
    }
    // clap prints a doc comment as it is: a rustdoc link (`[`ESSENTIAL`]`) names nothing a user can look up.
    let rustdoc_links: Vec<&str> = Regex::new(r"\[`[^`\]]+`\]").unwrap().find_iter(&page).map(|m| m.as_str()).collect();
    assert!(rustdoc_links.is_empty(), "rustdoc links in the commands' --help: {rustdoc_links:?}");
    generated("docs/src/reference/commands.md", page);
}

#[test]
fn every_environment_variable_the_code_reads_is_documented() {
    let code = source();
    let docs: String = files_below(&Path::new(ROOT).join("docs/src"), ".md").iter().map(|p| read(p)).collect();
    let mut read_vars = BTreeSet::new();
    for pattern in [r#"env::var(?:_os)?\("([A-Z_]+)"\)"#, r#"env = "([A-Z_]+)""#] {
        for c in Regex::new(pattern).unwrap().captures_iter(&code) {
            read_vars.insert(c[1].to_string());
        }
    }
    read_vars.insert("RUST_LOG".into());
    let missing: Vec<&String> = read_vars.iter().filter(|v| !docs.contains(v.as_str())).collect();
    assert!(missing.is_empty(), "environment variables the code reads that docs/src does not name: {missing:?}");
}

/// The source files that talk to OpenTelemetry: the operator's and every library's (tests and benches left out).
fn telemetry_sources() -> Vec<PathBuf> {
    let root = Path::new(ROOT);
    let mut files = files_below(&root.join("src"), ".rs");
    for (dir, suffix) in [
        ("sdks/typescript/src", ".ts"),
        ("sdks/python/pelican_worker", ".py"),
        ("sdks/go", ".go"),
        ("sdks/java/src/main", ".java"),
    ] {
        files.extend(files_below(&root.join(dir), suffix));
    }
    files.retain(|f| {
        let name = f.to_string_lossy();
        !name.ends_with("_test.go") && !name.contains("/bench") && read(f).to_lowercase().contains("opentelemetry")
    });
    files
}

#[test]
fn every_instrument_and_attribute_the_code_names_is_in_the_reference() {
    let files = telemetry_sources();
    assert!(files.len() >= 6, "the operator's and the five libraries' OpenTelemetry code: {files:?}");
    let attribute = Regex::new(r#""((?:messaging|pelican|error)\.[a-z_.]+[a-z])""#).unwrap();
    let mut set = BTreeSet::new();
    for file in &files {
        set.extend(attribute.captures_iter(&read(file)).map(|c| c[1].to_string()));
    }
    let reference = read(&Path::new(ROOT).join("docs/src/reference/telemetry.md"));
    let listed: BTreeSet<String> = Regex::new(r"(?m)^\| `((?:messaging|pelican|error)\.[a-z_.]+)` \|")
        .unwrap()
        .captures_iter(&reference)
        .map(|c| c[1].to_string())
        .collect();
    let missing: Vec<&String> = set.difference(&listed).collect();
    let stale: Vec<&String> = listed.difference(&set).collect();
    assert!(missing.is_empty(), "attributes the code sets that reference/telemetry.md does not list: {missing:?}");
    assert!(stale.is_empty(), "attributes reference/telemetry.md lists that no code sets: {stale:?}");
}

#[test]
fn the_chart_values_reference_is_the_charts_values_yaml() {
    let values = read(&Path::new(ROOT).join("charts/pelican/values.yaml"));
    let page = format!(
        "# Chart values\n\n<!-- Generated by `PELICAN_WRITE_DOCS=1 cargo test --test docs` from \
         charts/pelican/values.yaml; tests/docs.rs fails when it is stale. -->\n\nEvery value of the chart \
         `charts/pelican`, its default and what it does, as `values.yaml` has them (`values.schema.json` refuses \
         values of the wrong type or shape at `helm install`). Set them with `--set key=value` or `-f my-values.yaml`.\
         \n\n```yaml\n{values}```\n"
    );
    generated("docs/src/reference/chart-values.md", page);
}

#[test]
fn every_relative_link_resolves() {
    let root = Path::new(ROOT);
    let mut pages = files_below(&root.join("docs/src"), ".md");
    pages.extend([root.join("README.md"), root.join("charts/pelican/README.md"), root.join("CHANGELOG.md")]);
    let link = Regex::new(r"\]\(([^)\s]+)\)").unwrap();
    let mut broken = vec![];
    for page in &pages {
        let text = read(page);
        let mut in_code = false;
        for line in text.lines() {
            if line.starts_with("```") {
                in_code = !in_code;
            }
            if in_code {
                continue;
            }
            for c in link.captures_iter(line) {
                let target = &c[1];
                if target.starts_with("http") || target.starts_with('#') || target.starts_with("mailto:") {
                    continue;
                }
                let file = target.split('#').next().unwrap();
                if !page.parent().unwrap().join(file).exists() {
                    broken.push(format!("{}: {target}", page.strip_prefix(root).unwrap().display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "links to nothing:\n{}", broken.join("\n"));
}

#[test]
fn every_page_of_the_book_is_in_its_summary() {
    let src = Path::new(ROOT).join("docs/src");
    let summary = read(&src.join("SUMMARY.md"));
    let orphans: Vec<String> = files_below(&src, ".md")
        .iter()
        .map(|p| p.strip_prefix(&src).unwrap().display().to_string())
        .filter(|p| p != "SUMMARY.md" && !summary.contains(&format!("({p})")))
        .collect();
    assert!(orphans.is_empty(), "pages docs/src/SUMMARY.md does not list: {orphans:?}");
}

/// What the API server checks on one field, as a user reads it: ranges, lengths, counts, the pattern, and the
/// messages of the field's CEL rules.
fn validation(field: &serde_json::Value) -> Vec<String> {
    let mut said = vec![];
    let bound = |key: &str| field[key].as_i64().or_else(|| field[key].as_f64().map(|f| f as i64));
    for (low, high, what) in [
        ("minimum", "maximum", ""),
        ("minLength", "maxLength", "length "),
        ("minItems", "maxItems", "items "),
        ("minProperties", "maxProperties", "entries "),
    ] {
        match (bound(low), bound(high)) {
            (Some(l), Some(h)) => said.push(format!("{what}{l} to {h}")),
            (Some(l), None) => said.push(format!("{what}at least {l}")),
            (None, Some(h)) => said.push(format!("{what}at most {h}")),
            (None, None) => {}
        }
    }
    if let Some(pattern) = field["pattern"].as_str() {
        said.push(format!("matches `{pattern}`"));
    }
    // Number widths (int32, int64, double) say nothing a user can act on; date-time and the like do.
    if let Some(format) =
        field["format"].as_str().filter(|f| !matches!(*f, "int32" | "int64" | "uint64" | "double" | "float"))
    {
        said.push(format!("format `{format}`"));
    }
    for rule in field["x-kubernetes-validations"].as_array().into_iter().flatten() {
        if let Some(message) = rule["message"].as_str() {
            said.push(format!("rule: {message}"));
        }
    }
    said
}

/// A CRD's text as Markdown shows it: `<` outside code spans escaped, or `{<topic>:<i>}` would be read as HTML
/// tags (the book showed the rule on a topic's streams as `{:}` and set the rest of the page in italics).
fn plain(text: &str) -> String {
    text.split('`')
        .enumerate()
        .map(|(i, part)| if i % 2 == 1 { part.to_string() } else { part.replace('<', "&lt;") })
        .collect::<Vec<_>>()
        .join("`")
}

/// One table row per field of an OpenAPI schema, depth first: `path | type | default | validation | description`.
fn fields(schema: &serde_json::Value, path: &str, rows: &mut Vec<String>) {
    let Some(properties) = schema["properties"].as_object() else { return };
    let required: BTreeSet<&str> =
        schema["required"].as_array().into_iter().flatten().filter_map(|r| r.as_str()).collect();
    for (name, field) in properties {
        let here = if path.is_empty() { name.clone() } else { format!("{path}.{name}") };
        let mut type_ = field["type"].as_str().unwrap_or("object").to_string();
        let items = &field["items"];
        if type_ == "array" {
            type_ = format!("[]{}", items["type"].as_str().unwrap_or("object"));
        }
        if let Some(values) = field["enum"].as_array() {
            let values: Vec<String> = values.iter().map(|v| v.as_str().unwrap_or_default().to_string()).collect();
            type_ = format!("{type_}: {}", values.join(" \\| "));
        }
        if required.contains(name.as_str()) {
            type_ += ", required";
        }
        let default = match &field["default"] {
            serde_json::Value::Null => String::new(),
            value => format!("`{value}`"),
        };
        let description =
            plain(field["description"].as_str().unwrap_or_default()).replace('\n', " ").replace('|', "\\|");
        let validation = plain(&validation(field).join("; ")).replace('|', "\\|");
        rows.push(format!("| `{here}` | {type_} | {default} | {validation} | {description} |"));
        fields(field, &here, rows);
        if items.is_object() {
            fields(items, &format!("{here}[]"), rows);
        }
    }
}

#[test]
fn the_api_reference_is_generated_from_the_crds() {
    let mut page = String::from(
        "# API reference\n\n<!-- Generated by `PELICAN_WRITE_DOCS=1 cargo test --test docs` from crds/; tests/docs.rs \
         fails when it is stale. -->\n\nEvery field of the four resources of `pelican.io/v1alpha1`, from the CRDs \
         the API server validates with (`kubectl explain cgp.spec --recursive` shows the same): the validation \
         column is what the API server refuses at admission (ranges, lengths, patterns, enum values in the type, and \
         the messages of each field's CEL rules); the rules across fields are listed after each table.\n",
    );
    for (kind, file) in [
        ("ConsumerGroupPolicy", "pelican.io_consumergrouppolicies.yaml"),
        ("DeadLetterRedrive", "pelican.io_deadletterredrives.yaml"),
        ("GroupSeek", "pelican.io_groupseeks.yaml"),
        ("RedisServer", "pelican.io_redisservers.yaml"),
    ] {
        let crd: serde_json::Value = serde_yaml::from_str(&read(&Path::new(ROOT).join("crds").join(file))).unwrap();
        let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
        page += &format!("\n## {kind}\n\n{}\n", plain(schema["description"].as_str().unwrap_or_default()));
        for part in ["spec", "status"] {
            let mut rows = vec![];
            fields(&schema["properties"][part], "", &mut rows);
            page += &format!(
                "\n### `{part}`\n\n| field | type | default | validation | description |\n| --- | --- | --- | --- | --- |\n"
            );
            page += &rows.join("\n");
            page += "\n";
            let rules: Vec<String> = schema["properties"][part]["x-kubernetes-validations"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|r| r["message"].as_str().map(|m| format!("- {}", plain(m))))
                .collect();
            if !rules.is_empty() {
                page += &format!("\nRules of `{part}` as a whole:\n\n{}\n", rules.join("\n"));
            }
        }
    }
    generated("docs/src/reference/api.md", page);
}

/// The header of a Lua script: its leading comment lines, without the `-- ` marks.
fn lua_header(path: &Path) -> String {
    read(path)
        .lines()
        .take_while(|l| l.starts_with("--"))
        .map(|l| l.trim_start_matches("--").strip_prefix(' ').unwrap_or(l.trim_start_matches("--")))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_scripts_reference_is_their_headers() {
    let root = Path::new(ROOT);
    let mut page = String::from(
        "# The scripts: keys, arguments and invariants\n\n<!-- Generated by `PELICAN_WRITE_DOCS=1 cargo test --test \
         docs` from the scripts' headers; tests/docs.rs fails when it is stale. -->\n\nEvery change Pelican makes to \
         a stream but the group's creation (`XGROUP CREATE ... MKSTREAM`) is one of these Lua scripts, run \
         atomically by the server: those of the operator's jobs (`src/jobs/scripts/`), of its own writes to a group \
         and its settings (`src/redis/scripts/`), and of the contract. Each header says what the script \
         takes (`KEYS`, `ARGV`), what it answers and the invariant it keeps; the tests check the invariants under \
         `kill -9`, failovers and concurrent callers. The scripts under `contract/scripts/` are the contract for \
         producers and workers in any language (`contract/README.md`): load them as they are.\n",
    );
    // Every script of the operator (its jobs, its own writes) and of the contract.
    let mut scripts = files_below(&root.join("src"), ".lua");
    scripts.extend(files_below(&root.join("contract/scripts"), ".lua"));
    for script in scripts {
        let name = script.strip_prefix(root).unwrap().display().to_string();
        let header = lua_header(&script);
        assert!(
            header.contains("KEYS[1]") && header.contains("Invariant"),
            "{name}: a script's header names its KEYS, ARGV and its invariant"
        );
        page += &format!("\n## [`{name}`](../../../{name})\n\n```text\n{header}\n```\n");
    }
    generated("docs/src/reference/scripts.md", page);
}

/// The book as a reader sees it, built (`mdbook build docs`, then `hack/book-files target/book`, as scripts/test
/// does): every reason the code writes sits in a table cell of the conditions page (a table split by a stray line
/// renders its rows as text full of `|`), no page has such a text row, and every link of every page leads to a
/// file of the site and, with a `#fragment`, to an element with that id there.
#[test]
#[ignore = "needs the built book: scripts/test builds it and then runs this (`cargo test --test docs -- --ignored`)"]
fn the_built_book_has_its_tables_anchors_and_links() {
    let book = Path::new(ROOT).join("target/book");
    assert!(
        book.join("index.html").is_file(),
        "no book at {}: mdbook build docs && hack/book-files target/book",
        book.display()
    );
    let pages = files_below(&book, ".html");
    let cells = Regex::new(r"(?s)<td>(.*?)</td>").unwrap();
    let code = Regex::new(r"<code>([A-Z][A-Za-z]+)</code>").unwrap();
    let conditions = read(&book.join("reference/conditions.html"));
    let in_cells: BTreeSet<String> = cells
        .captures_iter(&conditions)
        .flat_map(|cell| code.captures_iter(&cell[1]).map(|c| c[1].to_string()).collect::<Vec<_>>())
        .collect();
    let not_in_a_table: Vec<String> =
        reasons_in_code(&source()).into_iter().filter(|r| !in_cells.contains(r)).collect();
    assert!(
        not_in_a_table.is_empty(),
        "reasons not in a table cell of the rendered conditions page: {not_in_a_table:?}"
    );

    let href = Regex::new(r#"href="([^"]*)""#).unwrap();
    let text_row = Regex::new(r"<p>\|").unwrap();
    let mut ids: std::collections::HashMap<std::path::PathBuf, BTreeSet<String>> = Default::default();
    let id = Regex::new(r#"\bid="([^"]+)""#).unwrap();
    let mut broken = vec![];
    let mut links = 0;
    for page in &pages {
        let html = read(page);
        let name = page.strip_prefix(&book).unwrap().display().to_string();
        if text_row.is_match(&html) {
            broken.push(format!("{name}: a table row rendered as text (a line splits the table)"));
        }
        for link in href.captures_iter(&html) {
            let link = link[1].replace("&amp;", "&");
            // Absolute paths are mdBook's own (the 404 page's, against `site-url`), not the book's links.
            if link.contains("://") || link.starts_with("mailto:") || link.starts_with('/') || link.is_empty() {
                continue;
            }
            links += 1;
            let (path, fragment) = link.split_once('#').map_or((link.as_str(), None), |(p, f)| (p, Some(f)));
            let target = if path.is_empty() { page.clone() } else { page.parent().unwrap().join(path) };
            let Ok(target) = target.canonicalize() else {
                broken.push(format!("{name}: {link}: no such file"));
                continue;
            };
            if !target.starts_with(book.canonicalize().unwrap()) {
                broken.push(format!("{name}: {link}: outside the site"));
                continue;
            }
            let Some(fragment) = fragment.filter(|f| !f.is_empty()) else { continue };
            if target.extension().is_some_and(|e| e == "html") {
                let known = ids
                    .entry(target.clone())
                    .or_insert_with(|| id.captures_iter(&read(&target)).map(|c| c[1].to_string()).collect());
                if !known.contains(fragment) {
                    broken.push(format!("{name}: {link}: no element with id {fragment:?}"));
                }
            }
        }
    }
    assert!(links > 500, "only {links} links in {} pages: did the book's shape change?", pages.len());
    assert!(broken.is_empty(), "the built book has broken parts:\n{}", broken.join("\n"));
}

/// Every label a query in the book or the chart puts on a Pelican metric is one the code (the operator's or the Rust
/// worker's) writes: a runbook that
/// queries a label the metric does not have finds nothing at 3 a.m. (the oldest-pending runbook asked for
/// `pelican_job_failures_total{job="pass"}`). Prometheus' target label `job` passes only where it names the scrape job.
#[test]
fn labels_in_queries_are_labels_the_code_writes() {
    let code =
        read(&Path::new(ROOT).join("src/telemetry/metrics.rs")) + &read(&Path::new(ROOT).join("src/worker/metrics.rs"));
    let written: BTreeSet<String> =
        Regex::new(r#"\("([a-z_]+)", "#).unwrap().captures_iter(&code).map(|c| c[1].to_string()).collect();
    let query = Regex::new(r"(pelican_[a-z_]+)\{([^}]*)\}").unwrap();
    let name = Regex::new(r"^\s*([a-z_]+)\s*(=|!=|=~|!~)?\s*(.*)$").unwrap();
    let mut files = files_below(&Path::new(ROOT).join("docs/src"), ".md");
    files.extend(files_below(&Path::new(ROOT).join("charts/pelican"), ".yaml"));
    files.extend(files_below(&Path::new(ROOT).join("charts/pelican"), ".json"));
    let mut unknown = Vec::new();
    for file in &files {
        for found in query.captures_iter(&read(file)) {
            for item in found[2].split(',') {
                let Some(label) = name.captures(item) else { continue };
                let scrape_job = &label[1] == "job" && (label[3].contains("$job") || label[3].contains("alerts.job"));
                if !written.contains(&label[1]) && &label[1] != "le" && !scrape_job {
                    unknown.push(format!("{}: {}{{{}}}", file.display(), &found[1], &found[2]));
                }
            }
        }
    }
    assert!(unknown.is_empty(), "queries on labels no Pelican metric has:\n{}", unknown.join("\n"));
}

/// Every Pelican metric the book, the chart's alerts and its dashboard name is one the code (the operator's or the
/// Rust worker's) registers, as Prometheus shows it (`_total` on counters, `_bucket`, `_sum`, `_count` on
/// histograms): a renamed metric leaves an alert or a runbook query that finds nothing.
#[test]
fn metrics_the_docs_name_are_metrics_the_code_registers() {
    let root = Path::new(ROOT);
    let code: String = files_below(&root.join("src"), ".rs").iter().map(|f| read(f)).collect();
    let registered: BTreeSet<String> =
        Regex::new(r#""(pelican_[a-z_]+)""#).unwrap().captures_iter(&code).map(|c| c[1].to_string()).collect();
    assert!(registered.contains("pelican_group_lag") && registered.contains("pelican_passes"), "{registered:?}");
    let mut files = files_below(&root.join("docs/src"), ".md");
    for suffix in [".yaml", ".json", ".tpl", ".txt"] {
        files.extend(files_below(&root.join("charts/pelican"), suffix));
    }
    // `pelican_worker` is the Python library's package, not a metric.
    let metric = Regex::new(r"\bpelican_[a-z_]*[a-z]\b").unwrap();
    let mut unknown = BTreeSet::new();
    for file in &files {
        for found in metric.find_iter(&read(file)).map(|m| m.as_str()).filter(|m| *m != "pelican_worker") {
            let base = ["_total", "_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| found.strip_suffix(suffix))
                .unwrap_or(found);
            if !registered.contains(found) && !registered.contains(base) {
                unknown.insert(format!("{}: {found}", file.strip_prefix(root).unwrap().display()));
            }
        }
    }
    assert!(unknown.is_empty(), "metrics no code registers:\n{}", unknown.into_iter().collect::<Vec<_>>().join("\n"));
}

/// Every release in the changelog (`## <version>` and `## Unreleased`) says how to upgrade to it: a `### Upgrading`
/// section (`### Upgrading from <version>`), which the installing page's upgrade how-to sends the reader to.
#[test]
fn every_release_in_the_changelog_has_upgrade_notes() {
    let changelog = read(&Path::new(ROOT).join("CHANGELOG.md"));
    let releases: Vec<&str> = changelog.split("\n## ").skip(1).collect();
    assert!(releases.len() >= 2, "no releases found in CHANGELOG.md");
    let without: Vec<&str> = releases
        .iter()
        .filter(|release| !release.lines().any(|l| l.starts_with("### Upgrading")))
        .map(|release| release.lines().next().unwrap_or_default())
        .collect();
    assert!(without.is_empty(), "releases without a `### Upgrading` section in CHANGELOG.md: {without:?}");
    assert!(read(&Path::new(ROOT).join("docs/src/installing.md")).contains("changelog.md#upgrading-from-010"));
}
