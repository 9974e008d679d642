//! Logits processing (temperature, top-k, top-p) and sampling by inverse CDF from a uniform draw.
//!
//! The uniform comes from the caller (a per-request seeded generator) so that every path — plain
//! sampling, each acceptance rule, a GPU kernel with its own Philox stream — can be reproduced.

/// Per-request sampling settings. `temperature == 0` means greedy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest most-likely set whose mass reaches `top_p`; 1.0 disables.
    pub top_p: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams::greedy()
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature must be finite and >= 0, got {0}")]
    BadTemperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    BadTopP(f32),
    #[error("logit {index} is {value}: the model produced a non-finite value")]
    NonFiniteLogit { index: usize, value: f32 },
    #[error("empty logits")]
    Empty,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::BadTemperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::BadTopP(self.top_p));
        }
        Ok(())
    }
}

fn check_finite(logits: &[f32]) -> Result<(), SamplingError> {
    if logits.is_empty() {
        return Err(SamplingError::Empty);
    }
    // -inf is a legitimate mask; NaN and +inf are model failures.
    match logits
        .iter()
        .position(|v| v.is_nan() || *v == f32::INFINITY)
    {
        Some(index) => Err(SamplingError::NonFiniteLogit {
            index,
            value: logits[index],
        }),
        None => Ok(()),
    }
}

/// Index of the largest logit; the lowest index wins a tie, so greedy decoding is deterministic.
pub fn argmax(logits: &[f32]) -> Result<u32, SamplingError> {
    check_finite(logits)?;
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    Ok(best as u32)
}

/// The distribution the sampler draws from: softmax(logits / T) restricted by top-k then top-p and
/// renormalised (the order HF uses). Greedy gives a one-hot vector at the argmax.
pub fn probabilities(logits: &[f32], params: &SamplingParams) -> Result<Vec<f32>, SamplingError> {
    params.validate()?;
    check_finite(logits)?;
    let n = logits.len();
    let mut probs = vec![0f32; n];
    if params.is_greedy() {
        probs[argmax(logits)? as usize] = 1.0;
        return Ok(probs);
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return Err(SamplingError::NonFiniteLogit {
            index: 0,
            value: max,
        });
    }
    let inv_t = 1.0 / params.temperature as f64;
    // Accumulate in f64: vocabularies of 150k entries lose mass in f32 sums.
    let mut sum = 0f64;
    for (p, &l) in probs.iter_mut().zip(logits) {
        let e = ((l as f64 - max as f64) * inv_t).exp();
        *p = e as f32;
        sum += e;
    }
    let restrict = (params.top_k > 0 && params.top_k < n) || params.top_p < 1.0;
    if restrict {
        // Order by probability, ties by index, so the kept set is deterministic.
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.sort_unstable_by(|&a, &b| {
            probs[b as usize]
                .total_cmp(&probs[a as usize])
                .then(a.cmp(&b))
        });
        let mut keep = if params.top_k > 0 {
            params.top_k.min(n)
        } else {
            n
        };
        if params.top_p < 1.0 {
            let kept_mass: f64 = order[..keep]
                .iter()
                .map(|&i| probs[i as usize] as f64)
                .sum();
            let mut cum = 0f64;
            let mut k = 0;
            while k < keep {
                cum += probs[order[k] as usize] as f64;
                k += 1;
                if cum >= params.top_p as f64 * kept_mass {
                    break;
                }
            }
            keep = k.max(1);
        }
        for &i in &order[keep..] {
            probs[i as usize] = 0.0;
        }
        sum = order[..keep]
            .iter()
            .map(|&i| probs[i as usize] as f64)
            .sum();
    }
    let inv = 1.0 / sum;
    for p in probs.iter_mut() {
        *p = (*p as f64 * inv) as f32;
    }
    Ok(probs)
}

/// Inverse-CDF draw from `probs` with `u` uniform in [0, 1). Never returns a zero-probability index
/// (rounding at the top end falls back to the last index with mass).
pub fn sample_from(probs: &[f32], u: f64) -> u32 {
    let total: f64 = probs.iter().map(|&p| p as f64).sum();
    let target = u * total;
    let mut cum = 0f64;
    let mut last_nonzero = 0;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            cum += p as f64;
            last_nonzero = i;
            if target < cum {
                return i as u32;
            }
        }
    }
    last_nonzero as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_one_hot_at_first_max() {
        let p = probabilities(&[0.0, 3.0, 3.0, -1.0], &SamplingParams::greedy()).unwrap();
        assert_eq!(p, vec![0.0, 1.0, 0.0, 0.0]);
    }

    #[test]
    fn top_k_and_top_p_restrict_and_renormalise() {
        let logits: Vec<f32> = [0.5f32, 0.25, 0.15, 0.1].iter().map(|p| p.ln()).collect();
        let p = probabilities(
            &logits,
            &SamplingParams {
                temperature: 1.0,
                top_k: 2,
                top_p: 1.0,
            },
        )
        .unwrap();
        assert!((p[0] - 2.0 / 3.0).abs() < 1e-6 && (p[1] - 1.0 / 3.0).abs() < 1e-6 && p[2] == 0.0);
        let p = probabilities(
            &logits,
            &SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.7,
            },
        )
        .unwrap();
        assert!((p[0] - 0.5 / 0.75).abs() < 1e-6 && p[2] == 0.0 && p[3] == 0.0);
        let p = probabilities(
            &logits,
            &SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.1,
            },
        )
        .unwrap();
        assert_eq!(p, vec![1.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn bad_values_are_errors() {
        assert!(matches!(
            argmax(&[0.0, f32::NAN]),
            Err(SamplingError::NonFiniteLogit { index: 1, .. })
        ));
        assert!(probabilities(
            &[f32::INFINITY],
            &SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0
            }
        )
        .is_err());
        assert!(probabilities(
            &[0.0],
            &SamplingParams {
                temperature: -1.0,
                top_k: 0,
                top_p: 1.0
            }
        )
        .is_err());
        assert!(probabilities(
            &[0.0],
            &SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.0
            }
        )
        .is_err());
        assert!(argmax(&[]).is_err());
    }

    #[test]
    fn sample_never_picks_zero_mass() {
        let p = [0.0f32, 0.5, 0.0, 0.5, 0.0];
        for u in [0.0, 0.25, 0.5, 0.75, 0.999999999, 1.0] {
            let i = sample_from(&p, u) as usize;
            assert!(p[i] > 0.0);
        }
    }
}
