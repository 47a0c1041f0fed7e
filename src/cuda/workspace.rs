//! Device workspaces kept per stream: grown outside capture only, never freed while a graph may use them.
//!
//! A captured call cannot allocate, so its stream must already hold a large enough buffer. Serving
//! engines do not capture on the stream they run eagerly on: vLLM (and `torch.cuda.graph`) run an eager
//! warm-up call of each shape on the caller's stream, then capture the same call on a private stream. So
//! a capturing stream that holds no large enough buffer takes over the smallest one that is large enough
//! from another stream (that stream allocates anew at its next eager call); a buffer replaced by a larger
//! one is retired, not freed, since a graph captured earlier may still point at it.

use std::collections::HashMap;

use parking_lot::Mutex;

use super::context::{DevBuf, Gpu};
use super::driver::CUstream;
use crate::error::Result;
use crate::bail;

/// The device address of `stream`'s buffer of at least `need` bytes in `map` (keyed by stream handle),
/// allocated (rounded up to a power of two) or, under capture, taken over from another stream. `what`
/// names the workspace in the error when neither is possible.
pub(crate) fn for_stream(map: &mut HashMap<usize, DevBuf>, retired: &Mutex<Vec<DevBuf>>, gpu: &Gpu, stream: CUstream, need: usize, what: &str) -> Result<u64> {
    let key = stream as usize;
    if map.get(&key).map_or(true, |b| b.bytes < need) {
        let fresh = if gpu.is_capturing(stream)? {
            let donor = map.iter().filter(|(k, b)| **k != key && b.bytes >= need).min_by_key(|(_, b)| b.bytes).map(|(k, _)| *k);
            let Some(donor) = donor else {
                bail!(InvalidArgument, "this call needs {need} bytes of {what} workspace on a stream that is being captured, and no stream holds that much; run one eager call of the largest shape (on any stream of this engine) before capturing");
            };
            map.remove(&donor).expect("found above")
        } else {
            DevBuf::alloc(need.checked_next_power_of_two().unwrap_or(need))?
        };
        if let Some(old) = map.insert(key, fresh) {
            retired.lock().push(old);
        }
    }
    Ok(map.get(&key).expect("present above").ptr)
}
