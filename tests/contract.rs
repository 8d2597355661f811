//! The worker contract is one thing (contract/): every library under `sdks/` carries the worker scripts byte for
//! byte, all of them, and the operator and the Rust SDK read them from the folder itself.

#[macro_use]
mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::files_below;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Script name -> its bytes, for the `.lua` files below `dir` (build output and installed dependencies left out).
fn scripts_below(dir: &Path) -> BTreeMap<String, (PathBuf, Vec<u8>)> {
    files_below(dir, ".lua")
        .into_iter()
        .filter(|p| {
            !p.components().any(|c| {
                ["node_modules", ".venv", "dist", "target", "build"].contains(&c.as_os_str().to_str().unwrap_or(""))
            })
        })
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), (p.clone(), std::fs::read(&p).unwrap())))
        .collect()
}

#[test]
fn every_library_carries_the_contracts_scripts_byte_for_byte() {
    let contract = scripts_below(&Path::new(ROOT).join("contract/scripts"));
    assert_eq!(contract.len(), 6, "{:?}", contract.keys());
    let libraries: Vec<PathBuf> = std::fs::read_dir(Path::new(ROOT).join("sdks"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    assert!(!libraries.is_empty());
    for library in libraries {
        let copies = scripts_below(&library);
        assert_eq!(
            copies.keys().collect::<Vec<_>>(),
            contract.keys().collect::<Vec<_>>(),
            "{} carries other scripts than contract/scripts",
            library.display()
        );
        for (name, (path, bytes)) in &copies {
            assert!(
                bytes == &contract[name].1,
                "{} differs from contract/scripts/{name}: copy the contract's file over it",
                path.display()
            );
        }
    }
}

/// The libraries that ship the contract's version as a file of their own (so that a copy of the library outside the
/// repository still knows it) ship the contract folder's.
#[test]
fn every_packaged_contract_version_is_the_contracts() {
    let version = std::fs::read_to_string(Path::new(ROOT).join("contract/VERSION")).unwrap();
    for copy in ["sdks/python/pelican_worker/CONTRACT_VERSION", "sdks/typescript/CONTRACT_VERSION"] {
        let packaged = std::fs::read_to_string(Path::new(ROOT).join(copy)).unwrap_or_else(|e| panic!("{copy}: {e}"));
        assert_eq!(
            packaged.trim(),
            version.trim(),
            "{copy} differs from contract/VERSION: copy the contract's file over it"
        );
    }
}
