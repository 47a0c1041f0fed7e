//! The CUDA C sources, embedded at build time, and the modules made of them.
//!
//! Each `.cu` file is self-contained: it `#include`s the shared device code it uses from `kernels/include/`
//! (batch geometry, reductions and compaction, top-k, page bounds, the attention-weights passes, the
//! decisions' arithmetic, element types). NVRTC gets one text per module: [`expand`] replaces each
//! `#include "name"` by the named file of [`FILES`], once per module (every file is include-once, as with
//! `#pragma once`), so NVRTC needs no include path and the disk cache's key is the whole text. A module is
//! itself a list of includes ([`SELECT`] compiles the selection kernels of every policy into one module).

use std::collections::HashSet;

use crate::error::{Error, ErrorKind, Result};

macro_rules! kernel_files {
    ($($name:literal => $path:literal),* $(,)?) => {
        /// Every kernel source by the name `#include` uses.
        pub const FILES: &[(&str, &str)] = &[$(($name, include_str!(concat!("../../kernels/", $path)))),*];
        /// Where each file of [`FILES`] lives under kernels/ (same order).
        #[cfg(test)]
        const PATHS: &[&str] = &[$($path),*];
    };
}

kernel_files! {
    "common.cuh" => "include/common.cuh",
    "decide.cuh" => "include/decide.cuh",
    "params.cuh" => "include/params.cuh",
    "combine.cuh" => "include/combine.cuh",
    "mma.cuh" => "include/mma.cuh",
    "fp8.cuh" => "include/fp8.cuh",
    "kv_load.cuh" => "include/kv_load.cuh",
    "key_rows.cuh" => "include/key_rows.cuh",
    "block_reduce.cuh" => "include/block_reduce.cuh",
    "batch.cuh" => "include/batch.cuh",
    "topk.cuh" => "include/topk.cuh",
    "cluster.cuh" => "include/cluster.cuh",
    "page_bounds.cuh" => "include/page_bounds.cuh",
    "weights_pass.cuh" => "include/weights_pass.cuh",
    "mma_tile.cuh" => "include/mma_tile.cuh",
    "attention.cu" => "attention.cu",
    "attention_mma.cu" => "attention_mma.cu",
    "attention_prefill.cu" => "attention_prefill.cu",
    "cache_write.cu" => "cache_write.cu",
    "merge.cu" => "merge.cu",
    "fill.cu" => "fill.cu",
    "meta.cu" => "meta.cu",
    "write_step.cu" => "write_step.cu",
    "select.cu" => "select.cu",
    "quest.cu" => "policy/quest.cu",
    "top_p.cu" => "policy/top_p.cu",
    "art.cu" => "policy/art/priority.cu",
    "art_traversal.cuh" => "policy/art/traversal.cuh",
    "snapkv.cu" => "policy/snapkv.cu",
    "refresh.cu" => "policy/refresh.cu",
    "prr.cu" => "policy/speculate.cu",
    "predictor.cu" => "policy/predictor.cu",
    "slots.cu" => "slots.cu",
}

/// The modules (what `Modules::function` compiles, by name), each a list of the files it holds.
pub const ATTENTION: &str = "#include \"attention.cu\"";
pub const ATTENTION_MMA: &str = "#include \"attention_mma.cu\"";
pub const ATTENTION_PREFILL: &str = "#include \"attention_prefill.cu\"";
pub const CACHE_WRITE: &str = "#include \"cache_write.cu\"";
pub const MERGE: &str = "#include \"merge.cu\"";
pub const FILL: &str = "#include \"fill.cu\"";
pub const META: &str = "#include \"meta.cu\"";
/// A decode step's cache write in one launch (slot check, store and key metadata).
pub const WRITE_STEP: &str = "#include \"write_step.cu\"";
/// The selection kernels: the plain plans (select.cu) and those of Quest, top-p, ART, SnapKV, RefreshKV
/// and PRR (kernels/policy/): one module, so a sparse engine compiles them once per (dtype, head size,
/// group).
pub const SELECT: &str = "#include \"select.cu\"\n#include \"quest.cu\"\n#include \"top_p.cu\"\n#include \"art.cu\"\n#include \"snapkv.cu\"\n#include \"refresh.cu\"\n#include \"prr.cu\"";
pub const PREDICTOR: &str = "#include \"predictor.cu\"";
pub const SLOTS: &str = "#include \"slots.cu\"";

