//! GPU logits processing and acceptance rules: the host side of `kernels/cuda/sampling.cu`.
//!
//! A verify step on the GPU, with no host synchronisation until its one readback:
//!
//! 1. [`GpuSampler::probabilities`] turns the k+1 target logits rows (and the draft's k rows, when the
//!    drafter has a distribution) into probabilities with the CPU semantics of
//!    [`crate::sampling::probabilities`], and writes each row's scale 1 / (f64 row sum), which is how
//!    the verifier reads a row. Rows from elsewhere get their scales from [`GpuSampler::row_inv_sums`].
//! 2. [`GpuSampler::verify`] runs every sequence's acceptance rule (one CTA each) with uniforms from
//!    the sequence's Philox4x32-10 stream ([`crate::philox`]), writes the accepted count and emitted
//!    tokens into a [`VerifyOutput`] and advances the sequence's step counter on the device. Whole-row
//!    work that does not depend on the random decisions (row argmaxes for greedy, the block rule's
//!    residual masses) runs first in kernels spread over many CTAs.
//! 3. [`VerifyOutput::read`] copies the results back: the step's only synchronisation. Invalid input
//!    (a bad row, a token outside the vocabulary, ...) comes back as a typed [`VerifyFailure`] for
//!    that sequence, never as a panic or a wrong token.
//!
//! Uniform consumption follows `AcceptanceRule::verify` of the verifier crate draw for draw, so the CPU
//! verifier fed [`crate::philox::PhiloxStream`]`(seed, offset)` reproduces a GPU step's decisions.

use super::{compile_source, CudaError};
use crate::sampling::{SamplingError, SamplingParams};
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// The kernels `sampling.cu` must export (checked at load, and for every architecture by the compile test).
pub const SAMPLING_KERNELS: &[&str] = &[
    "philox4x32_10_blocks",
    "row_inv_sums",
    "logits_to_probs",
    "row_argmax_chunks",
    "block_residual_masses",
    "verify_drafts",
];

/// The most draft tokens one sequence may carry in a verify step (the block rule keeps p_0..p_k in a
/// fixed-size array in the kernel).
pub const MAX_DRAFTS: usize = 64;

/// `logits_to_probs` is written for exactly this many threads per row (its shared-memory histograms).
const PROBS_THREADS: u32 = 256;
/// Default threads per sequence for `verify_drafts`: enough loads in flight to stream 150k-entry rows
/// from one SM.
const DEFAULT_VERIFY_THREADS: u32 = 512;
/// Layout of a verify output record: status, detail, num_accepted, then k_max + 1 tokens.
const OUT_HEADER: usize = 3;
/// Entries per CTA of the pre-pass kernels (`SPL_CHUNK` in sampling.cu).
const CHUNK: usize = 8192;
/// Threads per CTA of the pre-pass kernels and `row_inv_sums`.
const PASS_THREADS: u32 = 256;

// Status codes, as `#define`d in sampling.cu.
const SPL_OK: i32 = 0;
const SPL_NON_FINITE_LOGIT: i32 = 1;
const SPL_ALL_MASKED: i32 = 2;
const SPL_BAD_BLOCK: i32 = 3;
const SPL_BAD_DRAFT_COUNT: i32 = 10;
const SPL_UNKNOWN_RULE: i32 = 11;
const SPL_TOKEN_OUT_OF_VOCAB: i32 = 12;
const SPL_INVALID_TARGET_ROW: i32 = 13;
const SPL_INVALID_DRAFT_ROW: i32 = 14;
const SPL_ZERO_DRAFT_PROB: i32 = 15;
const SPL_TOO_FEW_RATES: i32 = 16;

/// Failures of a call (shapes, parameters, the driver); per-row and per-sequence problems found on the
/// device are [`RowFailure`] and [`VerifyFailure`] values in the readback instead.
#[derive(Debug, thiserror::Error)]
pub enum GpuSamplingError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    #[error("sampling parameters of row {row}: {source}")]
    Params { row: usize, source: SamplingError },
    #[error("{0}")]
    Shape(String),
    #[error("verify block size must be a power of two in 32..=1024, got {0}")]
    Threads(u32),
    #[error("synthetic acceptance rate {value} for sequence {seq} slot {slot} is not in [0, 1]")]
    Rate { seq: usize, slot: usize, value: f64 },
}

