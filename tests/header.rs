//! `include/kvsparse.h` must be exactly what cbindgen generates from the sources (CI runs this test).
//! `KVS_UPDATE_HEADER=1 cargo test --test header` rewrites the committed header.

use std::path::PathBuf;

#[test]
fn committed_header_matches_cbindgen_output() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml parses");
    // The crate (from src/lib.rs, its modules in declaration order), then each policy folder (a policy's own
    // C entries): the folders are declared by a macro (`policy_modules!`), which cbindgen does not expand.
    let mut builder = cbindgen::Builder::new().with_src(root.join("src/lib.rs"));
    let mut folders: Vec<PathBuf> = std::fs::read_dir(root.join("src/policy")).unwrap().map(|e| e.unwrap().path().join("mod.rs")).filter(|p| p.exists()).collect();
    folders.sort();
    for f in folders {
        builder = builder.with_src(f);
    }
    let bindings = builder.with_config(config).generate().expect("cbindgen generates the header");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let generated = String::from_utf8(generated).unwrap();
    let path = root.join("include/kvsparse.h");
    if std::env::var_os("KVS_UPDATE_HEADER").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/kvsparse.h is stale: regenerate it with `KVS_UPDATE_HEADER=1 cargo test --test header` and commit it"
    );
}

/// Every name the header declares is part of the ABI (`kvs_*`, `KVS_*`, or DLPack's own types): internal
/// Rust types that cbindgen picks up (an opaque `HoltParams` once) must be excluded in cbindgen.toml.
#[test]
fn header_declares_only_abi_names() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let header = std::fs::read_to_string(root.join("include/kvsparse.h")).unwrap();
    let mut bad = Vec::new();
    for line in header.lines() {
        let t = line.trim_start();
        if t.starts_with("//") || t.starts_with('*') || t.starts_with("/*") {
            continue;
        }
        // `typedef struct X X;`, `} X;`, function names `kvs_...(`, enumerators `KVS_... =`.
        let name = if let Some(rest) = t.strip_prefix("typedef struct ") {
            rest.split_whitespace().next().filter(|n| *n != "{")
        } else if let Some(rest) = t.strip_prefix("} ") {
            rest.strip_suffix(';')
        } else {
            None
        };
        if let Some(n) = name {
            if !(n.starts_with("kvs_") || n.starts_with("DL")) {
                bad.push(n.to_string());
            }
        }
    }
    assert!(bad.is_empty(), "the header declares non-ABI names: {bad:?} (add them to cbindgen.toml's [export] exclude)");
}
