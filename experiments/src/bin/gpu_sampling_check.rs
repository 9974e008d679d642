//! Checks the GPU sampling kernels (`kernels/cuda/sampling.cu`) against the CPU references, on the GPU:
//!
//! 1. Philox4x32-10 on the GPU against the Random123 known answers and `specula_kernels::philox`.
//! 2. `logits_to_probs` on fresh random logits (150k-entry rows, every temperature/top-k/top-p shape,
//!    ties, masks, a vocab limit) against `sampling::probabilities`: max abs error and kept-set
//!    mismatches; the error rows the CPU refuses.
//! 3. `verify_drafts` against the CPU verifier fed the same Philox uniforms: every rule, full and one-hot
//!    drafts, k = 0..7, at vocab 128256 and at tiny vocabularies: the outcomes must be identical; bad
//!    inputs must come back as the verifier's errors.
//! 4. Distribution tests: for V = 2..4 and k = 1..4, 200k independent GPU verify steps on a fixed input
//!    (one launch, one Philox offset per step) histogrammed against the verifier's exact
//!    `outcome_distribution`; lossless end-to-end (drafts drawn per step) against the target's own
//!    distribution; synthetic AL and per-position rates; and the same tests run against a wrong target
//!    and a biased rule, which must reject.
//! 5. Timing (CUDA events, medians) of the verify kernel for B = 1..8, k = 7, vocab 128256.
//!
//! Prints a summary table last and exits non-zero if any check fails. Needs a GPU:
//! cargo build --release -p specula-experiments --features cuda --bin gpu_sampling_check
//! (scripts/gpu_distribution_tests.sh runs it on the lent GPU machine).

#[path = "../../../verifier/tests/common/mod.rs"]
mod common;

use anyhow::{bail, Context, Result};
use common::{cell, normalised, pooled_p_value, TableModel};
use cudarc::driver::CudaStream;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specula_kernels::cuda::sampling::{
    DraftRows, GpuRule, GpuSampler, GpuVerifyOutcome, RowFailure, VerifyBatch, VerifyFailure,
    VerifyOutput,
};
use specula_kernels::cuda::GpuDevice;
use specula_kernels::philox::{philox4x32_10, PhiloxStream};
use specula_kernels::sampling::{self, SamplingParams};
use specula_verifier::{
    AcceptanceCounter, AcceptanceRule, DraftProbs, SyntheticAcceptance, UniformSource, VerifyError,
    VerifyInput, VerifyOutcome,
};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// Every outcome of a verify step with its exact probability (`outcome_distribution`).
type Exact = Vec<(VerifyOutcome, f64)>;
/// A section of the check: runs against the GPU and records its checks.
type Section<'a> = &'a mut dyn FnMut(&mut GpuSampler, &mut Report) -> Result<()>;

/// Threshold of every goodness-of-fit test: a correct kernel fails one test with probability 1e-4
/// (fixed seeds make each run deterministic); a bias of a few tenths of a percent fails it.
const P_THRESHOLD: f64 = 1e-4;
/// A test run against a wrong distribution must reject at least this strongly (its power).
const P_POWER: f64 = 1e-9;
/// Independent verify steps per distribution test.
const TRIALS: usize = 200_000;

/// The CPU verifier's uniforms from the same Philox stream the kernel draws from.
struct Philox(PhiloxStream);

impl UniformSource for Philox {
    fn next_uniform(&mut self) -> f64 {
        self.0.next_uniform()
    }
}

struct Check {
    name: String,
    value: String,
    limit: String,
    ok: bool,
}

#[derive(Default)]
struct Report {
    checks: Vec<Check>,
}

impl Report {
    fn add(&mut self, name: impl Into<String>, value: String, limit: &str, ok: bool) {
        let name = name.into();
        println!(
            "  {name}: {value} (limit {limit}) {}",
            if ok { "ok" } else { "FAIL" }
        );
        self.checks.push(Check {
            name,
            value,
            limit: limit.to_string(),
            ok,
        });
    }
}

fn gpu_rule(rule: &AcceptanceRule) -> GpuRule {
    match rule {
        AcceptanceRule::Greedy => GpuRule::Greedy,
        AcceptanceRule::Standard => GpuRule::Standard,
        AcceptanceRule::Block => GpuRule::Block,
        AcceptanceRule::Synthetic(s) => GpuRule::Synthetic {
            conditional_rates: s.conditional_rates().to_vec(),
        },
    }
}

fn same(gpu: &GpuVerifyOutcome, cpu: &VerifyOutcome) -> bool {
    gpu.num_accepted == cpu.num_accepted && gpu.emitted == cpu.emitted
}

/// One verify step as the host sees it: k drafts, k + 1 target rows, k draft rows (or one-hot).
struct Case<'a> {
    drafts: &'a [u32],
    target: &'a [Vec<f32>],
    draft: Option<&'a [Vec<f32>]>,
    rule: &'a AcceptanceRule,
}

impl Case<'_> {
    fn input(&self) -> VerifyInput<'_> {
        VerifyInput {
            draft_tokens: self.drafts,
            draft_probs: match self.draft {
                Some(rows) => DraftProbs::Full(rows),
                None => DraftProbs::OneHot,
            },
            target_probs: self.target,
        }
    }
}

/// Host-side packing of a batch of cases into the kernel's [B, k_max(+1), V] layout.
struct Packed {
    k_max: usize,
    vocab: usize,
    one_hot: bool,
    target: Vec<f32>,
    draft: Vec<f32>,
    tokens: Vec<u32>,
    num: Vec<i32>,
    rules: Vec<GpuRule>,
}

impl Packed {
    fn new(k_max: usize, vocab: usize, one_hot: bool, capacity: usize) -> Packed {
        Packed {
            k_max,
            vocab,
            one_hot,
            target: Vec::with_capacity(capacity * (k_max + 1) * vocab),
            draft: Vec::with_capacity(if one_hot { 0 } else { capacity * k_max * vocab }),
            tokens: Vec::with_capacity(capacity * k_max),
            num: Vec::with_capacity(capacity),
            rules: Vec::with_capacity(capacity),
        }
    }

    /// Appends a case; rows past its k are filled with zeros (never read: the kernel stops at k).
    fn push(&mut self, case: &Case) {
        let (k, v) = (case.drafts.len(), self.vocab);
        for r in 0..=self.k_max {
            match case.target.get(r) {
                Some(row) if r <= k => self.target.extend_from_slice(row),
                _ => self.target.extend(std::iter::repeat_n(0.0, v)),
            }
        }
        if !self.one_hot {
            let rows = case.draft.unwrap_or(&[]);
            for r in 0..self.k_max {
                match rows.get(r) {
                    Some(row) if r < k => self.draft.extend_from_slice(row),
                    _ => self.draft.extend(std::iter::repeat_n(0.0, v)),
                }
            }
        }
        for s in 0..self.k_max {
            self.tokens.push(case.drafts.get(s).copied().unwrap_or(0));
        }
        self.num.push(k as i32);
        self.rules.push(gpu_rule(case.rule));
    }

