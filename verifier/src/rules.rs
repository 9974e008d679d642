//! The acceptance rules (reference.md section 2), each a pure CPU reference.
//!
//! Notation as in the reference: drafts x_1..x_k, target rows P_1..P_{k+1}, draft rows Q_1..Q_k.
//! In code, slot i (1-based) lives at index i - 1 of every slice.

use crate::decisions::{enumerate_outcomes, Decisions, UniformDecisions, Weights};
use crate::error::VerifyError;
use crate::input::{CheckedInput, VerifyInput, VerifyOutcome};
use crate::synthetic::SyntheticAcceptance;
use crate::uniform::UniformSource;

/// How a verify step decides which drafts to keep.
#[derive(Debug, Clone, PartialEq)]
pub enum AcceptanceRule {
    /// Accept while the draft equals argmax P_i; lossless for greedy decoding. Uses no uniforms.
    Greedy,
    /// Leviathan et al. / Chen et al. token-by-token rejection sampling.
    Standard,
    /// Block verification (Sun et al. 2024, Algorithm 2): judges the draft block jointly and
    /// accepts at least as many tokens as `Standard` in expectation.
    Block,
    /// Configured acceptance regardless of P and Q; for speed measurements only, not lossless.
    Synthetic(SyntheticAcceptance),
}

impl AcceptanceRule {
    /// Runs the rule on one step, drawing uniforms from `uniforms`.
    ///
    /// Uniform consumption (for reproducing a run elsewhere): `Greedy` none; `Standard` one per
    /// examined slot (up to and including the first rejection) plus one for the emitted target
    /// token; `Block` exactly k (u_1..u_k) plus one; `Synthetic` like `Standard`.
    pub fn verify(
        &self,
        input: &VerifyInput,
        uniforms: &mut dyn UniformSource,
    ) -> Result<VerifyOutcome, VerifyError> {
        let checked = CheckedInput::new(input)?;
        let mut decisions = UniformDecisions { source: uniforms };
        self.run(&checked, &mut decisions)
    }

    /// The exact distribution of `verify`'s outcome for these drafts: every possible outcome with
    /// its probability (summing to 1), found by running the same rule code down every branch of
    /// its random decisions. Cost grows like V * 2^k for `Block` and V * k for the others, each
    /// path costing one rule run, so this is for analysis and tests on small vocabularies.
    pub fn outcome_distribution(
        &self,
        input: &VerifyInput,
    ) -> Result<Vec<(VerifyOutcome, f64)>, VerifyError> {
        let checked = CheckedInput::new(input)?;
        enumerate_outcomes(|decisions| self.run(&checked, decisions))
    }

    /// Whether the emitted tokens follow the target's distribution (for `Greedy`: reproduce greedy
    /// decoding of the target).
    pub fn is_lossless(&self) -> bool {
        !matches!(self, AcceptanceRule::Synthetic(_))
    }

    pub fn name(&self) -> &str {
        match self {
            AcceptanceRule::Greedy => "greedy",
            AcceptanceRule::Standard => "standard",
            AcceptanceRule::Block => "block",
            AcceptanceRule::Synthetic(_) => "synthetic",
        }
    }

    fn run(
        &self,
        input: &CheckedInput,
        decisions: &mut dyn Decisions,
    ) -> Result<VerifyOutcome, VerifyError> {
        let (num_accepted, target_token) = match self {
            AcceptanceRule::Greedy => greedy(input),
            AcceptanceRule::Standard => standard(input, decisions)?,
            AcceptanceRule::Block => block(input, decisions)?,
            AcceptanceRule::Synthetic(config) => synthetic(config, input, decisions)?,
        };
        let mut emitted = Vec::with_capacity(num_accepted + 1);
        emitted.extend_from_slice(&input.drafts[..num_accepted]);
        emitted.push(target_token);
        Ok(VerifyOutcome {
            num_accepted,
            emitted,
        })
    }
}

/// Lowest index among the largest entries, so ties resolve the way `sampling::argmax` does.
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Returns (accepted, target token).
fn greedy(input: &CheckedInput) -> (usize, u32) {
    for (slot, &token) in input.drafts.iter().enumerate() {
        let best = argmax(input.target_row(slot));
        if token != best {
            return (slot, best);
        }
    }
    (input.k(), argmax(input.target_row(input.k())))
}

