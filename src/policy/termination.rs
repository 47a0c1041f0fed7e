//! ART: adaptive termination of the block traversal.
//!
//! After each visited unit the running output of every query row of the GQA group is probed: a fixed
//! subset of output dimensions of `acc / l`. Between two consecutive probes `x_{t-1}, x_t`, a row is
//! *stable* when its scale change `‖x_t − x_{t−1}‖₂ < tau` and its direction change
//! `1 − cos(x_t, x_{t−1}) < phi`. The unit is stable when every row is; after `patience` consecutive
//! stable units the traversal stops. The first unit has nothing to compare with and is never stable.
//!
//! Probe (`probe=scattered`, the default): `PROBE_DIMS` dimensions `(7 + 37·k) mod head_dim`, k = 0..16.
//! 37 is prime and does not divide any supported head size, so the 16 dimensions are distinct and spread
//! over the whole vector (and over every 16-wide vector lane group a GPU warp would hold). `probe=full`
//! compares the whole vector. The CUDA kernel must use the same dimensions.

use super::spec::{Order, Probe};
use super::select::{Candidates, Unit};

pub const PROBE_DIMS: usize = 16;

/// The output dimensions ART compares.
pub fn probe_dims(dim: usize, probe: Probe) -> Vec<usize> {
    match probe {
        Probe::Full => (0..dim).collect(),
        Probe::Scattered => {
            let n = PROBE_DIMS.min(dim);
            (0..n).map(|k| (7 + 37 * k) % dim).collect()
        }
    }
}

/// Running state of one traversal.
#[derive(Clone, Debug, Default)]
pub struct ArtState {
    prev: Vec<f32>,
    have_prev: bool,
    stable_run: u32,
}

impl ArtState {
    pub fn reset(&mut self) {
        self.have_prev = false;
        self.stable_run = 0;
    }

    /// Feeds the probe of the current running outputs (`rows × probe_len`, rows with no weight yet as
    /// NaN); returns true when the traversal should stop.
    pub fn observe(&mut self, cur: &[f32], probe_len: usize, tau: f32, phi: f32, patience: Option<u32>) -> bool {
        let stable = self.have_prev && is_stable(&self.prev, cur, probe_len, tau, phi);
        self.prev.clear();
        self.prev.extend_from_slice(cur);
        self.have_prev = true;
        self.stable_run = if stable { self.stable_run + 1 } else { 0 };
        matches!(patience, Some(p) if self.stable_run >= p)
    }
}

/// Both criteria for every row (NaN anywhere, i.e. a row without weight, is not stable).
pub fn is_stable(prev: &[f32], cur: &[f32], probe_len: usize, tau: f32, phi: f32) -> bool {
    prev.chunks(probe_len).zip(cur.chunks(probe_len)).all(|(a, b)| {
        let (mut diff, mut aa, mut bb, mut ab) = (0f64, 0f64, 0f64, 0f64);
        for (&x, &y) in a.iter().zip(b) {
            let (x, y) = (x as f64, y as f64);
            diff += (y - x) * (y - x);
            aa += x * x;
            bb += y * y;
            ab += x * y;
        }
        let scale_ok = diff.sqrt() < tau as f64;
        let cos = if aa > 0.0 && bb > 0.0 { ab / (aa.sqrt() * bb.sqrt()) } else if aa == 0.0 && bb == 0.0 { 1.0 } else { 0.0 };
        scale_ok && (1.0 - cos) < phi as f64
    })
}

/// Visiting order: sink units first (in position order), then the newest unit (it holds the row's own key
/// and the freshest tokens: every selector keeps it, and Quest's bound often ranks it last, so under
/// `priority` ART used to stop before reaching it), then the most recent first (`recent`) or the highest
/// score first (`priority`; units without a score fall back to recency, after scored ones).
pub fn order_units(c: &Candidates, order: Order, out: &mut Vec<usize>) {
    out.clear();
    out.extend((0..c.units.len()).filter(|&i| c.units[i].sink));
    let newest = c.units.len().checked_sub(1).filter(|&i| !c.units[i].sink);
    out.extend(newest);
    let mut rest: Vec<usize> = (0..c.units.len()).filter(|&i| !c.units[i].sink && Some(i) != newest).collect();
    let start = |u: &Unit| c.spans[u.span_lo as usize].0;
    match order {
        Order::Recent => rest.sort_by(|&a, &b| start(&c.units[b]).cmp(&start(&c.units[a]))),
        Order::Priority => rest.sort_by(|&a, &b| {
            let (ua, ub) = (&c.units[a], &c.units[b]);
            let key = |u: &Unit| if u.score.is_nan() { f32::NEG_INFINITY } else { u.score };
            key(ub).total_cmp(&key(ua)).then(start(ub).cmp(&start(ua)))
        }),
    }
    out.extend(rest);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_dims_are_distinct() {
        for d in crate::config::SUPPORTED_HEAD_DIMS {
            let mut p = probe_dims(d, Probe::Scattered);
            assert_eq!(p.len(), 16);
            p.sort();
            p.dedup();
            assert_eq!(p.len(), 16, "head_dim {d}");
        }
        assert_eq!(probe_dims(64, Probe::Full).len(), 64);
    }

    #[test]
    fn stops_after_patience_stable_probes() {
        let mut s = ArtState::default();
        let x = [1.0f32, 2.0, 3.0];
        assert!(!s.observe(&x, 3, 1e-3, 1e-3, Some(2))); // nothing to compare with
        assert!(!s.observe(&x, 3, 1e-3, 1e-3, Some(2))); // stable 1
        assert!(s.observe(&x, 3, 1e-3, 1e-3, Some(2))); // stable 2 -> stop
        s.reset();
        for _ in 0..100 {
            assert!(!s.observe(&x, 3, 1e-3, 1e-3, None));
        }
        // A scale change resets the run.
        let mut s = ArtState::default();
        s.observe(&x, 3, 1e-3, 1e-3, Some(1));
        assert!(!s.observe(&[1.1, 2.0, 3.0], 3, 1e-3, 1e-3, Some(1)));
        assert!(!is_stable(&[1.0, 0.0], &[0.0, 1.0], 2, 10.0, 0.5)); // direction change
        assert!(!is_stable(&[f32::NAN, 0.0], &[f32::NAN, 0.0], 2, 10.0, 0.5));
    }

    #[test]
    fn order_puts_sinks_first() {
        let mut c = Candidates::default();
        c.from_spans(&[(0, 64)], 16, 1, |b| [0.0, 3.0, 1.0, 2.0][b]);
        let mut o = Vec::new();
        order_units(&c, Order::Recent, &mut o);
        assert_eq!(o, vec![0, 3, 2, 1]);
        order_units(&c, Order::Priority, &mut o);
        assert_eq!(o, vec![0, 3, 1, 2], "sink, newest (the row's own block), then by score");
        // A single unit that is a sink is not listed twice.
        c.from_spans(&[(0, 8)], 16, 1, |_| 1.0);
        order_units(&c, Order::Priority, &mut o);
        assert_eq!(o, vec![0]);
    }
}