    fn len(&self) -> usize {
        self.num.len()
    }
}

/// Uploads a packed batch, computes row scales on the GPU, verifies with Philox (seed, offsets[i]) and
/// reads the results back (one sync), along with the offsets afterwards.
#[allow(clippy::type_complexity)]
fn run_gpu(
    sampler: &GpuSampler,
    p: &Packed,
    seeds: &[u64],
    offsets: &[u64],
) -> Result<(Vec<Result<GpuVerifyOutcome, VerifyFailure>>, Vec<u64>)> {
    let s = sampler.stream();
    let n = p.len();
    let target = s.clone_htod(&p.target)?;
    let mut target_sums = s.alloc_zeros::<f64>(n * (p.k_max + 1))?;
    sampler.row_inv_sums(&target, n * (p.k_max + 1), p.vocab, &mut target_sums)?;
    // cudarc refuses zero-length buffers; k_max = 0 batches get one dummy element.
    let pad = |v: &[u32]| if v.is_empty() { vec![0u32] } else { v.to_vec() };
    let tokens = s.clone_htod(&pad(&p.tokens))?;
    let num = s.clone_htod(&p.num)?;
    let rules = sampler.upload_rules(&p.rules, p.k_max)?;
    let mut philox = sampler.upload_philox(seeds, offsets)?;
    let mut out = VerifyOutput::new(s, n, p.k_max, p.vocab)?;
    let draft_bufs = if p.one_hot || p.k_max == 0 {
        None
    } else {
        let draft = s.clone_htod(&p.draft)?;
        let mut sums = s.alloc_zeros::<f64>(n * p.k_max)?;
        sampler.row_inv_sums(&draft, n * p.k_max, p.vocab, &mut sums)?;
        Some((draft, sums))
    };
    let batch = VerifyBatch {
        batch: n,
        k_max: p.k_max,
        vocab: p.vocab,
        target_probs: &target,
        target_inv_sums: &target_sums,
        draft: match &draft_bufs {
            Some((probs, inv_sums)) => DraftRows::Full { probs, inv_sums },
            None => DraftRows::OneHot,
        },
        draft_tokens: &tokens,
        num_drafts: &num,
        rules: &rules,
    };
    sampler.verify(&batch, &mut philox, &mut out)?;
    let results = out.read(s)?;
    let after = philox.read_offsets(s)?;
    Ok((results, after))
}

fn box_muller(rng: &mut ChaCha8Rng) -> f32 {
    let u1: f64 = rng.random_range(1e-12..1.0);
    let u2: f64 = rng.random();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

fn random_logits(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| scale * box_muller(rng)).collect()
}

fn sample_row(rng: &mut ChaCha8Rng, row: &[f32]) -> u32 {
    sampling::sample_from(row, rng.random::<f64>())
}

// ------------------------------------------------------------------------------------------------
// 1. Philox

