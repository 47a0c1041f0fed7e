//! `include/kvsparse.h` must be exactly what cbindgen generates from the sources (CI runs this test).
//! `KVS_UPDATE_HEADER=1 cargo test --test header` rewrites the committed header.

use std::path::PathBuf;

#[test]
fn committed_header_matches_cbindgen_output() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml parses");
    let bindings = cbindgen::Builder::new().with_crate(&root).with_config(config).generate().expect("cbindgen generates the header");
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
