//! Run-time choice of the instruction set for CPU kernels: detected once, then a plain branch.

use once_cell::sync::Lazy;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IsaLevel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

static DETECTED: Lazy<IsaLevel> = Lazy::new(|| {
    #[cfg(target_arch = "x86_64")]
    {
        if std::env::var_os("KVS_CPU_PORTABLE").is_none()
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return IsaLevel::Avx2;
        }
    }
    IsaLevel::Portable
});

/// The best instruction set this CPU offers (`KVS_CPU_PORTABLE=1` forces the portable path, for testing).
pub fn detected() -> IsaLevel {
    *DETECTED
}
