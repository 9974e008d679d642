//! What a verify step receives and returns, and the validation every rule runs first.

use crate::error::{RowKind, VerifyError};

/// How far a row's sum may stray from 1. Processed f32 distributions are off by ~1e-7; anything
/// near this tolerance means the caller passed something else (logits, an unnormalised mask).
pub const NORMALISATION_TOLERANCE: f64 = 1e-3;

/// The draft distributions Q_1..Q_k.
#[derive(Debug, Clone, Copy)]
pub enum DraftProbs<'a> {
    /// The drafter has no distribution (n-gram, prompt lookup): Q_i is one-hot on x_i.
    OneHot,
    /// Q_i for every slot, over the full vocabulary, after the same temperature/top-k/top-p as P.
    Full(&'a [Vec<f32>]),
}

/// One verify step for one sequence.
///
/// All rows are *processed* distributions (the output of `specula_kernels::sampling::probabilities`
/// with the request's settings, applied identically to target and draft). Each row is read as its
/// entries divided by their f64 sum, so f32 rounding in the sum does not bias the rules.
#[derive(Debug, Clone, Copy)]
pub struct VerifyInput<'a> {
    /// x_1..x_k.
    pub draft_tokens: &'a [u32],
    /// Q_1..Q_k.
    pub draft_probs: DraftProbs<'a>,
    /// P_1..P_{k+1}: row i is the target's distribution for slot i+1 given the context and
    /// x_1..x_i; the last row is the distribution after all k drafts (the bonus slot).
    pub target_probs: &'a [Vec<f32>],
}

/// What a verify step emits: the accepted drafts followed by exactly one target token (the
/// correction at the first rejected slot, or the bonus after all k drafts).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VerifyOutcome {
    pub num_accepted: usize,
    /// `num_accepted + 1` tokens; `emitted[..num_accepted] == draft_tokens[..num_accepted]`.
    pub emitted: Vec<u32>,
}

impl VerifyOutcome {
    /// The token the target contributed (correction or bonus).
    pub fn target_token(&self) -> u32 {
        // `emitted` always holds num_accepted + 1 tokens; the fallback only guards hand-built values.
        self.emitted.last().copied().unwrap_or(0)
    }
}

/// A validated input: every index the rules use is in range, every probability is finite and
/// non-negative, and every row has positive mass, so the rules can index without checks.
pub(crate) struct CheckedInput<'a> {
    pub drafts: &'a [u32],
    target: &'a [Vec<f32>],
    target_scale: Vec<f64>,
    draft: CheckedDraft<'a>,
}

enum CheckedDraft<'a> {
    OneHot,
    Full {
        rows: &'a [Vec<f32>],
        scale: Vec<f64>,
    },
}

/// Checks one row and returns 1 / (its f64 sum).
fn check_row(kind: RowKind, row: usize, values: &[f32], vocab: usize) -> Result<f64, VerifyError> {
    if values.len() != vocab {
        return Err(VerifyError::RowLength {
            kind,
            row,
            len: values.len(),
            vocab,
        });
    }
    let mut sum = 0f64;
    for (index, &value) in values.iter().enumerate() {
        if !value.is_finite() || value < 0.0 {
            return Err(VerifyError::InvalidProbability {
                kind,
                row,
                index,
                value,
            });
        }
        sum += value as f64;
    }
    if (sum - 1.0).abs() > NORMALISATION_TOLERANCE {
        return Err(VerifyError::RowNotNormalised {
            kind,
            row,
            sum,
            tolerance: NORMALISATION_TOLERANCE,
        });
    }
    Ok(1.0 / sum)
}

impl<'a> CheckedInput<'a> {
    pub fn new(input: &VerifyInput<'a>) -> Result<Self, VerifyError> {
        let k = input.draft_tokens.len();
        if input.target_probs.len() != k + 1 {
            return Err(VerifyError::TargetRowCount {
                drafts: k,
                expected: k + 1,
                got: input.target_probs.len(),
            });
        }
        let vocab = input.target_probs[0].len();
        if vocab == 0 {
            return Err(VerifyError::EmptyVocabulary);
        }
        for (slot, &token) in input.draft_tokens.iter().enumerate() {
            if token as usize >= vocab {
                return Err(VerifyError::TokenOutOfVocabulary { slot, token, vocab });
            }
        }
        let target_scale = input
            .target_probs
            .iter()
            .enumerate()
            .map(|(row, values)| check_row(RowKind::Target, row, values, vocab))
            .collect::<Result<Vec<_>, _>>()?;
        let draft = match input.draft_probs {
            DraftProbs::OneHot => CheckedDraft::OneHot,
            DraftProbs::Full(rows) => {
                if rows.len() != k {
                    return Err(VerifyError::DraftRowCount {
                        drafts: k,
                        got: rows.len(),
                    });
                }
                let scale = rows
                    .iter()
                    .enumerate()
                    .map(|(row, values)| check_row(RowKind::Draft, row, values, vocab))
                    .collect::<Result<Vec<_>, _>>()?;
                for (slot, &token) in input.draft_tokens.iter().enumerate() {
                    if rows[slot][token as usize] == 0.0 {
                        return Err(VerifyError::ZeroDraftProbability { slot, token });
                    }
                }
                CheckedDraft::Full { rows, scale }
            }
        };
        Ok(CheckedInput {
            drafts: input.draft_tokens,
            target: input.target_probs,
            target_scale,
            draft,
        })
    }

    /// k, the number of drafts.
    pub fn k(&self) -> usize {
        self.drafts.len()
    }

    pub fn vocab(&self) -> usize {
        self.target[0].len()
    }

    /// The raw target row (sums to 1 within f32 rounding; positive mass guaranteed).
    pub fn target_row(&self, row: usize) -> &'a [f32] {
        &self.target[row]
    }

    /// P_{row+1}(token), normalised in f64.
    pub fn target_prob(&self, row: usize, token: usize) -> f64 {
        self.target[row][token] as f64 * self.target_scale[row]
    }

    /// Q_{row+1}(token), normalised in f64; one-hot drafters put all mass on the drafted token.
    pub fn draft_prob(&self, row: usize, token: usize) -> f64 {
        match &self.draft {
            CheckedDraft::OneHot => {
                if self.drafts[row] as usize == token {
                    1.0
                } else {
                    0.0
                }
            }
            CheckedDraft::Full { rows, scale } => rows[row][token] as f64 * scale[row],
        }
    }

    /// max(weight * P_{row+1} - Q_{row+1}, 0) over the vocabulary, with its total mass.
    pub fn residual(&self, row: usize, weight: f64) -> (Vec<f64>, f64) {
        let residual: Vec<f64> = (0..self.vocab())
            .map(|x| (weight * self.target_prob(row, x) - self.draft_prob(row, x)).max(0.0))
            .collect();
        let mass = residual.iter().sum();
        (residual, mass)
    }

    /// sum_x max(weight * P_{row+1}(x) - Q_{row+1}(x), 0) without allocating.
    pub fn residual_mass(&self, row: usize, weight: f64) -> f64 {
        (0..self.vocab())
            .map(|x| (weight * self.target_prob(row, x) - self.draft_prob(row, x)).max(0.0))
            .sum()
    }
}
