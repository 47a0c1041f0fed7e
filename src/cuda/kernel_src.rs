//! The CUDA C sources, embedded at build time, and the modules made of them.
//!
//! Each `.cu` file is self-contained: it `#include`s the shared device code it uses from `kernels/include/`
//! (batch geometry, reductions and compaction, top-k, page bounds, the attention-weights passes, the
//! decisions' arithmetic, element types). A module is a list of files ([`Module`]); NVRTC gets one text
//! per module: [`expand`] writes each file in order with every `#include "name"` replaced by the shared
//! file of [`FILES`], each file once per module (every file is include-once, as with `#pragma once`), so
//! NVRTC needs no include path and the disk cache's key is the whole text. The shared files and modules
//! are listed here; a policy's own files (kernels/policy/) are declared in its folder (`kernel_file!`) and
//! reach a module through the policy registry (src/policy/registry.rs: the selection module
//! `SELECT_MODULE`, a policy's module of its own, a traversal hook), so nothing here names a policy.

use std::collections::HashSet;

use crate::error::{Error, ErrorKind, Result};

/// A kernel source file: its name (what `#include` and a module's files use), where it lives under
/// kernels/, and its text.
#[derive(Debug)]
pub struct KernelFile {
    pub name: &'static str,
    pub path: &'static str,
    pub text: &'static str,
}

/// `kernel_file!("name", "path under kernels/")`: a [`KernelFile`] with the file's text embedded.
macro_rules! kernel_file {
    ($name:literal, $path:literal) => {
        $crate::cuda::kernel_src::KernelFile { name: $name, path: $path, text: include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/", $path)) }
    };
}
pub(crate) use kernel_file;

/// The files NVRTC compiles as one text, in this order (each with what it includes, every file once).
pub type Module = &'static [&'static KernelFile];

/// The shared kernel sources: every file `#include` may name, and the shared modules' files.
pub const FILES: &[KernelFile] = &[
    kernel_file!("common.cuh", "include/common.cuh"),
    kernel_file!("decide.cuh", "include/decide.cuh"),
    kernel_file!("params.cuh", "include/params.cuh"),
    kernel_file!("combine.cuh", "include/combine.cuh"),
    kernel_file!("mma.cuh", "include/mma.cuh"),
    kernel_file!("split_f16.cuh", "include/split_f16.cuh"),
    kernel_file!("fp8.cuh", "include/fp8.cuh"),
    kernel_file!("kv_load.cuh", "include/kv_load.cuh"),
    kernel_file!("key_rows.cuh", "include/key_rows.cuh"),
    kernel_file!("block_reduce.cuh", "include/block_reduce.cuh"),
    kernel_file!("batch.cuh", "include/batch.cuh"),
    kernel_file!("topk.cuh", "include/topk.cuh"),
    kernel_file!("cluster.cuh", "include/cluster.cuh"),
    kernel_file!("cluster_topk.cuh", "include/cluster_topk.cuh"),
    kernel_file!("page_bounds.cuh", "include/page_bounds.cuh"),
    kernel_file!("weights_pass.cuh", "include/weights_pass.cuh"),
    kernel_file!("mma_tile.cuh", "include/mma_tile.cuh"),
    kernel_file!("attention.cu", "attention.cu"),
    kernel_file!("attention_mma.cu", "attention_mma.cu"),
    kernel_file!("attention_prefill.cu", "attention_prefill.cu"),
    kernel_file!("cache_write.cu", "cache_write.cu"),
    kernel_file!("merge.cu", "merge.cu"),
    kernel_file!("fill.cu", "fill.cu"),
    kernel_file!("meta.cu", "meta.cu"),
    kernel_file!("write_step.cu", "write_step.cu"),
    kernel_file!("select.cu", "select.cu"),
    kernel_file!("slots.cu", "slots.cu"),
];

/// The shared file named `name`; a name not in [`FILES`] fails the build where a module names it.
pub const fn file(name: &str) -> &'static KernelFile {
    let mut i = 0;
    while i < FILES.len() {
        if eq(FILES[i].name.as_bytes(), name.as_bytes()) {
            return &FILES[i];
        }
        i += 1;
    }
    panic!("no such shared kernel file")
}

/// `a == b` for byte strings, at compile time.
const fn eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// The shared modules (what `Modules::function` compiles, by name); the policies' are the registry's.
pub const ATTENTION: Module = &[file("attention.cu")];
pub const ATTENTION_MMA: Module = &[file("attention_mma.cu")];
pub const ATTENTION_PREFILL: Module = &[file("attention_prefill.cu")];
pub const CACHE_WRITE: Module = &[file("cache_write.cu")];
pub const MERGE: Module = &[file("merge.cu")];
pub const FILL: Module = &[file("fill.cu")];
pub const META: Module = &[file("meta.cu")];
/// A decode step's cache write in one launch (slot check, store and key metadata).
pub const WRITE_STEP: Module = &[file("write_step.cu")];
pub const SLOTS: Module = &[file("slots.cu")];

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

