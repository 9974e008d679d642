//! A drafting temperature apart from the target's, for any drafter.
//!
//! Why: for sampled requests the standard rule accepts a draft token x with min(1, p(x)/q(x)) and is
//! lossless for *any* draft distribution q, as long as q is the distribution the token was drawn
//! from. Drafting from q exactly as the target samples (softmax(logits / T)) is the default, but it is
//! not always the q with the highest acceptance: a parallel block drafter (DSpark) predicts later
//! slots without seeing the tokens it sampled earlier in the block, and a flatter q there spreads
//! mass over continuations that contradict one another. Sharpening q (a lower drafting temperature)
//! trades some acceptance at the first slot for more coherent blocks. This wrapper makes that a
//! measured setting instead of a guess, for every drafter alike, so comparisons stay fair. Measured on
//! the embedded pair at T=1 (experiments/results/NOTES.md v0.5b): q at the request's own temperature
//! was best for both DSpark and the draft model (0.5, 0.7, 1.15, 1.3 all lower).
//!
//! Greedy requests are left alone (temperature 0 stays 0). With drafting temperature 0 a sampled
//! request gets greedy drafts: q is one-hot on the proposed token (the verifier's `OneHot` case when
//! a drafter returns no distributions).

use crate::{DraftError, DraftProposal, DraftRequest, Drafter, SeqKey};

/// Wraps a drafter so that sampled requests are drafted at `temperature` (top-k / top-p as the
/// request's). Everything else is forwarded unchanged.
pub struct DraftTemperature {
    inner: Box<dyn Drafter>,
    temperature: f32,
    name: String,
}

impl DraftTemperature {
    /// Fails on a temperature that is negative or not finite.
    pub fn new(inner: Box<dyn Drafter>, temperature: f32) -> Result<Self, DraftError> {
        if !temperature.is_finite() || temperature < 0.0 {
            return Err(DraftError::Config(format!(
                "draft_temperature must be finite and >= 0, got {temperature}"
            )));
        }
        let name = format!("{}@draft_t{temperature}", inner.name());
        Ok(DraftTemperature {
            inner,
            temperature,
            name,
        })
    }

    pub fn temperature(&self) -> f32 {
        self.temperature
    }
}

impl Drafter for DraftTemperature {
    fn name(&self) -> &str {
        &self.name
    }

    fn add_sequence(&mut self, seq: SeqKey, tokens: &[u32]) -> Result<(), DraftError> {
        self.inner.add_sequence(seq, tokens)
    }

    fn remove_sequence(&mut self, seq: SeqKey) -> Result<(), DraftError> {
        self.inner.remove_sequence(seq)
    }

    fn propose(
        &mut self,
        requests: &mut [DraftRequest<'_>],
    ) -> Result<Vec<DraftProposal>, DraftError> {
        for r in requests.iter_mut() {
            if !r.sampling.is_greedy() {
                r.sampling.temperature = self.temperature;
            }
        }
        self.inner.propose(requests)
    }

    fn commit(&mut self, seq: SeqKey, tokens: &[u32]) -> Result<(), DraftError> {
        self.inner.commit(seq, tokens)
    }

    fn tapped_target_layers(&self) -> &[usize] {
        self.inner.tapped_target_layers()
    }

    fn append_target_features(
        &mut self,
        seq: SeqKey,
        start: usize,
        features: &[f32],
    ) -> Result<(), DraftError> {
        self.inner.append_target_features(seq, start, features)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use specula_kernels::sampling::SamplingParams;
    use specula_verifier::UniformSource;

    /// Proposes nothing; the test looks at the requests it was handed.
    struct Inert;
    impl Drafter for Inert {
        fn name(&self) -> &str {
            "inert"
        }
        fn add_sequence(&mut self, _: SeqKey, _: &[u32]) -> Result<(), DraftError> {
            Ok(())
        }
        fn remove_sequence(&mut self, _: SeqKey) -> Result<(), DraftError> {
            Ok(())
        }
        fn propose(
            &mut self,
            requests: &mut [DraftRequest<'_>],
        ) -> Result<Vec<DraftProposal>, DraftError> {
            Ok(vec![DraftProposal::default(); requests.len()])
        }
        fn commit(&mut self, _: SeqKey, _: &[u32]) -> Result<(), DraftError> {
            Ok(())
        }
    }
    struct Half;
    impl UniformSource for Half {
        fn next_uniform(&mut self) -> f64 {
            0.5
        }
    }

    #[test]
    fn sampled_requests_draft_at_the_set_temperature_greedy_ones_stay_greedy() {
        let mut d = DraftTemperature::new(Box::new(Inert), 0.5).unwrap();
        assert_eq!(d.name(), "inert@draft_t0.5");
        let sampled = SamplingParams {
            temperature: 1.0,
            top_k: 7,
            top_p: 0.9,
        };
        let (mut u1, mut u2) = (Half, Half);
        let mut reqs = [
            DraftRequest {
                seq: 0,
                max_tokens: 3,
                sampling: sampled,
                vocab_limit: 10,
                uniforms: &mut u1,
            },
            DraftRequest {
                seq: 1,
                max_tokens: 3,
                sampling: SamplingParams::greedy(),
                vocab_limit: 10,
                uniforms: &mut u2,
            },
        ];
        d.propose(&mut reqs).unwrap();
        // The requests are rewritten in place before the inner drafter sees them.
        assert_eq!(reqs[0].sampling.temperature, 0.5);
        assert_eq!((reqs[0].sampling.top_k, reqs[0].sampling.top_p), (7, 0.9));
        assert!(reqs[1].sampling.is_greedy());
    }

    #[test]
    fn bad_temperatures_are_refused() {
        for t in [-0.1, f32::NAN, f32::INFINITY] {
            assert!(DraftTemperature::new(Box::new(Inert), t).is_err());
        }
        assert!(DraftTemperature::new(Box::new(Inert), 0.0).is_ok());
    }
}