fn check_philox(sampler: &GpuSampler, report: &mut Report) -> Result<()> {
    println!("\n[1] Philox4x32-10 on the GPU");
    let kat: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
        (
            [0; 4],
            [0; 2],
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8],
        ),
        (
            [u32::MAX; 4],
            [u32::MAX; 2],
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
        ),
        (
            [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
            [0xa4093822, 0x299f31d0],
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
        ),
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut counters: Vec<[u32; 4]> = kat.iter().map(|c| c.0).collect();
    let mut keys: Vec<[u32; 2]> = kat.iter().map(|c| c.1).collect();
    for _ in 0..100_000 {
        counters.push([rng.random(), rng.random(), rng.random(), rng.random()]);
        keys.push([rng.random(), rng.random()]);
    }
    let got = sampler.philox_blocks(&counters, &keys)?;
    let kat_ok = kat.iter().zip(&got).all(|(c, g)| c.2 == *g);
    let mismatches = counters
        .iter()
        .zip(&keys)
        .zip(&got)
        .filter(|((c, k), g)| philox4x32_10(**c, **k) != **g)
        .count();
    report.add(
        "philox KAT (Random123)",
        if kat_ok {
            "3/3 match".into()
        } else {
            "MISMATCH".into()
        },
        "exact",
        kat_ok,
    );
    report.add(
        "philox vs Rust reference",
        format!("{mismatches} of {} blocks differ", counters.len()),
        "0",
        mismatches == 0,
    );
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// 2. Logits processing

struct ProbsRun {
    probs: Vec<f32>,
    inv_sums: Vec<f64>,
    status: Vec<Result<(), RowFailure>>,
}

fn gpu_probabilities(
    sampler: &GpuSampler,
    logits: &[f32],
    rows: usize,
    stride: usize,
    vocab: usize,
    params: &[SamplingParams],
) -> Result<ProbsRun> {
    let s = sampler.stream();
    let dl = s.clone_htod(logits)?;
    let dp = sampler.upload_params(params)?;
    let mut probs = s.alloc_zeros::<f32>(rows * stride)?;
    let mut sums = s.alloc_zeros::<f64>(rows)?;
    let mut status = s.alloc_zeros::<i32>(2 * rows)?;
    sampler.probabilities(
        &dl,
        rows,
        stride,
        vocab,
        &dp,
        &mut probs,
        &mut sums,
        &mut status,
    )?;
    Ok(ProbsRun {
        probs: s.clone_dtoh(&probs)?,
        inv_sums: s.clone_dtoh(&sums)?,
        status: GpuSampler::decode_row_status(&s.clone_dtoh(&status)?),
    })
}

fn check_logits(sampler: &GpuSampler, report: &mut Report) -> Result<()> {
    println!("\n[2] logits_to_probs vs sampling::probabilities (8 fresh random rows per setting)");
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let p = |temperature: f32, top_k: usize, top_p: f32| SamplingParams {
        temperature,
        top_k,
        top_p,
    };
    // (label, vocab, row stride, logit scale, quantum for ties (0 = none), masked share, params)
    #[allow(clippy::type_complexity)]
    let settings: Vec<(&str, usize, usize, f32, f32, f64, SamplingParams)> = vec![
        ("greedy", 128256, 128256, 3.0, 0.0, 0.0, p(0.0, 0, 1.0)),
        ("T=1", 128256, 128256, 3.0, 0.0, 0.0, p(1.0, 0, 1.0)),
        ("T=0.7 k=50", 128256, 128256, 3.0, 0.0, 0.0, p(0.7, 50, 1.0)),
        ("T=1 p=0.9", 128256, 128256, 3.0, 0.0, 0.0, p(1.0, 0, 0.9)),
        (
            "T=0.8 k=1000 p=0.95",
            128256,
            128256,
            3.0,
            0.0,
            0.0,
            p(0.8, 1000, 0.95),
        ),
        ("T=1.5 p=0.5", 128256, 128256, 2.0, 0.0, 0.0, p(1.5, 0, 0.5)),
        ("T=1 k=1", 128256, 128256, 3.0, 0.0, 0.0, p(1.0, 1, 1.0)),
        (
            "T=0.05 p=0.99",
            128256,
            128256,
            3.0,
            0.0,
            0.0,
            p(0.05, 0, 0.99),
        ),
        ("ties k=40", 128256, 128256, 3.0, 0.5, 0.0, p(1.0, 40, 1.0)),
        ("ties p=0.8", 128256, 128256, 3.0, 0.5, 0.0, p(1.0, 0, 0.8)),
        (
            "ties k=300 p=0.6",
            128256,
            128256,
            3.0,
            0.5,
            0.0,
            p(1.0, 300, 0.6),
        ),
        (
            "half -inf p=0.9",
            128256,
            128256,
            3.0,
            0.0,
            0.5,
            p(1.0, 0, 0.9),
        ),
        (
            "vocab 151665/151936 k=100",
            151665,
            151936,
            3.0,
            0.0,
            0.0,
            p(1.0, 100, 1.0),
        ),
        (
            "flat (all equal) k=7 p=0.3",
            128256,
            128256,
            0.0,
            0.0,
            0.0,
            p(1.0, 7, 0.3),
        ),
    ];
    let rows = 8;
    let mut worst_abs = 0f64;
    let mut worst_scale = 0f64;
    let mut kept_mismatch = 0usize;
    for (label, vocab, stride, scale, quantum, masked, params) in &settings {
        let mut logits = vec![0f32; rows * stride];
        for r in 0..rows {
            for x in 0..*vocab {
                let mut v = if *scale == 0.0 {
                    0.0
                } else {
                    scale * box_muller(&mut rng)
                };
                if *quantum > 0.0 {
                    v = (v / quantum).round() * quantum;
                }
                if *masked > 0.0 && rng.random_bool(*masked) {
                    v = f32::NEG_INFINITY;
                }
                logits[r * stride + x] = v;
            }
            // Padding past the vocab limit: garbage the kernel must ignore.
            for x in *vocab..*stride {
                logits[r * stride + x] = 1e30;
            }
        }
        let run = gpu_probabilities(
            sampler,
            &logits,
            rows,
            *stride,
            *vocab,
            &vec![*params; rows],
        )?;
        let (mut abs, mut kept, mut scale_err) = (0f64, 0usize, 0f64);
        for r in 0..rows {
            if let Err(e) = &run.status[r] {
                bail!("{label} row {r}: GPU refused a valid row: {e}");
            }
            let want = sampling::probabilities(&logits[r * stride..r * stride + vocab], params)?;
            let got = &run.probs[r * stride..(r + 1) * stride];
            for (x, &w) in want.iter().enumerate() {
                abs = abs.max((got[x] as f64 - w as f64).abs());
                if (got[x] > 0.0) != (w > 0.0) {
                    kept += 1;
                }
            }
            if got[*vocab..].iter().any(|&v| v != 0.0) {
                bail!("{label} row {r}: padding past the vocab limit is not 0");
            }
            let sum: f64 = got.iter().map(|&v| v as f64).sum();
            scale_err = scale_err.max((run.inv_sums[r] * sum - 1.0).abs());
        }
        println!(
            "  {label:<28} max abs error {abs:.2e}, kept-set mismatches {kept}, scale error {scale_err:.1e}"
        );
        worst_abs = worst_abs.max(abs);
        worst_scale = worst_scale.max(scale_err);
        kept_mismatch += kept;
    }
    report.add(
        "logits_to_probs max abs error",
        format!(
            "{worst_abs:.2e} over {} settings x {rows} rows",
            settings.len()
        ),
        "1e-6",
        worst_abs <= 1e-6,
    );
    report.add(
        "logits_to_probs kept-set mismatches",
        format!("{kept_mismatch}"),
        "0",
        kept_mismatch == 0,
    );
    report.add(
        "logits_to_probs row scale |inv_sum * sum - 1|",
        format!("{worst_scale:.1e}"),
        "1e-12",
        worst_scale <= 1e-12,
    );

    // Rows the CPU refuses must be refused on the GPU with the same reason.
    let vocab = 1000;
    let mut logits = random_logits(&mut rng, 4 * vocab, 1.0);
    logits[17] = f32::NAN;
    logits[vocab + 300] = f32::INFINITY;
    logits[2 * vocab..4 * vocab].fill(f32::NEG_INFINITY);
    let params = [
        p(1.0, 0, 1.0),
        p(1.0, 0, 1.0),
        p(1.0, 0, 1.0),
        p(0.0, 0, 1.0),
    ];
    let run = gpu_probabilities(sampler, &logits, 4, vocab, vocab, &params)?;
    let cpu: Vec<_> = (0..4)
        .map(|r| sampling::probabilities(&logits[r * vocab..(r + 1) * vocab], &params[r]))
        .collect();
    let ok = run.status[0] == Err(RowFailure::NonFiniteLogit { index: 17 })
        && run.status[1] == Err(RowFailure::NonFiniteLogit { index: 300 })
        && run.status[2] == Err(RowFailure::AllMasked)
        && run.status[3].is_ok()
        && cpu[0].is_err()
        && cpu[1].is_err()
        && cpu[2].is_err()
        && cpu[3]
            .as_ref()
            .is_ok_and(|w| w[..] == run.probs[3 * vocab..])
        && run.inv_sums[..3].iter().all(|v| v.is_nan());
    println!(
        "  error rows: GPU {:?}; CPU errors {:?}",
        run.status,
        cpu.iter().map(|c| c.as_ref().err()).collect::<Vec<_>>()
    );
    report.add(
        "logits_to_probs refuses NaN/+inf/all-masked rows",
        if ok {
            "as the CPU".into()
        } else {
            "differs".into()
        },
        "as the CPU",
        ok,
    );
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// 3. Verify decisions against the CPU verifier with the same uniforms

/// Runs `cases` on the GPU (seed, offset = base + i) and on the CPU verifier with the same Philox
/// uniforms; returns (cases compared, outcomes that differ, offsets not advanced by one).
fn compare_with_cpu(
    sampler: &GpuSampler,
    cases: &[Case],
    k_max: usize,
    vocab: usize,
    seed: u64,
    base: u64,
) -> Result<(usize, usize, usize)> {
    let one_hot = cases.first().is_some_and(|c| c.draft.is_none());
    let mut packed = Packed::new(k_max, vocab, one_hot, cases.len());
    for c in cases {
        packed.push(c);
    }
    let seeds = vec![seed; cases.len()];
    let offsets: Vec<u64> = (0..cases.len() as u64).map(|i| base + i).collect();
    let (gpu, after) = run_gpu(sampler, &packed, &seeds, &offsets)?;
    let mut differ = 0;
    for (i, c) in cases.iter().enumerate() {
        let mut u = Philox(PhiloxStream::new(seed, offsets[i]));
        let cpu = c.rule.verify(&c.input(), &mut u)?;
        match &gpu[i] {
            Ok(g) if same(g, &cpu) => {}
            other => {
                differ += 1;
                if differ <= 5 {
                    println!(
                        "    MISMATCH {} k={} case {i}: GPU {other:?} CPU {cpu:?}",
                        c.rule.name(),
                        c.drafts.len()
                    );
                }
            }
        }
    }
    let not_advanced = after
        .iter()
        .zip(&offsets)
        .filter(|(a, o)| **a != **o + 1)
        .count();
    Ok((cases.len(), differ, not_advanced))
}

fn rules_for(k: usize) -> Result<Vec<AcceptanceRule>> {
    Ok(vec![
        AcceptanceRule::Greedy,
        AcceptanceRule::Standard,
        AcceptanceRule::Block,
        AcceptanceRule::Synthetic(SyntheticAcceptance::from_conditional_rates(
            &[0.9, 0.8, 0.5, 0.7, 0.3, 0.6, 0.4, 0.5][..k.max(1)],
        )?),
    ])
}

fn check_decisions(sampler: &mut GpuSampler, report: &mut Report) -> Result<()> {
    println!("\n[3] verify_drafts vs the CPU verifier with the same Philox uniforms");
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    // Real vocabulary: a pool of target and draft rows from random logits (dense at T=1, sparse after
    // top-k/top-p), drafts from the draft rows or the target's argmax (so long prefixes get accepted).
    let vocab = 128256;
    let pool = 24;
    let mut target_pool = Vec::new();
    let mut draft_pool = Vec::new();
    for i in 0..pool {
        let logits = random_logits(&mut rng, vocab, 2.5);
        let noisy: Vec<f32> = logits
            .iter()
            .map(|&l| l + 0.7 * box_muller(&mut rng))
            .collect();
        let params = match i % 3 {
            0 => SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
            },
            1 => SamplingParams {
                temperature: 0.8,
                top_k: 50,
                top_p: 1.0,
            },
            _ => SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.9,
            },
        };
        target_pool.push(sampling::probabilities(&logits, &params)?);
        draft_pool.push(sampling::probabilities(&noisy, &params)?);
    }
    let (mut total, mut differ, mut stale) = (0, 0, 0);
    sampler.set_verify_threads(512)?;
    for &k in &[0usize, 1, 3, 7] {
        let rules = rules_for(k)?;
        for rule in &rules {
            for one_hot in [false, true] {
                let n = 12;
                let mut storage = Vec::new();
                for _ in 0..n {
                    let idx: Vec<usize> = (0..=k).map(|_| rng.random_range(0..pool)).collect();
                    let target: Vec<Vec<f32>> =
                        idx.iter().map(|&i| target_pool[i].clone()).collect();
                    let draft: Vec<Vec<f32>> =
                        idx[..k].iter().map(|&i| draft_pool[i].clone()).collect();
                    let drafts: Vec<u32> = (0..k)
                        .map(|s| {
                            if rng.random_bool(0.6) {
                                sampling::argmax(&target[s]).unwrap_or(0)
                            } else {
                                sample_row(&mut rng, &draft[s])
                            }
                        })
                        .collect();
                    // A full-Q drafter cannot draft a token its row gives 0: resample those.
                    let drafts: Vec<u32> = drafts
                        .iter()
                        .enumerate()
                        .map(|(s, &t)| {
                            if !one_hot && draft[s][t as usize] == 0.0 {
                                sample_row(&mut rng, &draft[s])
                            } else {
                                t
                            }
                        })
                        .collect();
                    storage.push((drafts, target, draft));
                }
                let cases: Vec<Case> = storage
                    .iter()
                    .map(|(d, t, q)| Case {
                        drafts: d,
                        target: t,
                        draft: if one_hot { None } else { Some(q) },
                        rule,
                    })
                    .collect();
                let (t, d, s) = compare_with_cpu(
                    sampler,
                    &cases,
                    k,
                    vocab,
                    77 + k as u64,
                    1000 * total as u64,
                )?;
                total += t;
                differ += d;
                stale += s;
            }
        }
    }
    report.add(
        "verify == CPU verifier, vocab 128256 (512 threads)",
        format!("{differ} of {total} steps differ"),
        "0",
        differ == 0,
    );

    // Tiny vocabularies, many steps, both block sizes.
    let (mut total_small, mut differ_small) = (0, 0);
    for threads in [32u32, 512] {
        sampler.set_verify_threads(threads)?;
        for vocab in 2..=4usize {
            for k in 0..=4usize {
                let target = TableModel::random(&mut rng, vocab, k, 0.1);
                let draft = TableModel::random_draft(&mut rng, &target, k.saturating_sub(1));
                for rule in &rules_for(k)? {
                    for one_hot in [false, true] {
                        let mut storage = Vec::new();
                        for _ in 0..200 {
                            let drafts = draft.sample(&mut rng, &[], k);
                            let t = target.rows_along(&drafts);
                            let q: Vec<Vec<f32>> =
                                (0..k).map(|i| draft.row(&drafts[..i]).to_vec()).collect();
                            storage.push((drafts, t, q));
                        }
                        let cases: Vec<Case> = storage
                            .iter()
                            .map(|(d, t, q)| Case {
                                drafts: d,
                                target: t,
                                draft: if one_hot { None } else { Some(q) },
                                rule,
                            })
                            .collect();
                        let (t, d, s) = compare_with_cpu(sampler, &cases, k, vocab, 5, 0)?;
                        total_small += t;
                        differ_small += d;
                        stale += s;
                    }
                }
            }
        }
    }
    report.add(
        "verify == CPU verifier, vocab 2..4, k 0..4 (32 and 512 threads)",
        format!("{differ_small} of {total_small} steps differ"),
        "0",
        differ_small == 0,
    );
    report.add(
        "Philox step counter advanced by one per verified step",
        format!("{stale} stale"),
        "0",
        stale == 0,
    );

    // Bad inputs come back as the verifier's errors, per sequence, without touching the others.
    let vocab = 5;
    let row = vec![0.1f32, 0.2, 0.3, 0.25, 0.15];
    let target = vec![row.clone(); 4];
    let good_q = vec![row.clone(); 3];
    let mut zero_q = good_q.clone();
    zero_q[1][2] = 0.0;
    zero_q[1][0] += 0.3;
    let mut doubled = target.clone();
    for v in doubled[2].iter_mut() {
        *v *= 2.0;
    }
    let mut nan_q = good_q.clone();
    nan_q[0][4] = f32::NAN;
    let few = AcceptanceRule::Synthetic(SyntheticAcceptance::from_conditional_rates(&[0.5, 0.5])?);
    let std_rule = AcceptanceRule::Standard;
    let cases = [
        (
            Case {
                drafts: &[1, 9, 2],
                target: &target,
                draft: Some(&good_q),
                rule: &std_rule,
            },
            "out-of-vocab token",
        ),
        (
            Case {
                drafts: &[1, 2, 2],
                target: &target,
                draft: Some(&zero_q),
                rule: &std_rule,
            },
            "zero draft probability",
        ),
        (
            Case {
                drafts: &[1, 2, 2],
                target: &doubled,
                draft: Some(&good_q),
                rule: &std_rule,
            },
            "unnormalised target row",
        ),
        (
            Case {
                drafts: &[1, 2, 2],
                target: &target,
                draft: Some(&nan_q),
                rule: &std_rule,
            },
            "NaN draft row",
        ),
        (
            Case {
                drafts: &[1, 2, 2],
                target: &target,
                draft: Some(&good_q),
                rule: &few,
            },
            "too few synthetic rates",
        ),
        (
            Case {
                drafts: &[1, 2, 2],
                target: &target,
                draft: Some(&good_q),
                rule: &std_rule,
            },
            "valid",
        ),
    ];
    let mut packed = Packed::new(3, vocab, false, cases.len());
    for (c, _) in &cases {
        packed.push(c);
    }
    let (gpu, _) = run_gpu(sampler, &packed, &[1; 6], &[0; 6])?;
    let mut all_match = true;
    for ((c, label), g) in cases.iter().zip(&gpu) {
        let cpu = c
            .rule
            .verify(&c.input(), &mut Philox(PhiloxStream::new(1, 0)));
        let ok = match (g, &cpu) {
            (
                Err(VerifyFailure::TokenOutOfVocabulary { slot }),
                Err(VerifyError::TokenOutOfVocabulary { slot: s, .. }),
            ) => slot == s,
            (
                Err(VerifyFailure::ZeroDraftProbability { slot }),
                Err(VerifyError::ZeroDraftProbability { slot: s, .. }),
            ) => slot == s,
            (
                Err(VerifyFailure::InvalidTargetRow { row }),
                Err(VerifyError::RowNotNormalised { row: r, .. }),
            ) => row == r,
            (
                Err(VerifyFailure::InvalidDraftRow { row }),
                Err(VerifyError::InvalidProbability { row: r, .. }),
            ) => row == r,
            (
                Err(VerifyFailure::TooFewSyntheticRates { .. }),
                Err(VerifyError::TooFewSyntheticRates { .. }),
            ) => true,
            (Ok(g), Ok(c)) => same(g, c),
            _ => false,
        };
        println!(
            "    {label:<24} GPU {g:?} | CPU {:?} {}",
            cpu.as_ref().map_err(|e| e.to_string()),
            if ok { "ok" } else { "FAIL" }
        );
        all_match &= ok;
    }
    report.add(
        "bad verify inputs -> the verifier's errors",
        if all_match {
            "6/6 as the CPU".into()
        } else {
            "differs".into()
        },
        "as the CPU",
        all_match,
    );
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// 4. Distribution tests

/// 200k GPU steps on one fixed input against `outcome_distribution`; returns (p-value, outcomes
/// outside the exact support, CPU-replay mismatches among the first 2000 steps, GPU histogram).
fn fixed_input_test(
    sampler: &GpuSampler,
    case: &Case,
    vocab: usize,
    seed: u64,
) -> Result<(f64, usize, usize, Exact, Vec<u64>)> {
    let k = case.drafts.len();
    let exact = case.rule.outcome_distribution(&case.input())?;
    let index: BTreeMap<VerifyOutcome, usize> = exact
        .iter()
        .enumerate()
        .map(|(i, (o, _))| (o.clone(), i))
        .collect();
    let mut packed = Packed::new(k, vocab, case.draft.is_none(), TRIALS);
    for _ in 0..TRIALS {
        packed.push(case);
    }
    let seeds = vec![seed; TRIALS];
    let offsets: Vec<u64> = (0..TRIALS as u64).collect();
    let (gpu, _) = run_gpu(sampler, &packed, &seeds, &offsets)?;
    let mut counts = vec![0u64; exact.len()];
    let mut impossible = 0;
    for g in &gpu {
        let g = g
            .as_ref()
            .map_err(|e| anyhow::anyhow!("valid input refused: {e}"))?;
        let o = VerifyOutcome {
            num_accepted: g.num_accepted,
            emitted: g.emitted.clone(),
        };
        match index.get(&o) {
            Some(&i) => counts[i] += 1,
            None => impossible += 1,
        }
    }
    let mut replay_mismatch = 0;
    for (i, g) in gpu.iter().take(2000).enumerate() {
        let cpu = case.rule.verify(
            &case.input(),
            &mut Philox(PhiloxStream::new(seed, offsets[i])),
        )?;
        if !matches!(g, Ok(g) if same(g, &cpu)) {
            replay_mismatch += 1;
        }
    }
    let probs: Vec<f64> = exact.iter().map(|(_, p)| *p).collect();
    Ok((
        pooled_p_value(&counts, &probs),
        impossible,
        replay_mismatch,
        exact,
        counts,
    ))
}

fn check_distributions(sampler: &mut GpuSampler, report: &mut Report) -> Result<()> {
    println!("\n[4] distribution tests ({TRIALS} GPU verify steps per test, p > {P_THRESHOLD:e})");
    sampler.set_verify_threads(32)?;
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let mut min_p = BTreeMap::<String, f64>::new();
    let (mut tests, mut failed, mut impossible_total, mut replay_total) = (0, 0, 0, 0);
    let mut greedy_bad = 0;
    let mut saved_standard: Option<(Exact, Vec<u64>)> = None;
    for vocab in 2..=4usize {
        for k in 1..=4usize {
            let target = TableModel::dense(&mut rng, vocab, k);
            let draft = TableModel::dense(&mut rng, vocab, k - 1);
            let drafts = draft.sample(&mut rng, &[], k);
            let target_rows = target.rows_along(&drafts);
            let draft_rows: Vec<Vec<f32>> =
                (0..k).map(|i| draft.row(&drafts[..i]).to_vec()).collect();
            for rule in rules_for(k)? {
                for one_hot in [false, true] {
                    let case = Case {
                        drafts: &drafts,
                        target: &target_rows,
                        draft: if one_hot { None } else { Some(&draft_rows) },
                        rule: &rule,
                    };
                    let seed = 1000 + tests as u64;
                    if rule == AcceptanceRule::Greedy {
                        // Deterministic: every step must give the one exact outcome.
                        let exact = rule.outcome_distribution(&case.input())?;
                        let mut packed = Packed::new(k, vocab, one_hot, 1000);
                        for _ in 0..1000 {
                            packed.push(&case);
                        }
                        let (gpu, _) = run_gpu(sampler, &packed, &[seed; 1000], &[0; 1000])?;
                        greedy_bad += gpu
                            .iter()
                            .filter(
                                |g| !matches!(g, Ok(g) if exact.len() == 1 && same(g, &exact[0].0)),
                            )
                            .count();
                        continue;
                    }
                    let (p, impossible, replay, exact, counts) =
                        fixed_input_test(sampler, &case, vocab, seed)?;
                    tests += 1;
                    impossible_total += impossible;
                    replay_total += replay;
                    let ok = p > P_THRESHOLD && impossible == 0;
                    if !ok {
                        failed += 1;
                        println!(
                            "    FAIL {} V={vocab} k={k} one_hot={one_hot}: p = {p:.3e}, impossible {impossible}",
                            rule.name()
                        );
                    }
                    let key = format!(
                        "{} {}",
                        rule.name(),
                        if one_hot { "one-hot" } else { "full" }
                    );
                    let e = min_p.entry(key).or_insert(1.0);
                    *e = e.min(p);
                    if rule == AcceptanceRule::Standard && !one_hot && vocab == 4 && k == 3 {
                        saved_standard = Some((exact, counts));
                    }
                }
            }
        }
    }
    for (key, p) in &min_p {
        println!("  {key:<20} smallest p over V=2..4, k=1..4: {p:.3e}");
    }
    report.add(
        "fixed-input chi-square vs outcome_distribution",
        format!(
            "{} of {tests} tests p <= {P_THRESHOLD:e}; smallest p {:.2e}",
            failed,
            min_p.values().cloned().fold(1.0, f64::min)
        ),
        "all p > 1e-4",
        failed == 0,
    );
    report.add(
        "outcomes outside the exact support",
        format!("{impossible_total}"),
        "0",
        impossible_total == 0,
    );
    report.add(
        "replayed on the CPU (first 2000 steps of each test)",
        format!("{replay_total} of {} differ", tests * 2000),
        "0",
        replay_total == 0,
    );
    report.add(
        "greedy: every step the exact outcome",
        format!("{greedy_bad} of 24000 differ"),
        "0",
        greedy_bad == 0,
    );

    // Power: the standard rule's histogram against a wrong expected distribution (two outcome
    // probabilities swapped) must be rejected.
    if let Some((exact, counts)) = saved_standard {
        let mut wrong: Vec<f64> = exact.iter().map(|(_, p)| *p).collect();
        let (imax, imin) = (
            (0..wrong.len())
                .max_by(|&a, &b| wrong[a].total_cmp(&wrong[b]))
                .unwrap_or(0),
            (0..wrong.len())
                .min_by(|&a, &b| wrong[a].total_cmp(&wrong[b]))
                .unwrap_or(0),
        );
        wrong.swap(imax, imin);
        let p = pooled_p_value(&counts, &wrong);
        report.add(
            "power: standard V=4 k=3 vs a wrong target (2 outcomes swapped)",
            format!("p = {p:.2e}"),
            "< 1e-9 (must reject)",
            p < P_POWER,
        );
    }

    // Lossless end to end: drafts drawn per step from a draft model with zeros and one-hot rows; the
    // first emitted token and the first two tokens (continued by the target on the CPU when a step
    // emits one) must follow the target's own distribution.
    let (vocab, k) = (4usize, 3usize);
    let mut mrng = ChaCha8Rng::seed_from_u64(2024);
    let target = TableModel::random(&mut mrng, vocab, k, 0.1);
    let draft = TableModel::random_draft(&mut mrng, &target, k - 1);
    let expected_first = normalised(target.row(&[]));
    let mut expected_pairs = vec![0.0; vocab * vocab];
    for (seq, p) in target.continuations(&[], 2) {
        expected_pairs[cell(&seq, vocab)] = p;
    }
    let biased_draft = TableModel::random(&mut mrng, vocab, k - 1, 0.0);
    let always = AcceptanceRule::Synthetic(SyntheticAcceptance::from_conditional_rates(&[1.0; 3])?);
    let runs: [(&AcceptanceRule, bool, &TableModel); 5] = [
        (&AcceptanceRule::Standard, false, &draft),
        (&AcceptanceRule::Standard, true, &draft),
        (&AcceptanceRule::Block, false, &draft),
        (&AcceptanceRule::Block, true, &draft),
        (&always, false, &biased_draft),
    ];
    for (i, (rule, one_hot, dmodel)) in runs.iter().enumerate() {
        let mut storage = Vec::with_capacity(TRIALS);
        for _ in 0..TRIALS {
            let drafts = dmodel.sample(&mut mrng, &[], k);
            let t = target.rows_along(&drafts);
            let q: Vec<Vec<f32>> = (0..k).map(|j| dmodel.row(&drafts[..j]).to_vec()).collect();
            storage.push((drafts, t, q));
        }
        let mut packed = Packed::new(k, vocab, *one_hot, TRIALS);
        for (d, t, q) in &storage {
            packed.push(&Case {
                drafts: d,
                target: t,
                draft: if *one_hot { None } else { Some(q) },
                rule,
            });
        }
        let offsets: Vec<u64> = (0..TRIALS as u64).collect();
        let (gpu, _) = run_gpu(sampler, &packed, &vec![9000 + i as u64; TRIALS], &offsets)?;
        let mut first = vec![0u64; vocab];
        let mut pairs = vec![0u64; vocab * vocab];
        for g in &gpu {
            let g = g
                .as_ref()
                .map_err(|e| anyhow::anyhow!("valid input refused: {e}"))?;
            let mut emitted = g.emitted.clone();
            if emitted.len() < 2 {
                emitted.extend(target.sample(&mut mrng, &emitted, 1));
            }
            first[emitted[0] as usize] += 1;
            pairs[cell(&emitted[..2], vocab)] += 1;
        }
        let p_first = pooled_p_value(&first, &expected_first);
        let p_pairs = pooled_p_value(&pairs, &expected_pairs);
        let view = if *one_hot { "one-hot" } else { "full" };
        if rule.is_lossless() {
            report.add(
                format!(
                    "lossless {} {view} V=4 k=3: first token / first two vs target",
                    rule.name()
                ),
                format!("p = {p_first:.2e} / {p_pairs:.2e}"),
                "> 1e-4",
                p_first > P_THRESHOLD && p_pairs > P_THRESHOLD,
            );
            if i == 0 {
                // Power: the same histogram against a wrong target (its two most different tokens'
                // probabilities swapped) must be rejected.
                let mut wrong = expected_first.clone();
                let imax = (0..vocab)
                    .max_by(|&a, &b| wrong[a].total_cmp(&wrong[b]))
                    .unwrap_or(0);
                let imin = (0..vocab)
                    .min_by(|&a, &b| wrong[a].total_cmp(&wrong[b]))
                    .unwrap_or(0);
                wrong.swap(imax, imin);
                let p = pooled_p_value(&first, &wrong);
                report.add(
                    "power: lossless standard first token vs a wrong target",
                    format!("p = {p:.2e}"),
                    "< 1e-9 (must reject)",
                    p < P_POWER,
                );
            }
        } else {
            report.add(
                "power: always-accept synthetic (biased) vs target, first token",
                format!("p = {p_first:.2e}"),
                "< 1e-9 (must reject)",
                p_first < P_POWER,
            );
        }
    }

    // Synthetic acceptance: mean AL and per-position rates.
    let (vocab, k) = (8usize, 7usize);
    let target = TableModel::dense(&mut rng, vocab, 0);
    let rows = vec![target.row(&[]).to_vec(); k + 1];
    let q = vec![target.row(&[]).to_vec(); k];
    let drafts: Vec<u32> = (0..k as u32).map(|i| i % vocab as u32).collect();
    for (label, config) in [
        (
            "L=3.78 k=7",
            SyntheticAcceptance::from_mean_length(3.78, 7)?,
        ),
        (
            "c=[.9,.8,.7,.6,.5,.4,.3]",
            SyntheticAcceptance::from_conditional_rates(&[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])?,
        ),
    ] {
        let rule = AcceptanceRule::Synthetic(config.clone());
        let case = Case {
            drafts: &drafts,
            target: &rows,
            draft: Some(&q),
            rule: &rule,
        };
        let mut packed = Packed::new(k, vocab, false, TRIALS);
        for _ in 0..TRIALS {
            packed.push(&case);
        }
        let offsets: Vec<u64> = (0..TRIALS as u64).collect();
        let (gpu, _) = run_gpu(sampler, &packed, &vec![4242; TRIALS], &offsets)?;
        let mut counter = AcceptanceCounter::new();
        for g in &gpu {
            let g = g
                .as_ref()
                .map_err(|e| anyhow::anyhow!("valid input refused: {e}"))?;
            counter.record(k, g.num_accepted)?;
        }
        let al = counter.mean_acceptance_length().unwrap_or(0.0);
        let want_al = config.expected_length();
        let rates = counter.unconditional_rates();
        let want_rates = config.unconditional_rates();
        let n = TRIALS as f64;
        // 5 standard errors per slot; a slot with rate 0 or 1 must be exact.
        let rates_ok = rates
            .iter()
            .zip(&want_rates)
            .all(|(&r, &w)| (r - w).abs() <= 5.0 * (w * (1.0 - w) / n).sqrt());
        // The brief's tolerance; at 200k steps it is >= 5 standard errors for both configurations.
        let al_limit = 0.02;
        println!(
            "  synthetic {label}: AL {al:.4} (exact {want_al:.4}), unconditional rates {:?} (exact {:?})",
            rates.iter().map(|r| format!("{r:.4}")).collect::<Vec<_>>(),
            want_rates.iter().map(|r| format!("{r:.4}")).collect::<Vec<_>>()
        );
        report.add(
            format!("synthetic {label}: mean AL"),
            format!("{al:.4} vs {want_al:.4}"),
            &format!("+/- {al_limit}"),
            (al - want_al).abs() <= al_limit,
        );
        report.add(
            format!("synthetic {label}: per-position rates"),
            if rates_ok {
                "within 5 SE".into()
            } else {
                "outside 5 SE".into()
            },
            "5 SE, exact at 0/1",
            rates_ok,
        );
        // The accepted-length histogram against the exact enumeration.
        let exact = rule.outcome_distribution(&case.input())?;
        let mut by_len = vec![0.0; k + 1];
        for (o, p) in &exact {
            by_len[o.num_accepted] += p;
        }
        let mut lengths = vec![0u64; k + 1];
        for (a, &c) in counter.accepted_histogram().iter().enumerate() {
            lengths[a.min(k)] += c;
        }
        let p = pooled_p_value(&lengths, &by_len);
        report.add(
            format!("synthetic {label}: accepted-length histogram vs exact"),
            format!("p = {p:.2e}"),
            "> 1e-4",
            p > P_THRESHOLD,
        );
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// 5. Timing

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time_ms(
    stream: &Arc<CudaStream>,
    reps: usize,
    f: &mut dyn FnMut() -> Result<()>,
) -> Result<f64> {
    let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
    for _ in 0..3 {
        f()?;
    }
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let a = stream.record_event(Some(flags))?;
        f()?;
        let b = stream.record_event(Some(flags))?;
        times.push(a.elapsed_ms(&b)? as f64);
    }
    Ok(median(times))
}

fn check_timing(sampler: &mut GpuSampler) -> Result<()> {
    println!(
        "\n[5] timing: CUDA events, median of 50 launches after 3 warm-ups; k = 7, vocab 128256"
    );
    sampler.set_verify_threads(512)?;
    let s = sampler.stream().clone();
    let (vocab, k) = (128256usize, 7usize);
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    println!("verify = the whole GpuSampler::verify call (pre-pass kernels + verify_drafts), 512 threads per sequence unless noted");
    println!("| B | logits_to_probs T=1 (B x 15 rows) us | same, top-k 50 + top-p 0.9 us | row_inv_sums (B x 15 rows) us | verify greedy us | standard us | block us | synthetic 3.78 us | block, one-hot us | standard, 1024 threads us |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for b in 1..=8usize {
        // Target rows P_1..P_8 and draft rows Q_1..Q_7 per sequence from correlated random logits, made
        // into probabilities on the GPU; drafts drawn from the draft rows on the CPU.
        let rows_t = b * (k + 1);
        let rows_q = b * k;
        let logits_t = random_logits(&mut rng, rows_t * vocab, 2.5);
        let mut logits_q = vec![0f32; rows_q * vocab];
        for seq in 0..b {
            for slot in 0..k {
                let src = &logits_t[(seq * (k + 1) + slot) * vocab..][..vocab];
                let dst = &mut logits_q[(seq * k + slot) * vocab..][..vocab];
                for (d, &l) in dst.iter_mut().zip(src) {
                    *d = l + 0.7 * box_muller(&mut rng);
                }
            }
        }
        let one = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        };
        let (dlt, dlq) = (s.clone_htod(&logits_t)?, s.clone_htod(&logits_q)?);
        let pt = sampler.upload_params(&vec![one; rows_t])?;
        let pq = sampler.upload_params(&vec![one; rows_q])?;
        let restricted = sampler.upload_params(&vec![
            SamplingParams {
                temperature: 1.0,
                top_k: 50,
                top_p: 0.9
            };
            rows_t + rows_q
        ])?;
        let mut probs_t = s.alloc_zeros::<f32>(rows_t * vocab)?;
        let mut probs_q = s.alloc_zeros::<f32>(rows_q * vocab)?;
        let mut sums_t = s.alloc_zeros::<f64>(rows_t)?;
        let mut sums_q = s.alloc_zeros::<f64>(rows_q)?;
        let mut status = s.alloc_zeros::<i32>(2 * (rows_t + rows_q))?;
        sampler.probabilities(
            &dlt,
            rows_t,
            vocab,
            vocab,
            &pt,
            &mut probs_t,
            &mut sums_t,
            &mut status,
        )?;
        sampler.probabilities(
            &dlq,
            rows_q,
            vocab,
            vocab,
            &pq,
            &mut probs_q,
            &mut sums_q,
            &mut status,
        )?;
        let host_q = s.clone_dtoh(&probs_q)?;
        let drafts: Vec<u32> = (0..rows_q)
            .map(|r| sample_row(&mut rng, &host_q[r * vocab..(r + 1) * vocab]))
            .collect();
        let tokens = s.clone_htod(&drafts)?;
        let num = s.clone_htod(&vec![k as i32; b])?;
        // Every row at once, as a step would process the target's and the draft's logits.
        let all_logits = s.clone_htod(&[logits_t.clone(), logits_q.clone()].concat())?;
        let rows_all = rows_t + rows_q;
        let all_params = sampler.upload_params(&vec![one; rows_all])?;
        let mut all_probs = s.alloc_zeros::<f32>(rows_all * vocab)?;
        let mut all_sums = s.alloc_zeros::<f64>(rows_all)?;
        let mut all_status = s.alloc_zeros::<i32>(2 * rows_all)?;
        let t_probs = time_ms(&s, 50, &mut || {
            Ok(sampler.probabilities(
                &all_logits,
                rows_all,
                vocab,
                vocab,
                &all_params,
                &mut all_probs,
                &mut all_sums,
                &mut all_status,
            )?)
        })?;
        let t_restricted = time_ms(&s, 50, &mut || {
            Ok(sampler.probabilities(
                &all_logits,
                rows_all,
                vocab,
                vocab,
                &restricted,
                &mut all_probs,
                &mut all_sums,
                &mut all_status,
            )?)
        })?;
        let t_sums = time_ms(&s, 50, &mut || {
            Ok(sampler.row_inv_sums(&all_probs, rows_all, vocab, &mut all_sums)?)
        })?;
        let mut row = format!(
            "| {b} | {:.1} | {:.1} | {:.1} |",
            t_probs * 1e3,
            t_restricted * 1e3,
            t_sums * 1e3
        );
        let rules = [
            (GpuRule::Greedy, false, 512),
            (GpuRule::Standard, false, 512),
            (GpuRule::Block, false, 512),
            (
                GpuRule::Synthetic {
                    conditional_rates: SyntheticAcceptance::from_mean_length(3.78, 7)?
                        .conditional_rates()
                        .to_vec(),
                },
                false,
                512,
            ),
            (GpuRule::Block, true, 512),
            (GpuRule::Standard, false, 1024),
        ];
        for (rule, one_hot, threads) in rules {
            sampler.set_verify_threads(threads)?;
            let rb = sampler.upload_rules(&vec![rule; b], k)?;
            let mut philox = sampler.upload_philox(&vec![7; b], &vec![0; b])?;
            let mut out = VerifyOutput::new(&s, b, k, vocab)?;
            let batch = VerifyBatch {
                batch: b,
                k_max: k,
                vocab,
                target_probs: &probs_t,
                target_inv_sums: &sums_t,
                draft: if one_hot {
                    DraftRows::OneHot
                } else {
                    DraftRows::Full {
                        probs: &probs_q,
                        inv_sums: &sums_q,
                    }
                },
                draft_tokens: &tokens,
                num_drafts: &num,
                rules: &rb,
            };
            let t = time_ms(&s, 50, &mut || {
                Ok(sampler.verify(&batch, &mut philox, &mut out)?)
            })?;
            let results = out.read(&s)?;
            if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
                bail!("timing batch B={b} refused: {e}");
            }
            row.push_str(&format!(" {:.1} |", t * 1e3));
        }
        println!("{row}");
    }
    Ok(())
}

