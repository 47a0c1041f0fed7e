//! The tensor-core attention kernel's traversal hook, host side (kernels/attention_mma.cu, TRAVERSAL_HOOK):
//! a stage after the selector that watches each decode row's traversal of its plan, round by round, and
//! may stop it. The stage describes its hook once ([`HookKernel`]: its kernel file and the kernel shape it
//! needs) and hands the attention launch a [`TraversalLaunch`] per call (the `rows` method of `CudaStage`: its launch
//! arguments and how the rows are split); the backend compiles the hook's file in front of the kernel
//! ([`HookKernel::module`]) and plans the splits as the hook says. The visits the hook recorded come back
//! through the stage (its `visits` method), its counters through the layer's counter slots
//! (kernels/include/decide.cuh: blocks skipped, tiles visited, tiles). Nothing here names a policy.

use super::kernel_src::{file, KernelFile};
use super::launch::StructArg;

/// A traversal hook's kernel and the shape of the attention kernel it needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HookKernel {
    /// The stage's name in messages (e.g. "`art`").
    pub name: &'static str,
    /// The hook's kernel file (it defines `TRAVERSAL_HOOK`), declared in the stage's folder.
    pub file: &'static KernelFile,
    /// Warps per CTA and stages per warp the kernel runs with (a round of the warps is the hook's step),
    /// one CTA per KV head (the whole GQA group).
    pub warps: usize,
    pub stages: usize,
    /// Shared memory held back from the device's opt-in limit for the kernel's static arrays with the
    /// hook's (the kernel alone holds back 1 KiB); the stages' dynamic shared memory gets the rest.
    pub smem_reserve: usize,
    /// A define that measurement-only variants add (the compile check builds it too), if the hook has one.
    pub bench_define: Option<&'static str>,
}

impl HookKernel {
    /// The attention module with this hook: (its name, its files: the hook's, then the kernel's).
    pub fn module(&self) -> (String, [&'static KernelFile; 2]) {
        (format!("attention_mma+{}", self.file.name), [self.file, file("attention_mma.cu")])
    }
}

/// How the attention launch splits the rows a hook watches.
#[derive(Clone, Copy, Debug)]
pub(crate) enum HookSplits {
    /// Exactly (splits, keys per split), each a whole number of the hook's steps.
    Fixed(usize, usize),
    /// The attention's own split planning, at most one split per `smem_per_split` bytes of the kernel's
    /// dynamic shared memory (what the hook's decision over a whole row keeps per split).
    Planned { smem_per_split: usize },
}

/// One attention launch's hook: what the stage passes the kernel and how the launch splits the rows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TraversalLaunch {
    pub hook: HookKernel,
    /// The hook's launch arguments (the kernel's `TraversalArgs`, a `#[repr(C)]` struct of the hook's).
    pub args: StructArg,
    pub splits: HookSplits,
    /// Compile the measurement-only variant (`HookKernel::bench_define`).
    pub bench: bool,
}
