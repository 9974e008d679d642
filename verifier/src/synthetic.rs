//! Synthetic acceptance: a configured acceptance pattern instead of the target's judgement, so a
//! speed measurement can be pinned to a published acceptance length (e.g. DSpark's 3.78 at 7
//! drafts). Outputs are *not* the target's distribution and must be labelled synthetic.

use crate::error::VerifyError;

/// Per-slot acceptance probabilities for k draft slots.
///
/// Stored as *conditional* rates c_1..c_k (c_i = P(slot i accepted | slots < i accepted)), which
/// is what a verify step draws against; the *unconditional* rates r_i = c_1 * .. * c_i are the
/// fraction of steps whose accepted prefix reaches slot i.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticAcceptance {
    conditional: Vec<f64>,
}

fn check_rate(slot: usize, value: f64) -> Result<(), VerifyError> {
    if value.is_finite() && (0.0..=1.0).contains(&value) {
        Ok(())
    } else {
        Err(VerifyError::InvalidRate { slot, value })
    }
}

impl SyntheticAcceptance {
    /// The minimum-variance pattern with mean acceptance length `length` (bonus included) over
    /// `k` slots: n = length - 1, f = floor(n), unconditional rates `[1]*f + [n - f] + [0]*(k-f-1)`.
    /// Every step accepts f or f + 1 drafts. `length` must be in [1, k + 1].
    pub fn from_mean_length(length: f64, k: usize) -> Result<Self, VerifyError> {
        let max = k + 1;
        if !(length.is_finite() && length >= 1.0 && length <= max as f64) {
            return Err(VerifyError::InvalidMeanLength { length, k, max });
        }
        let accepted = length - 1.0;
        let full = accepted.floor() as usize;
        let mut unconditional = vec![0.0; k];
        for (slot, rate) in unconditional.iter_mut().enumerate() {
            *rate = match slot.cmp(&full) {
                std::cmp::Ordering::Less => 1.0,
                std::cmp::Ordering::Equal => accepted - full as f64,
                std::cmp::Ordering::Greater => 0.0,
            };
        }
        Self::from_unconditional_rates(&unconditional)
    }

    /// From unconditional rates r_1..r_k (the fraction of steps reaching each slot): each in
    /// [0, 1] and non-increasing, since reaching slot i requires reaching slot i - 1.
    pub fn from_unconditional_rates(rates: &[f64]) -> Result<Self, VerifyError> {
        let mut previous = 1.0;
        let mut conditional = Vec::with_capacity(rates.len());
        for (slot, &rate) in rates.iter().enumerate() {
            check_rate(slot, rate)?;
            if rate > previous {
                return Err(VerifyError::IncreasingRates {
                    slot,
                    previous,
                    value: rate,
                });
            }
            // A slot after an unreachable one is unreachable too; its conditional rate is moot, 0.
            conditional.push(if previous > 0.0 { rate / previous } else { 0.0 });
            previous = rate;
        }
        Ok(SyntheticAcceptance { conditional })
    }

    /// From conditional rates c_1..c_k, each in [0, 1].
    pub fn from_conditional_rates(rates: &[f64]) -> Result<Self, VerifyError> {
        for (slot, &rate) in rates.iter().enumerate() {
            check_rate(slot, rate)?;
        }
        Ok(SyntheticAcceptance {
            conditional: rates.to_vec(),
        })
    }

    /// The number of slots configured.
    pub fn num_slots(&self) -> usize {
        self.conditional.len()
    }

    pub fn conditional_rates(&self) -> &[f64] {
        &self.conditional
    }

    pub fn unconditional_rates(&self) -> Vec<f64> {
        let mut reach = 1.0;
        self.conditional
            .iter()
            .map(|&c| {
                reach *= c;
                reach
            })
            .collect()
    }

    /// Mean acceptance length (bonus included) when every step drafts all configured slots.
    pub fn expected_length(&self) -> f64 {
        1.0 + self.unconditional_rates().iter().sum::<f64>()
    }
}
