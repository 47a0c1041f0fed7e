//! Run-time choice of the instruction set for CPU kernels: detected once, then a plain branch.

use once_cell::sync::Lazy;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IsaLevel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512F (with AVX2, FMA, F16C): the attention kernels in 16 lanes; everything else as [`IsaLevel::Avx2`].
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

static DETECTED: Lazy<IsaLevel> = Lazy::new(|| {
    // KVS_CPU_ISA=portable|avx2|avx512 caps the level (tests run every path on one machine);
    // KVS_CPU_PORTABLE=1 is the older spelling of `portable`.
    let cap = if std::env::var_os("KVS_CPU_PORTABLE").is_some() { Some("portable".to_string()) } else { std::env::var("KVS_CPU_ISA").ok() };
    #[cfg(target_arch = "x86_64")]
    {
        let cap = cap.as_deref().map(str::trim).map(str::to_ascii_lowercase);
        let allow = |level: &str| match cap.as_deref() {
            None | Some("") | Some("avx512") => true,
            Some("avx2") => level != "avx512",
            _ => false,
        };
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
        if avx2 && allow("avx512") && super::avx512::available() {
            return IsaLevel::Avx512;
        }
        if avx2 && allow("avx2") {
            return IsaLevel::Avx2;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = cap;
    IsaLevel::Portable
});

/// The level whose arithmetic the policies' decisions are defined in (Quest's page bounds, token weights,
/// ART's probe of the running output): [`detected`] capped at AVX2, so a decision does not move with the
/// host. ART's `tau` (1e-5 by default) is near f32 rounding: on the traces, 0.1% of its blocks changed
/// between the AVX2 and AVX-512 loops. The GPU's decisions are checked against this level.
pub fn decisions() -> IsaLevel {
    match detected() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx512 => IsaLevel::Avx2,
        l => l,
    }
}

/// The best instruction set this CPU offers, capped by `KVS_CPU_ISA` (`portable`, `avx2`, `avx512`;
/// `KVS_CPU_PORTABLE=1` = `portable`), for testing each path on one machine.
pub fn detected() -> IsaLevel {
    *DETECTED
}