fn main() -> Result<()> {
    let start = Instant::now();
    let dev = GpuDevice::new(0).context("opening the GPU")?;
    let t = Instant::now();
    let mut sampler = GpuSampler::new(dev.stream.clone()).context("compiling sampling.cu")?;
    println!(
        "device {} ({}), sampling.cu NVRTC compile + load {:.2} s",
        dev.name,
        dev.arch,
        t.elapsed().as_secs_f64()
    );
    let mut report = Report::default();
    // A section that errors out is a failed check; the others still run (unless the error left the
    // CUDA context unusable, which the next section then reports too).
    let sections: [(&str, Section); 5] = [
        ("philox", &mut |s, r| check_philox(s, r)),
        ("logits_to_probs", &mut |s, r| check_logits(s, r)),
        ("verify decisions", &mut |s, r| check_decisions(s, r)),
        ("distributions", &mut |s, r| check_distributions(s, r)),
        ("timing", &mut |s, _| check_timing(s)),
    ];
    for (name, section) in sections {
        if let Err(e) = section(&mut sampler, &mut report) {
            println!("  section {name} stopped: {e:#}");
            report.add(
                format!("section {name}"),
                format!("error: {e:#}"),
                "runs",
                false,
            );
        }
    }

    println!("\nsummary ({:.1} s)", start.elapsed().as_secs_f64());
    println!("| check | result | limit | |");
    println!("|---|---|---|---|");
    for c in &report.checks {
        println!(
            "| {} | {} | {} | {} |",
            c.name,
            c.value,
            c.limit,
            if c.ok { "ok" } else { "FAIL" }
        );
    }
    let failed = report.checks.iter().filter(|c| !c.ok).count();
    if failed > 0 {
        bail!("{failed} of {} checks failed", report.checks.len());
    }
    println!("all {} checks passed", report.checks.len());
    Ok(())
}
