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