/// Draws from the residual max(weight * P_{row+1} - Q_{row+1}, 0), or from P_{row+1} itself when
/// the residual has no mass. With exact arithmetic a rule never reaches an empty residual (the
/// rejection that leads there has probability equal to its mass), so the fallback only absorbs
/// rounding when P and Q (nearly) coincide, and P is the distribution the step must follow there.
fn sample_residual(
    input: &CheckedInput,
    decisions: &mut dyn Decisions,
    row: usize,
    weight: f64,
) -> Result<u32, VerifyError> {
    let (residual, mass) = input.residual(row, weight);
    if mass > 0.0 {
        decisions.sample(Weights::Residual(&residual))
    } else {
        decisions.sample(Weights::Row(input.target_row(row)))
    }
}

/// Accept x_i with probability min(1, P_i(x_i) / Q_i(x_i)); on the first rejection draw from
/// norm(max(P_i - Q_i, 0)); after k acceptances draw the bonus from P_{k+1}. With a one-hot Q this
/// is "accept with P_i(x_i), else draw from P_i without x_i".
fn standard(
    input: &CheckedInput,
    decisions: &mut dyn Decisions,
) -> Result<(usize, u32), VerifyError> {
    for (slot, &token) in input.drafts.iter().enumerate() {
        let x = token as usize;
        // Validation guarantees Q_i(x_i) > 0.
        let ratio = input.target_prob(slot, x) / input.draft_prob(slot, x);
        if !decisions.accept(ratio.min(1.0))? {
            return Ok((slot, sample_residual(input, decisions, slot, 1.0)?));
        }
    }
    let bonus = decisions.sample(Weights::Row(input.target_row(input.k())))?;
    Ok((input.k(), bonus))
}

/// The stopping probabilities h_1..h_k of block verification (1-based slot i at index i - 1)
/// and the weights p_0..p_k.
///
/// p_0 = 1, p_i = min(1, p_{i-1} P_i(x_i) / Q_i(x_i));
/// h_i = Z_i / (Z_i + 1 - p_i) with Z_i = sum_x max(p_i P_{i+1}(x) - Q_{i+1}(x), 0) for i < k;
/// h_k = p_k.
///
/// 0/0 (Z_i = 0 and p_i = 1) gives h_i = 0. Why that is safe: p_i = 1 and Z_i = 0 force
/// P_{i+1} = Q_{i+1}, so x_{i+1} (drawn from Q_{i+1}) has ratio 1 and p_{i+1} = 1; repeating the
/// argument, some later slot j has h_j = 1 (Z_j > 0 with p_j = 1, or j = k with h_k = p_k = 1),
/// so tau > i whatever h_i is. Choosing 0 also means "never stop where the residual is empty".
fn block_weights(input: &CheckedInput) -> (Vec<f64>, Vec<f64>) {
    let k = input.k();
    let mut weights = Vec::with_capacity(k + 1);
    weights.push(1.0);
    for (slot, &token) in input.drafts.iter().enumerate() {
        let x = token as usize;
        let ratio = input.target_prob(slot, x) / input.draft_prob(slot, x);
        weights.push((weights[slot] * ratio).min(1.0));
    }
    let stop = (1..=k)
        .map(|i| {
            let p_i = weights[i];
            if i == k {
                return p_i;
            }
            // Row i holds P_{i+1} and Q_{i+1}.
            let z = input.residual_mass(i, p_i);
            let denominator = z + (1.0 - p_i);
            if denominator > 0.0 {
                z / denominator
            } else {
                0.0
            }
        })
        .collect();
    (weights, stop)
}

/// Draw u_1..u_k, tau = the largest i with u_i < h_i (0 if none); emit x_1..x_tau, then the bonus
/// from P_{k+1} if tau = k, else a draw from norm(max(p_tau P_{tau+1} - Q_{tau+1}, 0)).
///
/// The reference writes u_i <= h_i; for continuous uniforms that is the same distribution, and the
/// strict comparison guarantees a slot with h_i = 0 is never chosen.
fn block(input: &CheckedInput, decisions: &mut dyn Decisions) -> Result<(usize, u32), VerifyError> {
    let k = input.k();
    let (weights, stop) = block_weights(input);
    let mut tau = 0;
    for (slot, &h) in stop.iter().enumerate() {
        // All k uniforms are drawn, as in Algorithm 2, so consumption does not depend on outcomes.
        if decisions.accept(h)? {
            tau = slot + 1;
        }
    }
    let token = if tau == k {
        decisions.sample(Weights::Row(input.target_row(k)))?
    } else {
        sample_residual(input, decisions, tau, weights[tau])?
    };
    Ok((tau, token))
}