/// Size and field offsets of a Rust struct that a kernel takes by value, for the test that compares them
/// with the C definition in kernels/include/params.cuh (see `c_layout!`).
#[cfg(test)]
pub(crate) struct CLayout {
    pub c_name: &'static str,
    pub size: usize,
    /// (C name, offset, size) of every field, in order.
    pub fields: Vec<(&'static str, usize, usize)>,
}

/// The size of what `p` points to (a field's size, from a pointer that is never read).
#[cfg(test)]
pub(crate) fn pointee_size<T>(_: *const T) -> usize {
    std::mem::size_of::<T>()
}

/// `c_layout!(RustType as "CName" { field, field => "c_field", ... })`: the [`CLayout`] of a `#[repr(C)]`
/// struct, every field listed (a field named differently in C gets `=> "name"`).
#[cfg(test)]
macro_rules! c_layout {
    ($t:ty as $c:literal { $($f:ident $(=> $cf:literal)?),* $(,)? }) => {
        $crate::cuda::kernel_src::CLayout {
            c_name: $c,
            size: std::mem::size_of::<$t>(),
            fields: vec![$((
                { #[allow(unused_mut, unused_assignments)] let mut n = stringify!($f); $(n = $cf;)? n },
                std::mem::offset_of!($t, $f),
                {
                    let u = std::mem::MaybeUninit::<$t>::uninit();
                    // SAFETY: only the field's address is taken; nothing is read.
                    $crate::cuda::kernel_src::pointee_size(unsafe { std::ptr::addr_of!((*u.as_ptr()).$f) })
                },
            )),*],
        }
    };
}
#[cfg(test)]
pub(crate) use c_layout;

/// Deepest include nesting accepted (the sources nest three deep).
const MAX_DEPTH: usize = 16;

/// The file named `name`, if the registry has it.
pub fn file(name: &str) -> Option<&'static str> {
    FILES.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// `src` with every `#include "name"` replaced by the named file (recursively, each file at most once)
/// and `#pragma once` lines dropped: the text NVRTC compiles.
pub fn expand(src: &str) -> Result<String> {
    let mut out = String::with_capacity(src.len() + 64 * 1024);
    let mut seen = HashSet::new();
    expand_into(src, "(module)", &mut out, &mut seen, 0)?;
    Ok(out)
}

fn expand_into(text: &str, from: &str, out: &mut String, seen: &mut HashSet<&'static str>, depth: usize) -> Result<()> {
    if depth > MAX_DEPTH {
        return Err(Error::new(ErrorKind::Internal, format!("kernel source {from}: includes nest deeper than {MAX_DEPTH}")));
    }
    for line in text.lines() {
        let t = line.trim_start();
        if t.trim_end() == "#pragma once" {
            continue;
        }
        if let Some(rest) = t.strip_prefix("#include") {
            let name = rest.trim().strip_prefix('"').and_then(|r| r.strip_suffix('"'));
            let Some((name, body)) = name.and_then(|n| FILES.iter().find(|(f, _)| *f == n).copied()) else {
                return Err(Error::new(ErrorKind::Internal, format!("kernel source {from}: {} names no kernel file", t.trim_end())));
            };
            if seen.insert(name) {
                expand_into(body, name, out, seen, depth + 1)?;
            }
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every file of kernels/ is in the registry, every include names a registered file, no include sits
    /// inside a conditional (the expansion ignores the preprocessor's conditions), and every module
    /// expands with each file once.
    #[test]
    fn registry_covers_the_kernels_and_every_module_expands() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let mut on_disk = Vec::new();
        let mut dirs = vec![dir.clone()];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    dirs.push(p);
                } else if matches!(p.extension().and_then(|x| x.to_str()), Some("cu" | "cuh")) {
                    on_disk.push(p.strip_prefix(&dir).unwrap().to_str().unwrap().to_string());
                }
            }
        }
        on_disk.sort();
        let mut registered: Vec<String> = PATHS.iter().map(|p| p.to_string()).collect();
        registered.sort();
        assert_eq!(on_disk, registered, "kernels/ and the registry differ");
        for (name, text) in FILES {
            let mut cond = 0i32;
            for line in text.lines().map(str::trim_start) {
                if line.starts_with("#if") {
                    cond += 1;
                } else if line.starts_with("#endif") {
                    cond -= 1;
                } else if line.starts_with("#include") {
                    assert_eq!(cond, 0, "{name}: an #include inside a conditional");
                    assert!(expand(line).is_ok(), "{name}: {line}");
                }
            }
        }
        let hooked: Vec<String> = crate::policy::TRAVERSAL_HOOKS.iter().map(|h| h.module().1).collect();
        for m in [ATTENTION, ATTENTION_MMA, ATTENTION_PREFILL, CACHE_WRITE, MERGE, FILL, META, WRITE_STEP, SELECT, PREDICTOR, SLOTS].into_iter().chain(hooked.iter().map(String::as_str)) {
            let text = expand(m).unwrap();
            assert!(!text.contains("#include") && !text.contains("#pragma once"), "{m}");
            // common.cuh's typedefs appear exactly once however many files include it.
            assert_eq!(text.matches("typedef long long i64;").count(), 1, "{m}");
        }
        assert!(expand("#include \"nope.cuh\"").is_err());
        assert!(expand("#include <cuda.h>").is_err());
    }

