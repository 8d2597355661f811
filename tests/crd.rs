//! `crds/` holds exactly what `pelican crd` prints for the current Rust types.

#[test]
fn committed_crd_matches_the_rust_types() {
    let printed = std::process::Command::new(env!("CARGO_BIN_EXE_pelican")).arg("crd").output().unwrap();
    assert!(printed.status.success());
    let committed =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/crds/pelican.io_consumergrouppolicies.yaml"))
            .unwrap();
    assert!(
        String::from_utf8(printed.stdout).unwrap() == committed,
        "crds/ is stale: run `cargo run -- crd > crds/pelican.io_consumergrouppolicies.yaml`"
    );
}

/// Every object and field of the schema has a description, so `kubectl explain` never prints `<empty>` or
/// `<no description>`; enum fields say what each value means.
#[test]
fn every_field_of_the_schema_is_documented() {
    let committed =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/crds/pelican.io_consumergrouppolicies.yaml"))
            .unwrap();
    let crd: serde_json::Value = serde_yaml::from_str(&committed).unwrap();
    let mut undocumented = Vec::new();
    for version in crd["spec"]["versions"].as_array().unwrap() {
        walk(&version["schema"]["openAPIV3Schema"], "cgp".into(), &mut undocumented);
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