/// Why `logits_to_probs` refused a row (the CPU's [`SamplingError`] cases that depend on the logits).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RowFailure {
    #[error("logit {index} is NaN or +inf: the model produced a non-finite value")]
    NonFiniteLogit { index: usize },
    #[error("every logit is -inf: nothing can be sampled")]
    AllMasked,
    #[error("logits_to_probs ran with {0} threads per row (needs {PROBS_THREADS})")]
    BadBlock(i32),
    #[error("unknown status {code} (detail {detail}): kernel and host disagree on the codes")]
    Unknown { code: i32, detail: i32 },
}

/// Why a sequence's verify step produced no outcome (the verifier's `VerifyError` cases that depend on
/// device data; the step's Philox counter is not advanced then).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyFailure {
    #[error("{drafts} draft tokens is outside 0..={k_max}")]
    BadDraftCount { drafts: i32, k_max: usize },
    #[error("unknown rule id {0}")]
    UnknownRule(i32),
    #[error("draft token at slot {slot} is outside the vocabulary")]
    TokenOutOfVocabulary { slot: usize },
    #[error("target row {row} is not a distribution (non-finite or negative entry, or sum off 1 by more than 1e-3)")]
    InvalidTargetRow { row: usize },
    #[error("draft row {row} is not a distribution (non-finite or negative entry, or sum off 1 by more than 1e-3)")]
    InvalidDraftRow { row: usize },
    #[error(
        "draft token at slot {slot} has draft probability 0: the drafter cannot have drawn it"
    )]
    ZeroDraftProbability { slot: usize },
    #[error("synthetic acceptance has no rate for slot {slot}")]
    TooFewSyntheticRates { slot: usize },
    #[error("unknown status {code} (detail {detail}): kernel and host disagree on the codes")]
    Unknown { code: i32, detail: i32 },
}

/// The acceptance rule of one sequence (`AcceptanceRule` of the verifier crate, which depends on this
/// crate and so cannot be named here).
#[derive(Debug, Clone, PartialEq)]
pub enum GpuRule {
    Greedy,
    Standard,
    Block,
    /// Conditional rates c_1..c_n (`SyntheticAcceptance::conditional_rates`); a step may draft at most n.
    Synthetic {
        conditional_rates: Vec<f64>,
    },
}

impl GpuRule {
    /// The id the kernel switches on.
    pub fn id(&self) -> i32 {
        match self {
            GpuRule::Greedy => 0,
            GpuRule::Standard => 1,
            GpuRule::Block => 2,
            GpuRule::Synthetic { .. } => 3,
        }
    }
}

/// Per-row sampling settings on the device, validated like [`SamplingParams::validate`].
pub struct RowParams {
    temperature: CudaSlice<f32>,
    top_k: CudaSlice<u32>,
    top_p: CudaSlice<f32>,
    rows: usize,
}

impl RowParams {
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// Per-sequence rule ids and synthetic rates ([batch, k_max], NaN past a configuration's last slot).
pub struct RuleBuffers {
    ids: CudaSlice<i32>,
    rates: CudaSlice<f64>,
    batch: usize,
    k_max: usize,
    // Which pre-pass kernels a step needs.
    has_greedy: bool,
    has_block: bool,
}

/// Per-request Philox state on the device: the key (`seed`) and the step counter (`offset`), which
/// every successful verify step advances by one.
pub struct PhiloxState {
    seeds: CudaSlice<u64>,
    offsets: CudaSlice<u64>,
    batch: usize,
}

impl PhiloxState {
    /// The step counters now (synchronises; for tests and checkpoints, not for the step loop).
    pub fn read_offsets(&self, stream: &Arc<CudaStream>) -> Result<Vec<u64>, GpuSamplingError> {
        Ok(stream.clone_dtoh(&self.offsets)?)
    }
}

/// What the draft contributes to a verify step.
pub enum DraftRows<'a> {
    /// The drafter has no distribution: Q_i is one-hot on x_i.
    OneHot,
    /// Q_1..Q_k as [batch, k_max, vocab] probabilities with their scales [batch, k_max].
    Full {
        probs: &'a CudaSlice<f32>,
        inv_sums: &'a CudaSlice<f64>,
    },
}