    /// The fields of each struct of `text`, in order: (name, field names).
    fn c_structs(text: &str) -> Vec<(String, Vec<String>)> {
        let mut out = Vec::new();
        let mut cur: Option<(String, Vec<String>)> = None;
        for raw in text.lines() {
            let line = raw.split("//").next().unwrap().trim();
            if let Some(rest) = line.strip_prefix("struct ") {
                let name = rest.trim_end_matches('{').split_whitespace().last().unwrap().to_string();
                cur = Some((name, Vec::new()));
            } else if line.starts_with("};") {
                out.push(cur.take().expect("struct open"));
            } else if let Some((_, fields)) = cur.as_mut() {
                for decl in line.split(';').map(str::trim).filter(|d| !d.is_empty()) {
                    let mut parts = decl.split(',');
                    let first = parts.next().unwrap();
                    let ident = |s: &str| s.trim().trim_start_matches('*').split('[').next().unwrap().trim().to_string();
                    fields.push(ident(first.rsplit(|c: char| c == ' ' || c == '*').next().unwrap()));
                    fields.extend(parts.map(ident));
                }
            }
        }
        out
    }

    /// The text of each top-level `struct NAME { ... };` of `text`, by name.
    fn struct_blocks(text: &str) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut cur: Option<(String, String)> = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("struct ").filter(|r| r.trim_end().ends_with('{')) {
                cur = Some((rest.trim_end_matches('{').trim().to_string(), String::new()));
            }
            if let Some((_, body)) = cur.as_mut() {
                body.push_str(line);
                body.push('\n');
                if line.starts_with("};") {
                    out.push(cur.take().expect("struct open"));
                }
            }
        }
        out
    }

    /// Every struct the host passes by value has the size and the field names, offsets and sizes of its
    /// Rust mirror: the shared ones (kernels/include/params.cuh, each of which must have a mirror) and a
    /// policy's own, defined in its kernel file (kernels/policy/); the definitions are compiled with the
    /// host C compiler (device pointers and the host's are both 64-bit) and their offsetof values compared
    /// with offset_of!.
    #[test]
    fn kernel_param_structs_match_their_rust_mirrors() {
        let rust: Vec<CLayout> = [super::super::batch::c_layouts(), crate::policy::refresh::cuda::c_layouts(), crate::policy::predictor::cuda::c_layouts(), crate::policy::art::cuda::c_layouts()].into_iter().flatten().collect();
        let shared = file("params.cuh").unwrap().lines().filter(|l| !l.starts_with("#pragma") && !l.starts_with("#include")).collect::<Vec<_>>().join("\n");
        let shared_names: Vec<String> = c_structs(&shared).into_iter().map(|(n, _)| n).collect();
        for name in &shared_names {
            assert!(rust.iter().any(|r| &r.c_name == name), "params.cuh's struct {name} has no Rust mirror");
        }
        // Each mirror's C definition: in params.cuh or in exactly one other kernel file.
        let mut header = shared.clone();
        for r in &rust {
            let defs: Vec<String> = FILES.iter().flat_map(|(_, text)| struct_blocks(text)).filter(|(n, _)| n == r.c_name).map(|(_, b)| b).collect();
            assert_eq!(defs.len(), 1, "struct {} is defined {} times in the kernel files", r.c_name, defs.len());
            if !shared_names.iter().any(|n| n == r.c_name) {
                header.push('\n');
                header.push_str(&defs[0]);
            }
        }
        let structs = c_structs(&header);
        assert_eq!(structs.len(), rust.len(), "{} C structs, Rust mirrors {}", structs.len(), rust.len());
        let mut prog = String::from("#include <stdio.h>\n#include <stddef.h>\ntypedef long long i64;\ntypedef unsigned short u16;\n");
        prog.push_str(&header);
        prog.push_str("\nint main(void) {\n");
        for (name, fields) in &structs {
            prog.push_str(&format!("    printf(\"{name} %zu\\n\", sizeof(struct {name}));\n"));
            for f in fields {
                prog.push_str(&format!("    printf(\"{name}.{f} %zu %zu\\n\", offsetof(struct {name}, {f}), sizeof(((struct {name}*)0)->{f}));\n"));
            }
        }
        prog.push_str("    return 0;\n}\n");
        let dir = std::env::temp_dir().join(format!("kvs-params-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (src, exe) = (dir.join("params.c"), dir.join("params"));
        std::fs::write(&src, &prog).unwrap();
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let st = std::process::Command::new(&cc).arg("-x").arg("c").arg(&src).arg("-o").arg(&exe).status().unwrap_or_else(|e| panic!("{cc}: {e} (a C compiler is needed)"));
        assert!(st.success(), "{cc} failed on the parameter structs:\n{prog}");
        let out = String::from_utf8(std::process::Command::new(&exe).output().unwrap().stdout).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        // "Name size" and "Name.field offset size" lines.
        let c: std::collections::HashMap<&str, Vec<usize>> = out.lines().map(|l| l.split_once(' ').unwrap()).map(|(k, v)| (k, v.split(' ').map(|x| x.parse().unwrap()).collect())).collect();
        for r in &rust {
            let (_, fields) = structs.iter().find(|(n, _)| n == r.c_name).unwrap_or_else(|| panic!("no C struct {}", r.c_name));
            let names: Vec<&str> = r.fields.iter().map(|(n, _, _)| *n).collect();
            assert_eq!(fields.iter().map(String::as_str).collect::<Vec<_>>(), names, "{}: C fields vs Rust fields", r.c_name);
            assert_eq!(c[r.c_name], [r.size], "sizeof({})", r.c_name);
            for (f, off, size) in &r.fields {
                assert_eq!(c[format!("{}.{f}", r.c_name).as_str()], [*off, *size], "offset and size of {}.{f}", r.c_name);
            }
        }
    }
}
