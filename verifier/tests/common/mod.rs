//! Helpers shared by the integration tests: random context-dependent language models over tiny
//! vocabularies, exact joint distributions, and a chi-square p-value.
#![allow(dead_code)]

use std::collections::HashMap;

use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// The probability the rules read from a row: its entries over their f64 sum.
pub fn normalised(row: &[f32]) -> Vec<f64> {
    let sum: f64 = row.iter().map(|&v| v as f64).sum();
    row.iter().map(|&v| v as f64 / sum).collect()
}

/// How a random row is shaped; mixing shapes exercises the rules' corner cases.
#[derive(Clone, Copy, Debug)]
pub enum RowShape {
    /// Every entry positive.
    Dense,
    /// Some entries exactly zero (as after top-k / top-p).
    Sparse,
    /// All mass on one token (greedy target, deterministic drafter).
    OneHot,
}

pub fn random_row(rng: &mut ChaCha8Rng, vocab: usize, shape: RowShape) -> Vec<f32> {
    let mut row: Vec<f32> = match shape {
        RowShape::Dense => (0..vocab).map(|_| rng.random_range(0.05f32..1.0)).collect(),
        RowShape::Sparse => (0..vocab)
            .map(|_| {
                if rng.random_bool(0.4) {
                    0.0
                } else {
                    rng.random_range(0.05f32..1.0)
                }
            })
            .collect(),
        RowShape::OneHot => vec![0.0; vocab],
    };
    if row.iter().all(|&v| v == 0.0) {
        row[rng.random_range(0..vocab)] = 1.0;
    }
    let sum: f32 = row.iter().sum();
    row.iter().map(|v| v / sum).collect()
}

/// A language model over a fixed context: one next-token row per prefix of length 0..=depth.
#[derive(Clone, Debug)]
pub struct TableModel {
    pub vocab: usize,
    pub depth: usize,
    pub rows: HashMap<Vec<u32>, Vec<f32>>,
}

fn all_prefixes(vocab: usize, depth: usize) -> Vec<Vec<u32>> {
    let mut out = vec![vec![]];
    let mut frontier = vec![vec![]];
    for _ in 0..depth {
        let mut next = Vec::new();
        for prefix in &frontier {
            for t in 0..vocab as u32 {
                let mut p: Vec<u32> = prefix.clone();
                p.push(t);
                next.push(p);
            }
        }
        out.extend(next.iter().cloned());
        frontier = next;
    }
    out
}

impl TableModel {
    /// Random rows, each Dense/Sparse/OneHot with the given weights.
    pub fn random(rng: &mut ChaCha8Rng, vocab: usize, depth: usize, one_hot_share: f64) -> Self {
        let rows = all_prefixes(vocab, depth)
            .into_iter()
            .map(|prefix| {
                let shape = if rng.random_bool(one_hot_share) {
                    RowShape::OneHot
                } else if rng.random_bool(0.5) {
                    RowShape::Sparse
                } else {
                    RowShape::Dense
                };
                (prefix, random_row(rng, vocab, shape))
            })
            .collect();
        TableModel { vocab, depth, rows }
    }

    /// Every row dense (all entries positive).
    pub fn dense(rng: &mut ChaCha8Rng, vocab: usize, depth: usize) -> Self {
        let rows = all_prefixes(vocab, depth)
            .into_iter()
            .map(|prefix| (prefix, random_row(rng, vocab, RowShape::Dense)))
            .collect();
        TableModel { vocab, depth, rows }
    }

    /// A draft model: random rows, but some copied from `target` so P == Q cases occur.
    pub fn random_draft(rng: &mut ChaCha8Rng, target: &TableModel, depth: usize) -> Self {
        let mut model = TableModel::random(rng, target.vocab, depth, 0.1);
        for (prefix, row) in model.rows.iter_mut() {
            if rng.random_bool(0.2) {
                *row = target.rows[prefix].clone();
            }
        }
        model
    }

    pub fn row(&self, prefix: &[u32]) -> &[f32] {
        &self.rows[prefix]
    }

    pub fn prob(&self, prefix: &[u32], token: u32) -> f64 {
        normalised(self.row(prefix))[token as usize]
    }

    /// Probability of `continuation` following `prefix`.
    pub fn sequence_prob(&self, prefix: &[u32], continuation: &[u32]) -> f64 {
        let mut seq = prefix.to_vec();
        let mut prob = 1.0;
        for &t in continuation {
            prob *= self.prob(&seq, t);
            seq.push(t);
        }
        prob
    }