/// One verify step's device inputs. Sequence b's target rows are rows b*(k_max+1) .. b*(k_max+1)+k_b of
/// `target_probs` (each `vocab` wide), its drafts `draft_tokens[b*k_max ..][..k_b]` with k_b =
/// `num_drafts[b]`.
pub struct VerifyBatch<'a> {
    pub batch: usize,
    pub k_max: usize,
    pub vocab: usize,
    pub target_probs: &'a CudaSlice<f32>,
    pub target_inv_sums: &'a CudaSlice<f64>,
    pub draft: DraftRows<'a>,
    pub draft_tokens: &'a CudaSlice<u32>,
    pub num_drafts: &'a CudaSlice<i32>,
    pub rules: &'a RuleBuffers,
}

/// A sequence's verify result, as `VerifyOutcome` in the verifier crate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuVerifyOutcome {
    pub num_accepted: usize,
    /// The accepted drafts, then the target's token: `num_accepted + 1` tokens.
    pub emitted: Vec<u32>,
}

/// Where `verify_drafts` writes (one record of k_max + 4 ints per sequence), plus the pre-pass
/// kernels' scratch, allocated once so a step allocates nothing.
pub struct VerifyOutput {
    buf: CudaSlice<i32>,
    batch: usize,
    k_max: usize,
    vocab: usize,
    chunks: usize,
    /// [batch * (k_max + 1), chunks]: per-chunk argmax of every target row.
    arg_val: CudaSlice<f32>,
    arg_idx: CudaSlice<i32>,
    /// [batch, max(k_max - 1, 1), chunks]: the block rule's residual masses per chunk.
    z_partial: CudaSlice<f64>,
}

impl VerifyOutput {
    /// Output and scratch for steps of up to `batch` sequences of up to `k_max` drafts over `vocab`.
    pub fn new(
        stream: &Arc<CudaStream>,
        batch: usize,
        k_max: usize,
        vocab: usize,
    ) -> Result<VerifyOutput, GpuSamplingError> {
        if vocab == 0 || batch == 0 {
            return Err(GpuSamplingError::Shape(format!(
                "verify output for {batch} sequences over a vocabulary of {vocab}"
            )));
        }
        let chunks = vocab.div_ceil(CHUNK);
        let rows = batch * (k_max + 1);
        Ok(VerifyOutput {
            buf: stream.alloc_zeros::<i32>(batch * (k_max + OUT_HEADER + 1))?,
            batch,
            k_max,
            vocab,
            chunks,
            arg_val: stream.alloc_zeros::<f32>(rows * chunks)?,
            arg_idx: stream.alloc_zeros::<i32>(rows * chunks)?,
            z_partial: stream
                .alloc_zeros::<f64>(batch * k_max.saturating_sub(1).max(1) * chunks)?,
        })
    }

    /// Copies the step's results to the host: the one synchronisation of a verify step.
    #[allow(clippy::type_complexity)]
    pub fn read(
        &self,
        stream: &Arc<CudaStream>,
    ) -> Result<Vec<Result<GpuVerifyOutcome, VerifyFailure>>, GpuSamplingError> {
        let raw = stream.clone_dtoh(&self.buf)?;
        Ok(self.decode(&raw))
    }

    /// Decodes records copied to the host (for callers that batch the copy with others).
    pub fn decode(&self, raw: &[i32]) -> Vec<Result<GpuVerifyOutcome, VerifyFailure>> {
        let stride = self.k_max + OUT_HEADER + 1;
        raw.chunks(stride)
            .take(self.batch)
            .map(|rec| decode_record(rec, self.k_max))
            .collect()
    }
}

