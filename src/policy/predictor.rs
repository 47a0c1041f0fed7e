//! AttentionPredictor: per (sequence, layer, KV head) a history of block-pooled attention rows.

/// The history of one (sequence, layer, KV head).
#[derive(Clone, Debug, Default)]
pub struct PredictorHead {
    /// Rows of block scores, oldest first; row `i` has as many blocks as the sequence had then.
    pub rows: std::collections::VecDeque<Vec<f32>>,
    pub since_calib: usize,
}

impl PredictorHead {
    pub fn bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.rows.iter().map(|r| r.capacity() * 4 + 24).sum::<usize>()
    }
}