/// Accept slot i with its configured conditional rate, whatever P and Q say; at the first
/// rejection emit a draw from P_i (the target's own token there), else the bonus from P_{k+1}.
fn synthetic(
    config: &SyntheticAcceptance,
    input: &CheckedInput,
    decisions: &mut dyn Decisions,
) -> Result<(usize, u32), VerifyError> {
    let rates = config.conditional_rates();
    if input.k() > rates.len() {
        return Err(VerifyError::TooFewSyntheticRates {
            configured: rates.len(),
            drafts: input.k(),
        });
    }
    for (slot, &rate) in rates[..input.k()].iter().enumerate() {
        if !decisions.accept(rate)? {
            let token = decisions.sample(Weights::Row(input.target_row(slot)))?;
            return Ok((slot, token));
        }
    }
    let bonus = decisions.sample(Weights::Row(input.target_row(input.k())))?;
    Ok((input.k(), bonus))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::DraftProbs;

    /// Rejects every draft and answers samples with a fixed uniform, to reach paths that have
    /// probability 0 under exact arithmetic (the empty-residual fallback).
    struct RejectEverything {
        u: f64,
    }

    impl Decisions for RejectEverything {
        fn accept(&mut self, _probability: f64) -> Result<bool, VerifyError> {
            Ok(false)
        }
        fn sample(&mut self, weights: Weights<'_>) -> Result<u32, VerifyError> {
            let mut source = crate::ScriptedUniforms::new(vec![self.u]);
            UniformDecisions {
                source: &mut source,
            }
            .sample(weights)
        }
    }

    #[test]
    fn empty_residual_falls_back_to_the_target_row() {
        // P == Q, so max(P - Q, 0) is all zero; a forced rejection must still emit a token the
        // target can produce, drawn from P.
        let p = vec![0.0f32, 0.25, 0.0, 0.75];
        let targets = vec![p.clone(), p.clone()];
        let drafts_q = vec![p.clone()];
        let input = VerifyInput {
            draft_tokens: &[3],
            draft_probs: DraftProbs::Full(&drafts_q),
            target_probs: &targets,
        };
        let checked = CheckedInput::new(&input).unwrap();
        assert_eq!(checked.residual(0, 1.0).1, 0.0);
        for rule in [AcceptanceRule::Standard, AcceptanceRule::Block] {
            for (u, expected) in [(0.0, 1), (0.2, 1), (0.3, 3), (0.999, 3)] {
                let outcome = rule.run(&checked, &mut RejectEverything { u }).unwrap();
                assert_eq!(outcome.num_accepted, 0, "{}", rule.name());
                assert_eq!(outcome.emitted, vec![expected], "{} u={u}", rule.name());
            }
        }
        // One-hot Q on a target that is certain of the drafted token: residual is empty too.
        let certain = vec![vec![0.0f32, 1.0, 0.0], vec![0.5, 0.5, 0.0]];
        let input = VerifyInput {
            draft_tokens: &[1],
            draft_probs: DraftProbs::OneHot,
            target_probs: &certain,
        };
        let checked = CheckedInput::new(&input).unwrap();
        let outcome = AcceptanceRule::Standard
            .run(&checked, &mut RejectEverything { u: 0.7 })
            .unwrap();
        assert_eq!(outcome.emitted, vec![1]);
    }

    #[test]
    fn block_zero_over_zero_stops_nowhere() {
        // P_1 = Q_1 and P_2 = Q_2: p_1 = 1 and Z_1 = 0, the 0/0 case; h_1 must be 0 and h_2 = 1.
        let p = vec![0.5f32, 0.5];
        let rows = vec![p.clone(), p.clone(), p.clone()];
        let q = vec![p.clone(), p.clone()];
        let input = VerifyInput {
            draft_tokens: &[0, 1],
            draft_probs: DraftProbs::Full(&q),
            target_probs: &rows,
        };
        let checked = CheckedInput::new(&input).unwrap();
        let (weights, stop) = block_weights(&checked);
        assert_eq!(weights, vec![1.0, 1.0, 1.0]);
        assert_eq!(stop, vec![0.0, 1.0]);
    }
}