fn decode_record(rec: &[i32], k_max: usize) -> Result<GpuVerifyOutcome, VerifyFailure> {
    let (code, detail) = (rec[0], rec[1]);
    let index = detail.max(0) as usize;
    match code {
        SPL_OK => {
            let accepted = rec[2];
            if accepted < 0 || accepted as usize > k_max {
                return Err(VerifyFailure::Unknown {
                    code,
                    detail: accepted,
                });
            }
            let n = accepted as usize;
            Ok(GpuVerifyOutcome {
                num_accepted: n,
                emitted: rec[OUT_HEADER..OUT_HEADER + n + 1]
                    .iter()
                    .map(|&t| t as u32)
                    .collect(),
            })
        }
        SPL_BAD_DRAFT_COUNT => Err(VerifyFailure::BadDraftCount {
            drafts: detail,
            k_max,
        }),
        SPL_UNKNOWN_RULE => Err(VerifyFailure::UnknownRule(detail)),
        SPL_TOKEN_OUT_OF_VOCAB => Err(VerifyFailure::TokenOutOfVocabulary { slot: index }),
        SPL_INVALID_TARGET_ROW => Err(VerifyFailure::InvalidTargetRow { row: index }),
        SPL_INVALID_DRAFT_ROW => Err(VerifyFailure::InvalidDraftRow { row: index }),
        SPL_ZERO_DRAFT_PROB => Err(VerifyFailure::ZeroDraftProbability { slot: index }),
        SPL_TOO_FEW_RATES => Err(VerifyFailure::TooFewSyntheticRates { slot: index }),
        _ => Err(VerifyFailure::Unknown { code, detail }),
    }
}

fn decode_row_status(code: i32, detail: i32) -> Result<(), RowFailure> {
    match code {
        SPL_OK => Ok(()),
        SPL_NON_FINITE_LOGIT => Err(RowFailure::NonFiniteLogit {
            index: detail.max(0) as usize,
        }),
        SPL_ALL_MASKED => Err(RowFailure::AllMasked),
        SPL_BAD_BLOCK => Err(RowFailure::BadBlock(detail)),
        _ => Err(RowFailure::Unknown { code, detail }),
    }
}

/// Checks that `len` elements can hold `need`, naming the buffer in the error.
fn check_len(what: &str, len: usize, need: usize) -> Result<(), GpuSamplingError> {
    if len < need {
        return Err(GpuSamplingError::Shape(format!(
            "{what}: buffer of {len} elements, need {need}"
        )));
    }
    Ok(())
}

/// A dimension the kernels take as `int`.
fn as_i32(what: &str, value: usize) -> Result<i32, GpuSamplingError> {
    i32::try_from(value).map_err(|_| {
        GpuSamplingError::Shape(format!("{what} = {value} does not fit the kernel's int"))
    })
}

fn grid(what: &str, n: usize) -> Result<u32, GpuSamplingError> {
    if n == 0 {
        return Err(GpuSamplingError::Shape(format!(
            "{what}: nothing to launch"
        )));
    }
    u32::try_from(n)
        .ok()
        .filter(|&g| g <= i32::MAX as u32)
        .ok_or_else(|| GpuSamplingError::Shape(format!("{what}: {n} blocks exceed the grid")))
}

/// The sampling kernels compiled for one device, launching on one stream.
pub struct GpuSampler {
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    philox_fn: CudaFunction,
    sums_fn: CudaFunction,
    probs_fn: CudaFunction,
    argmax_fn: CudaFunction,
    block_fn: CudaFunction,
    verify_fn: CudaFunction,
    verify_threads: u32,
    // Stand-ins for the draft buffers when the drafter is one-hot (the kernel never reads them).
    dummy_f32: CudaSlice<f32>,
    dummy_f64: CudaSlice<f64>,
}

impl GpuSampler {
    /// Compiles `sampling.cu` with NVRTC for the stream's device and loads every kernel.
    pub fn new(stream: Arc<CudaStream>) -> Result<GpuSampler, GpuSamplingError> {
        let ctx = stream.context().clone();
        let (major, minor) = ctx.compute_capability()?;
        let ptx = compile_source("sampling.cu", &format!("sm_{major}{minor}"))?;
        let module = ctx.load_module(ptx)?;
        for k in SAMPLING_KERNELS {
            module.load_function(k)?;
        }
        Ok(GpuSampler {
            philox_fn: module.load_function("philox4x32_10_blocks")?,
            sums_fn: module.load_function("row_inv_sums")?,
            probs_fn: module.load_function("logits_to_probs")?,
            argmax_fn: module.load_function("row_argmax_chunks")?,
            block_fn: module.load_function("block_residual_masses")?,
            verify_fn: module.load_function("verify_drafts")?,
            verify_threads: DEFAULT_VERIFY_THREADS,
            dummy_f32: stream.alloc_zeros::<f32>(1)?,
            dummy_f64: stream.alloc_zeros::<f64>(1)?,
            _module: module,
            stream,
        })
    }

