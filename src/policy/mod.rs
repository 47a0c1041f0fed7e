//! Decode policies: which KV blocks or tokens each decode row visits, in which order, and when it stops.
//! Policies decide; kernels compute. This module is only the dense pipeline for now.

use crate::error::Result;
use crate::bail;

/// A parsed policy spec. The empty spec and `dense` mean dense attention everywhere.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Policy {}

impl Policy {
    pub fn parse(spec: &str) -> Result<Self> {
        let s = spec.trim();
        if s.is_empty() || s == "dense" {
            return Ok(Policy {});
        }
        bail!(InvalidArgument, "policy spec {spec:?}: at position 0 expected `dense` (sparse policies are not built yet)")
    }

    /// True when no decode row of `layer` runs anything but dense attention.
    pub fn is_dense_for_layer(&self, _layer: usize) -> bool {
        true
    }
}

/// Per-sequence policy state (per layer and KV head inside).
#[derive(Default)]
pub struct SequencePolicyState {}

impl SequencePolicyState {
    pub fn bytes(&self) -> usize {
        0
    }
}