    /// Every sequence of length `len` continuing `prefix`, with its probability (zeros included).
    pub fn continuations(&self, prefix: &[u32], len: usize) -> Vec<(Vec<u32>, f64)> {
        let mut out = vec![(prefix.to_vec(), 1.0)];
        for _ in 0..len {
            let mut next = Vec::with_capacity(out.len() * self.vocab);
            for (seq, prob) in &out {
                let row = normalised(self.row(seq));
                for (t, &pt) in row.iter().enumerate() {
                    let mut s = seq.clone();
                    s.push(t as u32);
                    next.push((s, prob * pt));
                }
            }
            out = next;
        }
        out
    }

    /// The rows a verify step sees after drafting `drafts`: P(.|x_<1), ..., P(.|x_<=k).
    pub fn rows_along(&self, drafts: &[u32]) -> Vec<Vec<f32>> {
        (0..=drafts.len())
            .map(|i| self.row(&drafts[..i]).to_vec())
            .collect()
    }

    /// Samples a sequence of `len` tokens after `prefix`.
    pub fn sample(&self, rng: &mut ChaCha8Rng, prefix: &[u32], len: usize) -> Vec<u32> {
        let mut seq = prefix.to_vec();
        for _ in 0..len {
            let u = rng.random::<f64>();
            seq.push(specula_kernels::sampling::sample_from(self.row(&seq), u));
        }
        seq[prefix.len()..].to_vec()
    }
}

/// Index of a token sequence in a flat table of `vocab^len` cells.
pub fn cell(seq: &[u32], vocab: usize) -> usize {
    seq.iter().fold(0, |acc, &t| acc * vocab + t as usize)
}

/// ln Gamma(x) (Lanczos, g = 7), accurate to ~1e-13 for x > 0.
fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.5203681218851,
        -1259.1392167224028,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507343278686905,
        -0.13857109526572012,
        9.984_369_578_019_572e-6,
        1.5056327351493116e-7,
    ];
    let x = x - 1.0;
    let mut a = C[0];
    let t = x + 7.5;
    for (i, &c) in C.iter().enumerate().skip(1) {
        a += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// Regularised upper incomplete gamma Q(a, x) (series / continued fraction, Numerical Recipes).
pub fn gamma_q(a: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 1.0;
    }
    let ln_prefactor = -x + a * x.ln() - ln_gamma(a);
    if x < a + 1.0 {
        let (mut term, mut sum, mut ap) = (1.0 / a, 1.0 / a, a);
        for _ in 0..10_000 {
            ap += 1.0;
            term *= x / ap;
            sum += term;
            if term.abs() < sum.abs() * 1e-16 {
                break;
            }
        }
        1.0 - sum * ln_prefactor.exp()
    } else {
        let tiny = 1e-300;
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / tiny;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..10_000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let delta = d * c;
            h *= delta;
            if (delta - 1.0).abs() < 1e-16 {
                break;
            }
        }
        ln_prefactor.exp() * h
    }
}

/// Pearson chi-square goodness-of-fit p-value of `observed` counts against `expected` probabilities.
/// A cell with expected probability 0 must stay empty (returns p = 0 otherwise).
pub fn chi_square_p_value(observed: &[u64], expected: &[f64]) -> f64 {
    assert_eq!(observed.len(), expected.len());
    let n: u64 = observed.iter().sum();
    let mut stat = 0.0;
    let mut cells = 0;
    for (&o, &p) in observed.iter().zip(expected) {
        if p <= 0.0 {
            if o > 0 {
                return 0.0;
            }
            continue;
        }
        let e = p * n as f64;
        stat += (o as f64 - e).powi(2) / e;
        cells += 1;
    }
    if cells <= 1 {
        return 1.0;
    }
    gamma_q((cells - 1) as f64 / 2.0, stat / 2.0)
}

/// Chi-square p-value with cells of expected count below 5 pooled into one (the test's approximation
/// needs it); zero-probability cells stay separate, so a count there still fails the test.
pub fn pooled_p_value(counts: &[u64], probs: &[f64]) -> f64 {
    let n: u64 = counts.iter().sum();
    let (mut obs, mut exp) = (Vec::new(), Vec::new());
    let (mut rest_o, mut rest_p) = (0u64, 0.0);
    for (&o, &p) in counts.iter().zip(probs) {
        if p > 0.0 && p * (n as f64) < 5.0 {
            rest_o += o;
            rest_p += p;
        } else {
            obs.push(o);
            exp.push(p);
        }
    }
    if rest_p > 0.0 {
        obs.push(rest_o);
        exp.push(rest_p);
    }
    chi_square_p_value(&obs, &exp)
}