/// The text NVRTC compiles for `module`: its files in order, each with every `#include "name"` replaced by
/// the named shared file (recursively, each file at most once) and `#pragma once` lines dropped.
pub fn expand(module: &[&KernelFile]) -> Result<String> {
    let mut out = String::with_capacity(64 * 1024);
    let mut seen = HashSet::new();
    for f in module {
        if seen.insert(f.name) {
            expand_into(f.text, f.name, &mut out, &mut seen, 1)?;
        }
    }
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
            let Some(f) = name.and_then(|n| FILES.iter().find(|f| f.name == n)) else {
                return Err(Error::new(ErrorKind::Internal, format!("kernel source {from}: {} names no shared kernel file", t.trim_end())));
            };
            if seen.insert(f.name) {
                expand_into(f.text, f.name, out, seen, depth + 1)?;
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

    /// Every module, shared or a policy's (the registry's: the selection module, a policy's own, each
    /// traversal hook's), by name.
    fn modules() -> Vec<(String, Vec<&'static KernelFile>)> {
        let shared = [("attention", ATTENTION), ("attention_mma", ATTENTION_MMA), ("attention_prefill", ATTENTION_PREFILL), ("cache_write", CACHE_WRITE), ("merge", MERGE), ("fill", FILL), ("meta", META), ("write_step", WRITE_STEP), ("slots", SLOTS)];
        let policies = [("select", crate::policy::SELECT_MODULE)].into_iter().chain(crate::policy::OWN_MODULES.iter().copied());
        let hooked = crate::policy::TRAVERSAL_HOOKS.iter().map(|h| h.module()).map(|(n, m)| (n, m.to_vec()));
        shared.into_iter().chain(policies).map(|(n, m)| (n.to_string(), m.to_vec())).chain(hooked).collect()
    }

    /// Every kernel file, once: the shared ones and the policies' (those their modules hold).
    fn all_files() -> Vec<&'static KernelFile> {
        let mut out: Vec<&'static KernelFile> = FILES.iter().collect();
        for f in modules().into_iter().flat_map(|(_, m)| m) {
            if !out.iter().any(|o| o.path == f.path) {
                out.push(f);
            }
        }
        out
    }

    /// Every file of kernels/ is a shared file or in a policy's module, by one name; every include names
    /// a shared file, no include sits inside a conditional (the expansion ignores the preprocessor's
    /// conditions), and every module expands with each file once.
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
        let files = all_files();
        let mut registered: Vec<String> = files.iter().map(|f| f.path.to_string()).collect();
        registered.sort();
        assert_eq!(on_disk, registered, "kernels/ and the registered files differ");
        let mut names: Vec<&str> = files.iter().map(|f| f.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), files.len(), "two kernel files share a name");
        for f in &files {
            let mut cond = 0i32;
            for line in f.text.lines().map(str::trim_start) {
                if line.starts_with("#if") {
                    cond += 1;
                } else if line.starts_with("#endif") {
                    cond -= 1;
                } else if line.starts_with("#include") {
                    assert_eq!(cond, 0, "{}: an #include inside a conditional", f.name);
                    assert!(expand_into(line, f.name, &mut String::new(), &mut HashSet::new(), 1).is_ok(), "{}: {line}", f.name);
                }
            }
        }
        for (name, m) in modules() {
            let text = expand(&m).unwrap();
            assert!(!text.contains("#include") && !text.contains("#pragma once"), "{name}");
            // common.cuh's typedefs appear exactly once however many files include it.
            assert_eq!(text.matches("typedef long long i64;").count(), 1, "{name}");
        }
        let bad = |text: &'static str| expand(&[&KernelFile { name: "bad.cu", path: "bad.cu", text }]);
        assert!(bad("#include \"nope.cuh\"").is_err());
        assert!(bad("#include <cuda.h>").is_err());
        assert!(bad("#include \"common.cuh\"").is_ok());
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
    /// policy's own, defined in its kernel file (kernels/policy/; its mirrors listed by the registry's
    /// `PARAM_LAYOUTS`); the definitions are compiled with the
    /// host C compiler (device pointers and the host's are both 64-bit) and their offsetof values compared
    /// with offset_of!.
    #[test]
    fn kernel_param_structs_match_their_rust_mirrors() {
        let rust: Vec<CLayout> = std::iter::once(super::super::batch::c_layouts as fn() -> Vec<CLayout>).chain(crate::policy::PARAM_LAYOUTS.iter().copied()).flat_map(|f| f()).collect();
        let shared = file("params.cuh").text.lines().filter(|l| !l.starts_with("#pragma") && !l.starts_with("#include")).collect::<Vec<_>>().join("\n");
        let shared_names: Vec<String> = c_structs(&shared).into_iter().map(|(n, _)| n).collect();
        for name in &shared_names {
            assert!(rust.iter().any(|r| &r.c_name == name), "params.cuh's struct {name} has no Rust mirror");
        }
        // Each mirror's C definition: in params.cuh or in exactly one other kernel file.
        let mut header = shared.clone();
        for r in &rust {
            let defs: Vec<String> = all_files().iter().flat_map(|f| struct_blocks(f.text)).filter(|(n, _)| n == r.c_name).map(|(_, b)| b).collect();
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
