//! Acceptance metrics exactly as reference.md section 3 defines them.

use crate::error::VerifyError;
use crate::input::VerifyOutcome;

/// Accumulates verify steps `(k, num_accepted)`.
///
/// - AL (mean acceptance length) = tokens emitted per verify step, bonus included
///   = 1 + accepted / steps. [`Self::mean_accepted`] is AL - 1, which some engines report.
/// - Unconditional rate at slot i (1-based) = fraction of the steps that drafted slot i whose
///   accepted prefix reaches it (num_accepted >= i).
/// - Conditional rate at slot i = the same fraction among steps that drafted slot i and reached
///   slot i - 1 (num_accepted >= i - 1).
///
/// Steps with different k mix freely: a slot is counted only over the steps that drafted it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AcceptanceCounter {
    steps: u64,
    accepted: u64,
    drafted: u64,
    /// Index i - 1 for slot i: steps with k >= i.
    slot_drafted: Vec<u64>,
    /// Steps with k >= i and num_accepted >= i - 1.
    slot_offered: Vec<u64>,
    /// Steps with k >= i and num_accepted >= i.
    slot_accepted: Vec<u64>,
    /// Index a: steps that accepted exactly a drafts. Together with `slot_drafted` it lets
    /// counts from separate runs be merged exactly after serialisation.
    accepted_histogram: Vec<u64>,
}

impl AcceptanceCounter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one step that drafted `k` tokens and accepted `num_accepted` of them.
    pub fn record(&mut self, k: usize, num_accepted: usize) -> Result<(), VerifyError> {
        if num_accepted > k {
            return Err(VerifyError::AcceptedExceedsDrafted {
                accepted: num_accepted,
                drafts: k,
            });
        }
        if self.slot_drafted.len() < k {
            self.slot_drafted.resize(k, 0);
            self.slot_offered.resize(k, 0);
            self.slot_accepted.resize(k, 0);
        }
        if self.accepted_histogram.len() <= num_accepted {
            self.accepted_histogram.resize(num_accepted + 1, 0);
        }
        self.accepted_histogram[num_accepted] += 1;
        self.steps += 1;
        self.accepted += num_accepted as u64;
        self.drafted += k as u64;
        for slot in 0..k {
            self.slot_drafted[slot] += 1;
            // Slot `slot + 1` was offered when the prefix reached slot `slot`.
            if num_accepted >= slot {
                self.slot_offered[slot] += 1;
            }
            if num_accepted > slot {
                self.slot_accepted[slot] += 1;
            }
        }
        Ok(())
    }

    /// Records a step from its outcome; `k` is how many tokens were drafted.
    pub fn record_outcome(&mut self, k: usize, outcome: &VerifyOutcome) -> Result<(), VerifyError> {
        self.record(k, outcome.num_accepted)
    }

    /// Adds another counter's steps (e.g. per-request counters into a run total).
    pub fn merge(&mut self, other: &AcceptanceCounter) {
        let slots = self.slot_drafted.len().max(other.slot_drafted.len());
        for counts in [
            &mut self.slot_drafted,
            &mut self.slot_offered,
            &mut self.slot_accepted,
        ] {
            counts.resize(slots, 0);
        }
        for (mine, theirs) in [
            (&mut self.slot_drafted, &other.slot_drafted),
            (&mut self.slot_offered, &other.slot_offered),
            (&mut self.slot_accepted, &other.slot_accepted),
        ] {
            for (m, t) in mine.iter_mut().zip(theirs) {
                *m += t;
            }
        }
        if self.accepted_histogram.len() < other.accepted_histogram.len() {
            self.accepted_histogram
                .resize(other.accepted_histogram.len(), 0);
        }
        for (m, t) in self
            .accepted_histogram
            .iter_mut()
            .zip(&other.accepted_histogram)
        {
            *m += t;
        }
        self.steps += other.steps;
        self.accepted += other.accepted;
        self.drafted += other.drafted;
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Accepted draft tokens over all steps.
    pub fn accepted_tokens(&self) -> u64 {
        self.accepted
    }

    pub fn drafted_tokens(&self) -> u64 {
        self.drafted
    }

    /// Tokens emitted: accepted drafts plus one target token per step.
    pub fn emitted_tokens(&self) -> u64 {
        self.accepted + self.steps
    }

    /// AL = 1 + accepted / steps (bonus included); `None` before any step.
    pub fn mean_acceptance_length(&self) -> Option<f64> {
        self.mean_accepted().map(|accepted| 1.0 + accepted)
    }

    /// AL - 1: accepted drafts per step.
    pub fn mean_accepted(&self) -> Option<f64> {
        (self.steps > 0).then(|| self.accepted as f64 / self.steps as f64)
    }

    /// Index a: the number of steps that accepted exactly a drafts.
    pub fn accepted_histogram(&self) -> &[u64] {
        &self.accepted_histogram
    }

    /// Index i - 1: the number of steps that drafted slot i (k >= i). Steps may draft fewer than
    /// the configured k (an n-gram miss, the last step before max_new_tokens), so rates divide by
    /// this, not by the step count.
    pub fn slot_drafted_steps(&self) -> &[u64] {
        &self.slot_drafted
    }

    /// Per slot 1..=num_slots (index i - 1): steps that accepted slot i (serving counters).
    pub fn accepted_per_slot(&self) -> &[u64] {
        &self.slot_accepted
    }

    /// Number of slots seen (the largest k recorded).
    pub fn num_slots(&self) -> usize {
        self.slot_drafted.len()
    }

    /// Unconditional rate per slot 1..=num_slots (index i - 1). Every listed slot was drafted by
    /// at least one step, so each rate is defined.
    pub fn unconditional_rates(&self) -> Vec<f64> {
        self.slot_accepted
            .iter()
            .zip(&self.slot_drafted)
            .map(|(&a, &d)| a as f64 / d as f64)
            .collect()
    }

    /// Conditional rate per slot; `None` where no step that drafted the slot reached the slot
    /// before it.
    pub fn conditional_rates(&self) -> Vec<Option<f64>> {
        self.slot_accepted
            .iter()
            .zip(&self.slot_offered)
            .map(|(&a, &o)| (o > 0).then(|| a as f64 / o as f64))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_and_slot_counts_merge_exactly() {
        let mut a = AcceptanceCounter::new();
        a.record(3, 0).unwrap();
        a.record(3, 3).unwrap();
        let mut b = AcceptanceCounter::new();
        b.record(2, 1).unwrap();
        b.record(0, 0).unwrap();
        a.merge(&b);
        assert_eq!(a.accepted_histogram(), &[2, 1, 0, 1]);
        assert_eq!(a.slot_drafted_steps(), &[3, 3, 2]);
        // Slot i accepted iff a >= i: rates from the histogram equal the counter's own.
        let h = a.accepted_histogram();
        let from_hist: Vec<f64> = (0..3)
            .map(|slot| {
                h[slot + 1..].iter().sum::<u64>() as f64 / a.slot_drafted_steps()[slot] as f64
            })
            .collect();
        assert_eq!(from_hist, a.unconditional_rates());
    }
}
