//! `crds/` holds exactly what `pelican crd` prints for the current Rust types.

const CRDS: [(&str, &str); 4] = [
    ("consumergrouppolicies", "pelican.io_consumergrouppolicies.yaml"),
    ("deadletterredrives", "pelican.io_deadletterredrives.yaml"),
    ("groupseeks", "pelican.io_groupseeks.yaml"),
    ("redisservers", "pelican.io_redisservers.yaml"),
];

fn committed(file: &str) -> String {
    std::fs::read_to_string(format!("{}/crds/{file}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

#[test]
fn committed_crds_match_the_rust_types() {
    for (name, file) in CRDS {
        let printed = std::process::Command::new(env!("CARGO_BIN_EXE_pelican")).args(["crd", name]).output().unwrap();
        assert!(printed.status.success());
        assert!(
            String::from_utf8(printed.stdout).unwrap() == committed(file),
            "crds/{file} is stale: run `cargo run -- crd {name} > crds/{file}`"
        );
    }
    // Without a name, all, as one multi-document stream.
    let all = std::process::Command::new(env!("CARGO_BIN_EXE_pelican")).arg("crd").output().unwrap();
    let committed_all: Vec<String> = CRDS.iter().map(|(_, file)| committed(file)).collect();
    assert_eq!(String::from_utf8(all.stdout).unwrap(), committed_all.join("---\n"));
    let wrong = std::process::Command::new(env!("CARGO_BIN_EXE_pelican")).args(["crd", "policies"]).output().unwrap();
    assert!(!wrong.status.success());
    assert!(
        String::from_utf8_lossy(&wrong.stderr)
            .contains("use consumergrouppolicies, deadletterredrives, groupseeks or redisservers")
    );
}

/// Every object and field of the schemas has a description, so `kubectl explain` never prints `<empty>` or
/// `<no description>`; enum fields say what each value means.
#[test]
fn every_field_of_the_schema_is_documented() {
    let mut undocumented = Vec::new();
    for (name, file) in CRDS {
        let crd: serde_json::Value = serde_yaml::from_str(&committed(file)).unwrap();
        for version in crd["spec"]["versions"].as_array().unwrap() {
            walk(&version["schema"]["openAPIV3Schema"], name.into(), &mut undocumented);
        }
    }
    assert!(undocumented.is_empty(), "fields without a description: {undocumented:#?}");
}

fn walk(schema: &serde_json::Value, path: String, undocumented: &mut Vec<String>) {
    match schema["description"].as_str() {
        None | Some("") => undocumented.push(path.clone()),
        Some(text) => {
            // An enum's description names each of its values.
            for value in schema["enum"].as_array().into_iter().flatten() {
                let value = value.as_str().unwrap_or_default();
                if !text.contains(&format!("`{value}`")) {
                    undocumented.push(format!("{path} (value {value})"));
                }
            }
        }
    }
    for (name, field) in schema["properties"].as_object().into_iter().flatten() {
        walk(field, format!("{path}.{name}"), undocumented);
    }
    if schema["items"].is_object() {
        walk(&schema["items"], format!("{path}[]"), undocumented);
    }
}
