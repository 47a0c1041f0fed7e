//! The CUDA backend as the engine sees it ([`Backend`]): what an engine call adds around
//! [`CudaBackend`]'s launches (the host-known refusals, `validate = sync`'s counter read-back, visit
//! records, the device's share of the statistics).

use std::ffi::c_void;

use super::stage::CudaPipeline;
use super::CudaBackend;
use crate::args::{CacheWriteArgs, ForwardArgs, MergeArgs};
use crate::backend::{Backend, CallEnv};
use crate::config::EngineConfig;
use crate::meta::MetaSnapshot;
use crate::error::Result;
use crate::layout::KvCache;
use crate::policy::Policy;
use crate::stats::{Counters, EngineStats};
use crate::{bail, ensure};

/// The CUDA backend of device `ordinal` for the parsed `policy` (its key metadata, state slots and weights).
pub fn new(cfg: &EngineConfig, ordinal: i32, policy: &Policy) -> Result<CudaBackend> {
    let mut b = CudaBackend::new(cfg, ordinal, policy.device_meta_needs(), policy.device_slots(), policy.stage_counters())?;
    b.set_policy_device(policy.cuda_device(cfg)?);
    Ok(b)
}

impl Backend for CudaBackend {
    fn forward(&self, env: &CallEnv, a: &ForwardArgs, cache: &KvCache) -> Result<(Counters, Counters)> {
        let (cfg, pipeline) = (env.cfg, env.pipeline);
        // A host-set policy input the device path does not read is refused (the selector says which).
        if pipeline.is_some() && env.policy_input.read().is_some() {
            env.policy.check_input_on_device()?;
        }
        // Host-known, so it fails at the call as on the CPU engine.
        ensure!(
            a.seq_ids.is_some() || pipeline.is_none() || !env.policy.is_stateful(),
            InvalidArgument,
            "policy {:?} keeps per-sequence state, so seq_ids is required",
            cfg.policy
        );
        // validate = sync: the call waits anyway, so its counters are read back from the device
        // (the difference of the layer's device counters across the call).
        let before = if self.validates_sync() {
            super::checks::refuse_sync_in_capture(&self.gpu, a.stream)?;
            Some(self.device_counters()?)
        } else {
            None
        };
        let c = CudaBackend::forward(self, cfg, a, cache, pipeline.map(|p| p as &dyn CudaPipeline))?;
        if let (Some(_), Some(dst)) = (pipeline, env.visits.lock().as_mut()) {
            dst.extend(self.visit_records(cfg, a)?);
        }
        let call = match before {
            Some(b) => {
                let mut d = self.device_counters()?[a.layer].since(&b[a.layer]);
                d.add(&c);
                d
            }
            None => c,
        };
        Ok((c, call))
    }

    fn cache_write(&self, cfg: &EngineConfig, a: &CacheWriteArgs, cache: &KvCache, n: usize) -> Result<()> {
        CudaBackend::cache_write(self, cfg, a, cache, n)
    }

    fn merge(&self, a: &MergeArgs) -> Result<()> {
        CudaBackend::merge(self, a)
    }

    fn check(&self, stream: *mut c_void) -> Result<()> {
        match self.checks.take(&self.gpu, stream)? {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn metadata_bytes(&self) -> usize {
        self.meta.bytes()
    }

    /// Downloaded from the device (synchronizes).
    fn metadata_snapshot(&self, layer: usize) -> Result<Option<MetaSnapshot>> {
        self.gpu.synchronize()?;
        self.meta.layer(layer).as_ref().map(|m| m.download()).transpose()
    }

    /// A CUDA engine registers ids on the device (its policy's state slots, or a plain id registry of
    /// [`super::backend::ID_REGISTRY_SEQS`] live ids); releasing synchronizes the device.
    fn release_sequence(&self, seq_id: u64) -> Result<()> {
        match self.id_map() {
            Some(s) => s.release(&self.gpu, seq_id),
            None => bail!(Internal, "the CUDA engine has no sequence id map"),
        }
    }

    /// Synchronizes the device to read the policy counters kept there; if that fails the device part is
    /// left out.
    fn stats(&self, host: (Counters, Vec<Counters>)) -> EngineStats {
        let mut st = host;
        if let Ok(dev) = self.device_counters() {
            for (l, c) in dev.iter().enumerate() {
                st.0.add(c);
                st.1[l].add(c);
            }
        }
        let (mut created, mut released, mut live, mut without_state) = (0, 0, 0, 0);
        // Sequence ids are registered on the device (slots.rs); only a policy's state slots leave rows
        // without state.
        if let Some((counts, life)) = self.id_map().and_then(|s| Some((s.read_counts(&self.gpu).ok()?, s.lifecycle(&self.gpu).ok()?))) {
            live = counts.1;
            (created, released) = life;
            without_state = if self.slots.is_some() { counts.0 } else { 0 };
        }
        let pending_status = self.checks.peek().ok().flatten().map_or(0, |e| e.kind.status_code() as u64);
        EngineStats { total: st.0, per_layer: st.1, live_sequences: live, policy_rows_without_state: without_state, sequences_created: created, sequences_released: released, state_bytes: 0, pending_status }
    }

    /// Per-sequence state lives on the device, in slots (not counted as objects).
    fn policy_state_objects(&self) -> u64 {
        0
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