    /// Threads per sequence for `verify` (a power of two in 32..=1024; default 512). Small vocabularies
    /// (tests) run faster with 32; results do not depend on it beyond f64 summation order.
    pub fn set_verify_threads(&mut self, threads: u32) -> Result<(), GpuSamplingError> {
        if !(32..=1024).contains(&threads) || !threads.is_power_of_two() {
            return Err(GpuSamplingError::Threads(threads));
        }
        self.verify_threads = threads;
        Ok(())
    }

    pub fn verify_threads(&self) -> u32 {
        self.verify_threads
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Uploads one [`SamplingParams`] per logits row, refusing invalid ones as the CPU does.
    pub fn upload_params(&self, params: &[SamplingParams]) -> Result<RowParams, GpuSamplingError> {
        for (row, p) in params.iter().enumerate() {
            p.validate()
                .map_err(|source| GpuSamplingError::Params { row, source })?;
        }
        let temperature: Vec<f32> = params.iter().map(|p| p.temperature).collect();
        // top_k >= vocab disables the restriction, so saturating at u32::MAX changes nothing.
        let top_k: Vec<u32> = params
            .iter()
            .map(|p| u32::try_from(p.top_k).unwrap_or(u32::MAX))
            .collect();
        let top_p: Vec<f32> = params.iter().map(|p| p.top_p).collect();
        Ok(RowParams {
            temperature: self.stream.clone_htod(&temperature)?,
            top_k: self.stream.clone_htod(&top_k)?,
            top_p: self.stream.clone_htod(&top_p)?,
            rows: params.len(),
        })
    }

    /// Uploads one rule per sequence for steps of at most `k_max` drafts.
    pub fn upload_rules(
        &self,
        rules: &[GpuRule],
        k_max: usize,
    ) -> Result<RuleBuffers, GpuSamplingError> {
        if k_max > MAX_DRAFTS {
            return Err(GpuSamplingError::Shape(format!(
                "k_max {k_max} exceeds {MAX_DRAFTS}"
            )));
        }
        let ids: Vec<i32> = rules.iter().map(GpuRule::id).collect();
        // NaN marks a slot the configuration does not cover: the kernel reports TooFewSyntheticRates
        // for a step that drafts there, as the CPU rule does.
        let mut rates = vec![f64::NAN; rules.len() * k_max];
        for (seq, rule) in rules.iter().enumerate() {
            if let GpuRule::Synthetic { conditional_rates } = rule {
                for (slot, &value) in conditional_rates.iter().enumerate() {
                    if !(0.0..=1.0).contains(&value) {
                        return Err(GpuSamplingError::Rate { seq, slot, value });
                    }
                    if slot < k_max {
                        rates[seq * k_max + slot] = value;
                    }
                }
            }
        }
        // A zero-length device buffer cannot be passed as a kernel argument; keep one element.
        if rates.is_empty() {
            rates.push(f64::NAN);
        }
        Ok(RuleBuffers {
            ids: self.stream.clone_htod(&ids)?,
            rates: self.stream.clone_htod(&rates)?,
            batch: rules.len(),
            k_max,
            has_greedy: rules.contains(&GpuRule::Greedy),
            has_block: rules.contains(&GpuRule::Block),
        })
    }

    /// Uploads per-request Philox keys and step counters.
    pub fn upload_philox(
        &self,
        seeds: &[u64],
        offsets: &[u64],
    ) -> Result<PhiloxState, GpuSamplingError> {
        if seeds.len() != offsets.len() {
            return Err(GpuSamplingError::Shape(format!(
                "{} seeds but {} offsets",
                seeds.len(),
                offsets.len()
            )));
        }
        Ok(PhiloxState {
            seeds: self.stream.clone_htod(seeds)?,
            offsets: self.stream.clone_htod(offsets)?,
            batch: seeds.len(),
        })
    }

    /// Logits -> probabilities for `rows` rows of `row_stride` entries, of which the first `vocab` are
    /// real (the rest get probability 0). Writes `probs` (same layout), `inv_sums` (one per row, NaN for
    /// a refused row) and `status` (2 ints per row; decode with [`GpuSampler::decode_row_status`]).
    #[allow(clippy::too_many_arguments)]
    pub fn probabilities(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        row_stride: usize,
        vocab: usize,
        params: &RowParams,
        probs: &mut CudaSlice<f32>,
        inv_sums: &mut CudaSlice<f64>,
        status: &mut CudaSlice<i32>,
    ) -> Result<(), GpuSamplingError> {
        if vocab == 0 || vocab > row_stride {
            return Err(GpuSamplingError::Shape(format!(
                "vocab {vocab} must be in 1..={row_stride} (the row stride)"
            )));
        }
        let need = rows
            .checked_mul(row_stride)
            .ok_or_else(|| GpuSamplingError::Shape("rows x row_stride overflows".into()))?;
        check_len("logits", logits.len(), need)?;
        check_len("probs", probs.len(), need)?;
        check_len("inv_sums", inv_sums.len(), rows)?;
        check_len("status", status.len(), 2 * rows)?;
        check_len("params", params.rows, rows)?;
        let (stride_i, vocab_i) = (as_i32("row_stride", row_stride)?, as_i32("vocab", vocab)?);
        let mut b = self.stream.launch_builder(&self.probs_fn);
        b.arg(logits)
            .arg(&stride_i)
            .arg(&vocab_i)
            .arg(&params.temperature)
            .arg(&params.top_k)
            .arg(&params.top_p)
            .arg(probs)
            .arg(inv_sums)
            .arg(status);
        // SAFETY: argument types and order match the kernel; every buffer holds what the kernel
        // indexes (checked above); the block size is the one the kernel's shared memory is sized for.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (grid("logits_to_probs", rows)?, 1, 1),
                block_dim: (PROBS_THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        Ok(())
    }

    /// Decodes a status buffer copied from [`GpuSampler::probabilities`].
    pub fn decode_row_status(raw: &[i32]) -> Vec<Result<(), RowFailure>> {
        raw.chunks(2)
            .map(|s| decode_row_status(s[0], s.get(1).copied().unwrap_or(0)))
            .collect()
    }

    /// Row scales 1 / (f64 sum) for `rows` contiguous rows of `vocab` probabilities, NaN where the row
    /// would fail the verifier's validation (non-finite or negative entry, sum off 1 by more than 1e-3).
    pub fn row_inv_sums(
        &self,
        probs: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        inv_sums: &mut CudaSlice<f64>,
    ) -> Result<(), GpuSamplingError> {
        let need = rows
            .checked_mul(vocab)
            .ok_or_else(|| GpuSamplingError::Shape("rows x vocab overflows".into()))?;
        check_len("probs", probs.len(), need)?;
        check_len("inv_sums", inv_sums.len(), rows)?;
        let vocab_i = as_i32("vocab", vocab)?;
        let mut b = self.stream.launch_builder(&self.sums_fn);
        b.arg(probs).arg(&vocab_i).arg(inv_sums);
        // SAFETY: argument types and order match the kernel; the buffers hold rows x vocab and rows.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (grid("row_inv_sums", rows)?, 1, 1),
                block_dim: (PASS_THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        Ok(())
    }

    /// Runs every sequence's acceptance rule; results land in `out`, and `philox`'s step counters
    /// advance by one for every sequence that verified. Queues up to three kernels on the stream
    /// (chunked row argmaxes if a sequence is greedy, the block rule's residual masses if one uses it,
    /// then `verify_drafts`) and returns without waiting.
    pub fn verify(
        &self,
        batch: &VerifyBatch,
        philox: &mut PhiloxState,
        out: &mut VerifyOutput,
    ) -> Result<(), GpuSamplingError> {
        let (n, k_max, vocab) = (batch.batch, batch.k_max, batch.vocab);
        if vocab == 0 {
            return Err(GpuSamplingError::Shape("empty vocabulary".into()));
        }
        if k_max > MAX_DRAFTS {
            return Err(GpuSamplingError::Shape(format!(
                "k_max {k_max} exceeds {MAX_DRAFTS}"
            )));
        }
        if batch.rules.k_max != k_max || out.k_max != k_max || out.vocab != vocab {
            return Err(GpuSamplingError::Shape(format!(
                "k_max {k_max} over vocab {vocab}, but rules were uploaded for k_max {} and the output sized for k_max {} over vocab {}",
                batch.rules.k_max, out.k_max, out.vocab
            )));
        }
        let rows = n * (k_max + 1);
        check_len("target_probs", batch.target_probs.len(), rows * vocab)?;
        check_len("target_inv_sums", batch.target_inv_sums.len(), rows)?;
        check_len("draft_tokens", batch.draft_tokens.len(), n * k_max)?;
        check_len("num_drafts", batch.num_drafts.len(), n)?;
        check_len("rules", batch.rules.batch, n)?;
        check_len("philox", philox.batch, n)?;
        check_len("output", out.batch, n)?;
        let (draft_probs, draft_sums, has) = match batch.draft {
            DraftRows::OneHot => (&self.dummy_f32, &self.dummy_f64, 0i32),
            DraftRows::Full { probs, inv_sums } => {
                check_len("draft_probs", probs.len(), n * k_max * vocab)?;
                check_len("draft_inv_sums", inv_sums.len(), n * k_max)?;
                (probs, inv_sums, 1i32)
            }
        };
        let (k_i, v_i) = (as_i32("k_max", k_max)?, as_i32("vocab", vocab)?);
        let chunks_i = as_i32("chunks", out.chunks)?;
        let pass = |grid_dim: (u32, u32, u32)| LaunchConfig {
            grid_dim,
            block_dim: (PASS_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let grid_y = |what: &str, n: usize| -> Result<u32, GpuSamplingError> {
            u32::try_from(n)
                .ok()
                .filter(|&g| (1..=65535).contains(&g))
                .ok_or_else(|| {
                    GpuSamplingError::Shape(format!("{what}: {n} exceeds the grid's y/z limit"))
                })
        };
        if batch.rules.has_greedy {
            let mut b = self.stream.launch_builder(&self.argmax_fn);
            b.arg(batch.target_probs)
                .arg(&v_i)
                .arg(&chunks_i)
                .arg(&mut out.arg_val)
                .arg(&mut out.arg_idx);
            // SAFETY: argument types and order match the kernel; target_probs holds rows x vocab
            // entries and the scratch rows x chunks (sized by VerifyOutput::new for this shape).
            unsafe { b.launch(pass((grid("row_argmax_chunks", rows * out.chunks)?, 1, 1))) }?;
        }
        if batch.rules.has_block && k_max >= 2 {
            let mut b = self.stream.launch_builder(&self.block_fn);
            b.arg(batch.target_probs)
                .arg(batch.target_inv_sums)
                .arg(draft_probs)
                .arg(draft_sums)
                .arg(&has)
                .arg(batch.draft_tokens)
                .arg(batch.num_drafts)
                .arg(&batch.rules.ids)
                .arg(&k_i)
                .arg(&v_i)
                .arg(&chunks_i)
                .arg(&mut out.z_partial);
            // SAFETY: as for verify_drafts below; z_partial holds batch x (k_max - 1) x chunks.
            unsafe {
                b.launch(pass((
                    grid("block_residual_masses", n * out.chunks)?,
                    grid_y("k_max - 1", k_max - 1)?,
                    1,
                )))
            }?;
        }
        let mut b = self.stream.launch_builder(&self.verify_fn);
        b.arg(batch.target_probs)
            .arg(batch.target_inv_sums)
            .arg(draft_probs)
            .arg(draft_sums)
            .arg(&has)
            .arg(batch.draft_tokens)
            .arg(batch.num_drafts)
            .arg(&batch.rules.ids)
            .arg(&batch.rules.rates)
            .arg(&philox.seeds)
            .arg(&mut philox.offsets)
            .arg(&k_i)
            .arg(&v_i)
            .arg(&chunks_i)
            .arg(&out.arg_val)
            .arg(&out.arg_idx)
            .arg(&out.z_partial)
            .arg(&mut out.buf);
        // SAFETY: argument types and order match the kernel; every buffer holds what the kernel
        // indexes for n sequences of k_max drafts over vocab entries (checked above); the kernel
        // validates the device-side values (counts, tokens, rows) itself.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (grid("verify_drafts", n)?, 1, 1),
                block_dim: (self.verify_threads, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        Ok(())
    }

    /// Runs the raw generator on the GPU (synchronises): Philox4x32-10 of each counter under its key,
    /// for checking the kernel against [`crate::philox::philox4x32_10`].
    pub fn philox_blocks(
        &self,
        counters: &[[u32; 4]],
        keys: &[[u32; 2]],
    ) -> Result<Vec<[u32; 4]>, GpuSamplingError> {
        if counters.len() != keys.len() {
            return Err(GpuSamplingError::Shape(format!(
                "{} counters but {} keys",
                counters.len(),
                keys.len()
            )));
        }
        let n = counters.len();
        let c: Vec<u32> = counters.iter().flatten().copied().collect();
        let k: Vec<u32> = keys.iter().flatten().copied().collect();
        let (dc, dk) = (self.stream.clone_htod(&c)?, self.stream.clone_htod(&k)?);
        let mut dout = self.stream.alloc_zeros::<u32>(4 * n)?;
        let n_i = as_i32("blocks", n)?;
        let mut b = self.stream.launch_builder(&self.philox_fn);
        b.arg(&dc).arg(&dk).arg(&mut dout).arg(&n_i);
        // SAFETY: argument types match; buffers hold 4n, 2n and 4n words.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (grid("philox4x32_10_blocks", n.div_ceil(128))?, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        let out = self.stream.clone_dtoh(&dout)?;
        Ok(out.chunks(4).map(|w| [w[0], w[1], w[2], w[3]]).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_decode_to_outcomes_and_typed_failures() {
        let k_max = 3;
        // status, detail, accepted, tokens (k_max + 1)
        let ok = [0, 0, 2, 7, 8, 9, -1];
        assert_eq!(
            decode_record(&ok, k_max),
            Ok(GpuVerifyOutcome {
                num_accepted: 2,
                emitted: vec![7, 8, 9]
            })
        );
        assert_eq!(
            decode_record(&[SPL_INVALID_TARGET_ROW, 2, 0, 0, 0, 0, 0], k_max),
            Err(VerifyFailure::InvalidTargetRow { row: 2 })
        );
        assert_eq!(
            decode_record(&[SPL_ZERO_DRAFT_PROB, 1, 0, 0, 0, 0, 0], k_max),
            Err(VerifyFailure::ZeroDraftProbability { slot: 1 })
        );
        // An accepted count past k_max is a corrupt record, not a slice panic.
        assert!(matches!(
            decode_record(&[0, 0, 9, 0, 0, 0, 0], k_max),
            Err(VerifyFailure::Unknown { .. })
        ));
        assert!(matches!(
            decode_record(&[99, 5, 0, 0, 0, 0, 0], k_max),
            Err(VerifyFailure::Unknown {
                code: 99,
                detail: 5
            })
        ));
        assert_eq!(
            GpuSampler::decode_row_status(&[0, 0, 1, 17, 2, 0]),
            vec![
                Ok(()),
                Err(RowFailure::NonFiniteLogit { index: 17 }),
                Err(RowFailure::AllMasked)
            ]
        );
    }

    #[test]
    fn rule_ids_match_the_kernel() {
        assert_eq!(GpuRule::Greedy.id(), 0);
        assert_eq!(GpuRule::Standard.id(), 1);
        assert_eq!(GpuRule::Block.id(), 2);
        assert_eq!(
            GpuRule::Synthetic {
                conditional_rates: vec![]
            }
            .id(),
            3
        );
    }
}
