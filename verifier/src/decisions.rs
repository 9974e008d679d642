//! The random decisions a rule makes, kept behind one small interface so the *same* rule code runs
//! in two ways: `verify` answers each decision with a uniform, and the exact enumerator answers it
//! with every possible branch in turn, weighted by that branch's probability. The exactness tests
//! therefore check the code the engine calls, not a re-derivation of it.

use std::collections::BTreeMap;

use crate::error::VerifyError;
use crate::uniform::UniformSource;

/// A distribution a rule wants a token drawn from.
pub(crate) enum Weights<'a> {
    /// A target row as the caller passed it; drawn with `specula_kernels::sampling::sample_from`,
    /// so a k = 0 step picks exactly the token plain sampling would pick from the same uniform.
    Row(&'a [f32]),
    /// A residual computed in f64. The rules only pass residuals with positive mass.
    Residual(&'a [f64]),
}

impl Weights<'_> {
    fn len(&self) -> usize {
        match self {
            Weights::Row(row) => row.len(),
            Weights::Residual(weights) => weights.len(),
        }
    }

    fn get(&self, index: usize) -> f64 {
        match self {
            Weights::Row(row) => row[index] as f64,
            Weights::Residual(weights) => weights[index],
        }
    }

    fn total(&self) -> f64 {
        (0..self.len()).map(|i| self.get(i)).sum()
    }
}

pub(crate) trait Decisions {
    /// True with probability `probability` (values outside [0, 1] act as clamped).
    fn accept(&mut self, probability: f64) -> Result<bool, VerifyError>;
    /// A token with probability proportional to its weight; never a zero-weight token.
    fn sample(&mut self, weights: Weights<'_>) -> Result<u32, VerifyError>;
}

/// Answers decisions from a uniform stream: accept iff u < probability (so probability 0 never
/// accepts and 1 always does), sample by inverse CDF.
pub(crate) struct UniformDecisions<'s> {
    pub source: &'s mut dyn UniformSource,
}

impl UniformDecisions<'_> {
    fn draw(&mut self) -> Result<f64, VerifyError> {
        let u = self.source.next_uniform();
        if (0.0..1.0).contains(&u) {
            Ok(u)
        } else {
            Err(VerifyError::BadUniform(u))
        }
    }
}

/// Inverse-CDF draw over f64 weights with the same conventions as `sample_from`: zero weights are
/// skipped and rounding at the top end falls back to the last index with mass.
fn sample_f64(weights: &[f64], u: f64) -> u32 {
    let total: f64 = weights.iter().sum();
    let target = u * total;
    let mut cumulative = 0f64;
    let mut last_nonzero = 0;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            cumulative += w;
            last_nonzero = i;
            if target < cumulative {
                return i as u32;
            }
        }
    }
    last_nonzero as u32
}

impl Decisions for UniformDecisions<'_> {
    fn accept(&mut self, probability: f64) -> Result<bool, VerifyError> {
        Ok(self.draw()? < probability)
    }

    fn sample(&mut self, weights: Weights<'_>) -> Result<u32, VerifyError> {
        let u = self.draw()?;
        Ok(match weights {
            Weights::Row(row) => specula_kernels::sampling::sample_from(row, u),
            Weights::Residual(w) => sample_f64(w, u),
        })
    }
}

/// One decision met while enumerating: its possible answers with their probabilities (only
/// answers with positive probability), and which answer the current path takes.
struct Branch {
    answers: Vec<(u32, f64)>,
    taken: usize,
}

/// Replays a fixed path of answers and extends it with the first answer of each new decision.
struct Replay<'p> {
    path: &'p mut Vec<Branch>,
    depth: usize,
}

impl Replay<'_> {
    fn answer(&mut self, answers: impl FnOnce() -> Vec<(u32, f64)>) -> u32 {
        if self.depth == self.path.len() {
            self.path.push(Branch {
                answers: answers(),
                taken: 0,
            });
        }
        let branch = &self.path[self.depth];
        self.depth += 1;
        branch.answers[branch.taken].0
    }
}

impl Decisions for Replay<'_> {
    fn accept(&mut self, probability: f64) -> Result<bool, VerifyError> {
        let p = probability.clamp(0.0, 1.0);
        let answer = self.answer(|| {
            [(1, p), (0, 1.0 - p)]
                .into_iter()
                .filter(|&(_, q)| q > 0.0)
                .collect()
        });
        Ok(answer == 1)
    }

    fn sample(&mut self, weights: Weights<'_>) -> Result<u32, VerifyError> {
        Ok(self.answer(|| {
            let total = weights.total();
            if total.is_nan() || total <= 0.0 {
                // Rules never sample a massless distribution; mirror `sample_f64`'s answer (index 0)
                // rather than leave the decision without answers.
                return vec![(0, 1.0)];
            }
            (0..weights.len())
                .filter(|&i| weights.get(i) > 0.0)
                .map(|i| (i as u32, weights.get(i) / total))
                .collect()
        }))
    }
}

/// Runs `rule` once per path through its decisions and returns every distinct outcome with its
/// exact probability. Sound because a rule is a deterministic function of its decisions.
pub(crate) fn enumerate_outcomes(
    mut rule: impl FnMut(&mut dyn Decisions) -> Result<crate::VerifyOutcome, VerifyError>,
) -> Result<Vec<(crate::VerifyOutcome, f64)>, VerifyError> {
    let mut outcomes: BTreeMap<crate::VerifyOutcome, f64> = BTreeMap::new();
    let mut path: Vec<Branch> = Vec::new();
    loop {
        let mut replay = Replay {
            path: &mut path,
            depth: 0,
        };
        let outcome = rule(&mut replay)?;
        let probability: f64 = path.iter().map(|b| b.answers[b.taken].1).product();
        *outcomes.entry(outcome).or_insert(0.0) += probability;
        // Next path: advance the deepest decision that has an untried answer, drop those below it.
        loop {
            match path.last_mut() {
                None => return Ok(outcomes.into_iter().collect()),
                Some(branch) if branch.taken + 1 < branch.answers.len() => {
                    branch.taken += 1;
                    break;
                }
                Some(_) => {
                    path.pop();
                }
            }
        }
    }
}
