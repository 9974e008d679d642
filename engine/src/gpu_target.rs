//! The target on the GPU (feature `cuda`): `GpuTransformer` runs the forward over the scheduler's
//! batch, and a verify step's acceptance rules run on the device with the sampling kernels
//! (`specula_kernels::cuda::sampling`), so only the accepted counts and emitted tokens come back.
//!
//! A step with verify jobs, on the device and without host synchronisation until the readback:
//!
//! 1. `forward_on_device` over the verify blocks (first) and the prefill chunks; logits stay in the
//!    model's logits buffer, rows packed in input order; tapped layers in its tap buffer.
//! 2. The jobs' logits rows are the verify kernel's `[jobs, k_max + 1, vocab]` layout already when
//!    every job drafted `k_max` tokens and all share one vocabulary limit (the usual case); otherwise
//!    they are copied device to device into a padded staging buffer, and a job's ids past its own
//!    limit are set to -inf there (so they get probability 0, as the CPU path's `[..allowed]` slice).
//! 3. `logits_to_probs` with each row's request settings, then `verify_drafts` with the request's
//!    Philox stream: key `scheduler::philox_seed(request seed)`, counter = verify steps so far.
//! 4. `VerifyOutput::read`: the step's one readback for the rules. Drafters that tap target layers
//!    (DSpark) also read the step's tapped rows back, because the `Drafter` interface takes host
//!    features; a prompt's last prefill chunk reads its one logits row back for the first token.
//!
//! Draft distributions (draft model, DSpark) come from the drafter on the host; they are uploaded
//! into a `[jobs, k_max, vocab]` buffer (zeros past each row's limit).
//!
//! With `TargetOptions::verify_on_device == false` the logits are copied back and the CPU verifier
//! runs with the request's ChaCha8 stream instead (the reference behaviour; slower for large
//! vocabularies, because k + 1 full rows per sequence cross the bus every step).

use crate::config::{DecodeBackend, SpecializedShapes};
use crate::scheduler::MAX_DRAFT_TOKENS;
use crate::target::{verify_on_host, TargetBackend, TargetOptions, TargetStep, VerifyJob};
use crate::EngineError;
use cudarc::driver::{CudaSlice, CudaStream};
use specula_kernels::cuda::sampling::{
    DraftRows, GpuRule, GpuSampler, GpuSamplingError, VerifyBatch, VerifyFailure, VerifyOutput,
};
use specula_kernels::sampling::SamplingParams;
use specula_model::gpu::fused::{supports_model, FusedShapes, StepBackend, DEVICE_UNSUPPORTED};
use specula_model::gpu::{GpuOptions, GpuSeqInput, GpuTransformer};
use specula_model::{ForwardOutput, ModelConfig, SeqId, SeqInput, Transformer};
use specula_verifier::{AcceptanceRule, VerifyOutcome};
use std::collections::HashMap;
use std::sync::Arc;

/// Logits rows of one verify block at most: the pending token and `MAX_DRAFT_TOKENS` drafts.
const MAX_BLOCK_ROWS: usize = MAX_DRAFT_TOKENS + 1;
/// Prompt rows one GPU step prefills at most on top of the verify blocks (the step's activation
/// buffers are allocated for this at construction).
const MAX_PREFILL_ROWS: usize = 512;

fn gpu_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Gpu(e.to_string())
}

fn sampling_err(e: GpuSamplingError) -> EngineError {
    EngineError::Gpu(format!("GPU sampling kernels: {e}"))
}

/// The verifier crate's rule as the kernel's rule id (and synthetic rates).
pub fn gpu_rule(rule: &AcceptanceRule) -> GpuRule {
    match rule {
        AcceptanceRule::Greedy => GpuRule::Greedy,
        AcceptanceRule::Standard => GpuRule::Standard,
        AcceptanceRule::Block => GpuRule::Block,
        AcceptanceRule::Synthetic(s) => GpuRule::Synthetic {
            conditional_rates: s.conditional_rates().to_vec(),
        },
    }
}

/// Device buffers of the verify path, allocated once for `max_running` blocks of `MAX_BLOCK_ROWS`.
struct VerifyBuffers {
    sampler: GpuSampler,
    /// Padded target logits `[max_running * MAX_BLOCK_ROWS, vocab]` (used when the forward's packed
    /// rows are not already the kernel's layout).
    staging: CudaSlice<f32>,
    probs: CudaSlice<f32>,
    inv_sums: CudaSlice<f64>,
    status: CudaSlice<i32>,
    /// One row of -inf: the source of the vocabulary-limit masks.
    neg_inf: CudaSlice<f32>,
    /// Draft distributions `[max_running * MAX_DRAFT_TOKENS, vocab]` and their scales; allocated on
    /// the first step whose drafter has distributions (n-gram drafting never needs them).
    draft: Option<(CudaSlice<f32>, CudaSlice<f64>)>,
    /// Results and scratch, one per k_max (the kernel's record layout depends on it).
    outputs: HashMap<usize, VerifyOutput>,
}

/// The GPU target backend.
pub struct GpuTarget {
    model: GpuTransformer,
    /// `None`: acceptance rules run on the host from copied-back logits.
    verify: Option<VerifyBuffers>,
    max_running: usize,
    device: String,
}

impl GpuTarget {
    /// Uploads `model` to GPU 0 sized by `opts`. No driver, no GPU, no NVRTC or too little memory is
    /// an error naming the problem (checked before cudarc is touched, which would panic).
    pub fn new(model: &Transformer, opts: &TargetOptions) -> Result<GpuTarget, EngineError> {
        if !specula_kernels::cuda::driver_available() {
            return Err(EngineError::DeviceUnavailable(
                specula_kernels::cuda::CudaError::NoDriver.to_string(),
            ));
        }
        let gpu = GpuTransformer::upload(model, Self::gpu_options(&model.config, opts))
            .map_err(|e| EngineError::Gpu(e.to_string()))?;
        Self::from_model(gpu, opts)
    }

    pub fn model(&self) -> &GpuTransformer {
        &self.model
    }

    fn gpu_inputs<'i>(inputs: &'i [SeqInput<'i>]) -> Result<Vec<GpuSeqInput<'i>>, EngineError> {
        inputs
            .iter()
            .map(|i| {
                Ok(GpuSeqInput {
                    seq: gpu_seq(i.seq)?,
                    tokens: i.tokens,
                    num_logits: i.num_logits,
                })
            })
            .collect()
    }

    /// Host logits rows `first..first + n` of the last step.
    fn read_logits_rows(&self, first: usize, n: usize) -> Result<Vec<f32>, EngineError> {
        let v = self.model.config().vocab_size;
        self.model
            .device
            .stream
            .clone_dtoh(
                &self
                    .model
                    .logits_on_device()
                    .slice(first * v..(first + n) * v),
            )
            .map_err(gpu_err)
    }
}

fn gpu_seq(seq: SeqId) -> Result<usize, EngineError> {
    usize::try_from(seq).map_err(|_| EngineError::InvalidRequest(format!("no GPU sequence {seq}")))
}

impl VerifyBuffers {
    fn new(
        stream: &Arc<CudaStream>,
        max_running: usize,
        vocab: usize,
    ) -> Result<VerifyBuffers, EngineError> {
        let rows = max_running * MAX_BLOCK_ROWS;
        let sampler = GpuSampler::new(stream.clone()).map_err(sampling_err)?;
        Ok(VerifyBuffers {
            sampler,
            staging: stream.alloc_zeros::<f32>(rows * vocab).map_err(gpu_err)?,
            probs: stream.alloc_zeros::<f32>(rows * vocab).map_err(gpu_err)?,
            inv_sums: stream.alloc_zeros::<f64>(rows).map_err(gpu_err)?,
            status: stream.alloc_zeros::<i32>(2 * rows).map_err(gpu_err)?,
            neg_inf: stream
                .clone_htod(&vec![f32::NEG_INFINITY; vocab])
                .map_err(gpu_err)?,
            draft: None,
            outputs: HashMap::new(),
        })
    }
}

impl TargetBackend for GpuTarget {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn device(&self) -> String {
        self.device.clone()
    }

    fn device_kind(&self) -> crate::Device {
        crate::Device::Cuda
    }

    fn verifier(&self) -> &'static str {
        if self.verify.is_some() {
            "device"
        } else {
            "host"
        }
    }

    fn max_positions(&self) -> usize {
        self.model
            .options()
            .max_positions
            .min(self.model.config().max_position_embeddings)
    }

    fn max_prefill_tokens_per_step(&self, max_running: usize) -> usize {
        // The step's rows are allocated for `max_running` full verify blocks plus the prefill
        // rows; a scheduler running fewer sequences may prefill the difference.
        let rows = self.model.options().max_rows;
        rows.saturating_sub(max_running.min(self.max_running) * MAX_BLOCK_ROWS)
    }

    fn set_decode_backend(&mut self, backend: DecodeBackend) -> Result<(), EngineError> {
        let step = match backend {
            DecodeBackend::Standard => StepBackend::Standard,
            DecodeBackend::LatencySpecialized => StepBackend::LatencySpecialized,
        };
        self.model.set_step_backend(step).map_err(|e| {
            EngineError::Gpu(format!(
                "setting up the latency_specialized decode backend: {e}"
            ))
        })
    }

    fn decode_backend_unavailable(&self, backend: DecodeBackend) -> Option<&'static str> {
        match backend {
            DecodeBackend::Standard => None,
            // The model first; then whether the kernel was built (sm_90+, set_decode_backend).
            DecodeBackend::LatencySpecialized => supports_model(self.model.config())
                .err()
                .map(|r| r.kind())
                .or_else(|| {
                    self.model
                        .fused_info()
                        .is_none()
                        .then_some(DEVICE_UNSUPPORTED)
                }),
        }
    }

    fn last_step_fallback(&self, backend: DecodeBackend) -> Option<&'static str> {
        match backend {
            DecodeBackend::Standard => None,
            DecodeBackend::LatencySpecialized => self.model.last_step_fallback(),
        }
    }

    fn add_sequence(&mut self) -> Result<SeqId, EngineError> {
        Ok(self.model.add_sequence()? as SeqId)
    }

    fn remove_sequence(&mut self, seq: SeqId) -> Result<(), EngineError> {
        Ok(self.model.remove_sequence(gpu_seq(seq)?)?)
    }

    fn len(&self, seq: SeqId) -> Result<usize, EngineError> {
        Ok(self.model.seq_len(gpu_seq(seq)?)?)
    }

    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<(), EngineError> {
        Ok(self.model.truncate(gpu_seq(seq)?, len)?)
    }

    fn forward(
        &mut self,
        inputs: &[SeqInput],
        tapped: &[usize],
    ) -> Result<ForwardOutput, EngineError> {
        self.model.reserve_tapped_layers(tapped.len())?;
        let g = Self::gpu_inputs(inputs)?;
        let out = self.model.forward_tapped(&g, tapped)?;
        Ok(ForwardOutput {
            logits: out.logits,
            logits_start: out.logits_start,
            hidden: out.hidden,
            vocab_size: out.vocab_size,
        })
    }

    fn step(
        &mut self,
        inputs: &[SeqInput],
        tapped: &[usize],
        jobs: &mut [VerifyJob<'_>],
    ) -> Result<TargetStep, EngineError> {
        if self.verify.is_none() {
            let out = self.forward(inputs, tapped)?;
            return verify_on_host(out, inputs, jobs);
        }
        if jobs.len() > self.max_running {
            return Err(EngineError::InvalidRequest(format!(
                "{} verify jobs in one step; the GPU backend was built for {}",
                jobs.len(),
                self.max_running
            )));
        }
        if let Some(j) = jobs.iter().find(|j| j.drafts.len() > MAX_DRAFT_TOKENS) {
            return Err(EngineError::InvalidRequest(format!(
                "{} drafts in one verify block; at most {MAX_DRAFT_TOKENS}",
                j.drafts.len()
            )));
        }
        self.model.reserve_tapped_layers(tapped.len())?;
        let g = Self::gpu_inputs(inputs)?;
        self.model.forward_on_device(&g, tapped)?;

        let outcomes = if jobs.is_empty() {
            Vec::new()
        } else {
            self.verify_on_device(jobs)?
        };

        // Prefill chunks that finish a prompt: their one logits row, for the first token.
        let mut last_logits = Vec::with_capacity(inputs.len() - jobs.len());
        let mut row: usize = inputs[..jobs.len()].iter().map(|i| i.num_logits).sum();
        for inp in &inputs[jobs.len()..] {
            if inp.num_logits == 0 {
                last_logits.push(Vec::new());
            } else {
                last_logits.push(self.read_logits_rows(row + inp.num_logits - 1, 1)?);
                row += inp.num_logits;
            }
        }
        let total_rows: usize = inputs.iter().map(|i| i.tokens.len()).sum();
        let hidden = if tapped.is_empty() {
            Vec::new()
        } else {
            self.model.read_tapped(tapped.len(), total_rows)?
        };
        Ok(TargetStep {
            outcomes,
            last_logits,
            hidden,
        })
    }
}

impl GpuTarget {
    /// Steps 2-4 of the module docs for the verify jobs of the step just launched.
    fn verify_on_device(
        &mut self,
        jobs: &mut [VerifyJob<'_>],
    ) -> Result<Vec<VerifyOutcome>, EngineError> {
        let vocab = self.model.config().vocab_size;
        let stream = self.model.device.stream.clone();
        let vb = self.verify.as_mut().expect("checked by the caller");
        let n = jobs.len();
        let k_max = jobs.iter().map(|j| j.drafts.len()).max().unwrap_or(0);
        let block = k_max + 1;
        let allowed: Vec<usize> = jobs.iter().map(|j| j.allowed.clamp(1, vocab)).collect();
        let limit = *allowed.iter().max().expect("n > 0");

        // 2. The target rows in the kernel's layout.
        let packed =
            jobs.iter().all(|j| j.drafts.len() == k_max) && allowed.iter().all(|&a| a == limit);
        if !packed {
            let mut src_row = 0;
            for (b, job) in jobs.iter().enumerate() {
                let rows = job.drafts.len() + 1;
                let src = self
                    .model
                    .logits_on_device()
                    .slice(src_row * vocab..(src_row + rows) * vocab);
                let dst_row = b * block;
                let mut dst = vb
                    .staging
                    .slice_mut(dst_row * vocab..(dst_row + rows) * vocab);
                stream.memcpy_dtod(&src, &mut dst).map_err(gpu_err)?;
                if allowed[b] < limit {
                    for r in dst_row..dst_row + rows {
                        let mut tail = vb
                            .staging
                            .slice_mut(r * vocab + allowed[b]..r * vocab + limit);
                        stream
                            .memcpy_dtod(&vb.neg_inf.slice(..limit - allowed[b]), &mut tail)
                            .map_err(gpu_err)?;
                    }
                }
                src_row += rows;
            }
        }
        let logits = if packed {
            self.model.logits_on_device()
        } else {
            &vb.staging
        };

        // 3. Probabilities with each row's settings, then the rules.
        let rows = n * block;
        let params: Vec<SamplingParams> = jobs
            .iter()
            .flat_map(|j| std::iter::repeat_n(j.sampling, block))
            .collect();
        let params = vb.sampler.upload_params(&params).map_err(sampling_err)?;
        vb.sampler
            .probabilities(
                logits,
                rows,
                vocab,
                limit,
                &params,
                &mut vb.probs,
                &mut vb.inv_sums,
                &mut vb.status,
            )
            .map_err(sampling_err)?;

        // The greedy rule never reads q: a greedy batch skips the upload.
        let has_probs = jobs
            .iter()
            .any(|j| !j.drafts.is_empty() && j.draft_probs.is_some())
            && jobs
                .iter()
                .any(|j| !matches!(j.rule, AcceptanceRule::Greedy));
        if has_probs && vb.draft.is_none() {
            let cap = self.max_running * MAX_DRAFT_TOKENS;
            vb.draft = Some((
                stream.alloc_zeros::<f32>(cap * vocab).map_err(gpu_err)?,
                stream.alloc_zeros::<f64>(cap).map_err(gpu_err)?,
            ));
        }
        if has_probs {
            // [jobs, k_max, vocab], zeros past each row; a job of a drafter without distributions
            // gets one-hot rows, which is what the rules assume for it anyway.
            let mut host = vec![0f32; n * k_max * vocab];
            for (b, job) in jobs.iter().enumerate() {
                for (i, &t) in job.drafts.iter().enumerate() {
                    let dst = &mut host[(b * k_max + i) * vocab..(b * k_max + i + 1) * vocab];
                    match job.draft_probs.and_then(|q| q.get(i)) {
                        Some(q) => {
                            let m = q.len().min(vocab);
                            dst[..m].copy_from_slice(&q[..m]);
                        }
                        // An id outside the vocabulary is reported by the kernel for its token.
                        None if (t as usize) < vocab => dst[t as usize] = 1.0,
                        None => {}
                    }
                }
            }
            let (probs, sums) = vb.draft.as_mut().expect("allocated above");
            stream
                .memcpy_htod(&host, &mut probs.slice_mut(..host.len()))
                .map_err(gpu_err)?;
            vb.sampler
                .row_inv_sums(probs, n * k_max, vocab, sums)
                .map_err(sampling_err)?;
        }

        // cudarc refuses zero-length buffers: k_max = 0 (plain decoding) uploads one dummy token.
        let mut tokens = vec![0u32; (n * k_max).max(1)];
        for (b, job) in jobs.iter().enumerate() {
            tokens[b * k_max..b * k_max + job.drafts.len()].copy_from_slice(job.drafts);
        }
        let tokens = stream.clone_htod(&tokens).map_err(gpu_err)?;
        let num: Vec<i32> = jobs.iter().map(|j| j.drafts.len() as i32).collect();
        let num = stream.clone_htod(&num).map_err(gpu_err)?;
        let rules: Vec<GpuRule> = jobs.iter().map(|j| gpu_rule(j.rule)).collect();
        let rules = vb
            .sampler
            .upload_rules(&rules, k_max)
            .map_err(sampling_err)?;
        let seeds: Vec<u64> = jobs.iter().map(|j| j.philox_seed).collect();
        let offsets: Vec<u64> = jobs.iter().map(|j| j.philox_offset).collect();
        let mut philox = vb
            .sampler
            .upload_philox(&seeds, &offsets)
            .map_err(sampling_err)?;
        let out = match vb.outputs.entry(k_max) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(
                VerifyOutput::new(&stream, self.max_running, k_max, vocab).map_err(sampling_err)?,
            ),
        };
        let draft = match (&vb.draft, has_probs) {
            (Some((probs, inv_sums)), true) => DraftRows::Full { probs, inv_sums },
            _ => DraftRows::OneHot,
        };
        let batch = VerifyBatch {
            batch: n,
            k_max,
            vocab,
            target_probs: &vb.probs,
            target_inv_sums: &vb.inv_sums,
            draft,
            draft_tokens: &tokens,
            num_drafts: &num,
            rules: &rules,
        };
        vb.sampler
            .verify(&batch, &mut philox, out)
            .map_err(sampling_err)?;

        // 4. The readback.
        let results = out.read(&stream).map_err(sampling_err)?;
        let mut outcomes = Vec::with_capacity(n);
        for (b, r) in results.into_iter().take(n).enumerate() {
            match r {
                Ok(o) => outcomes.push(VerifyOutcome {
                    num_accepted: o.num_accepted,
                    emitted: o.emitted,
                }),
                Err(e) => return Err(self.explain_failure(b, block, e)),
            }
        }
        Ok(outcomes)
    }

    /// A sequence's verify failure as an engine error; an invalid target row is traced back to the
    /// logits (`logits_to_probs`'s status) when that is where it came from.
    fn explain_failure(&self, seq: usize, block: usize, e: VerifyFailure) -> EngineError {
        if let VerifyFailure::InvalidTargetRow { row } = e {
            let vb = self.verify.as_ref().expect("device verification");
            let r = seq * block + row;
            let status = self
                .model
                .device
                .stream
                .clone_dtoh(&vb.status.slice(2 * r..2 * r + 2))
                .ok()
                .and_then(|s| GpuSampler::decode_row_status(&s).pop());
            if let Some(Err(row_failure)) = status {
                return EngineError::Gpu(format!(
                    "verify job {seq}, target row {row}: {row_failure}"
                ));
            }
        }
        EngineError::Gpu(format!("verify job {seq}: {e}"))
    }
}

/// A target around a model that is already on the device: uploaded (`new`) or built there directly
/// (seeded random weights, `GpuTransformer::random`, so a real shape needs no host copy of its
/// weights: `specula bench e2e`).
impl GpuTarget {
    /// The capacities of the device model for `opts`: every verify block's rows plus the prefill
    /// rows, and a logits row for each verify row plus one for each prompt that finishes in the step.
    /// A model handed to `from_model` must have been built with at least these.
    pub fn gpu_options(config: &ModelConfig, opts: &TargetOptions) -> GpuOptions {
        let max_running = opts.max_running.max(1);
        let verify_rows = max_running * MAX_BLOCK_ROWS;
        GpuOptions {
            max_sequences: max_running,
            max_positions: opts
                .max_positions
                .min(config.max_position_embeddings)
                .max(1),
            max_rows: verify_rows + opts.prefill_chunk_tokens.clamp(16, MAX_PREFILL_ROWS),
            min_logit_rows: verify_rows + max_running,
        }
    }

    /// The target of `model`, sized by `opts`. An error (never a panic) when the model's capacities
    /// are smaller than `gpu_options(model.config(), opts)`.
    pub fn from_model(
        model: GpuTransformer,
        opts: &TargetOptions,
    ) -> Result<GpuTarget, EngineError> {
        let need = Self::gpu_options(model.config(), opts);
        let have = model.options();
        if have.max_sequences < need.max_sequences
            || have.max_positions < need.max_positions
            || have.max_rows < need.max_rows
            || model.max_logit_rows() < need.min_logit_rows
        {
            return Err(EngineError::InvalidRequest(format!(
                "the GPU model holds {} sequences x {} positions, {} rows and {} logits rows per step; \
                 a target for {} running sequences needs {} x {}, {} and {} (GpuTarget::gpu_options)",
                have.max_sequences,
                have.max_positions,
                have.max_rows,
                model.max_logit_rows(),
                opts.max_running,
                need.max_sequences,
                need.max_positions,
                need.max_rows,
                need.min_logit_rows
            )));
        }
        let max_running = need.max_sequences;
        let vocab = model.config().vocab_size;
        let mut gpu = model;
        gpu.reserve_tapped_layers(opts.tapped_layers)?;
        gpu.set_fused_shapes(match opts.specialized_shapes {
            SpecializedShapes::Measured => FusedShapes::Measured,
            SpecializedShapes::All => FusedShapes::All,
        });
        let device = format!("cuda ({}, {})", gpu.device.name, gpu.device.arch);
        let verify = if opts.verify_on_device {
            Some(VerifyBuffers::new(&gpu.device.stream, max_running, vocab)?)
        } else {
            None
        };
        Ok(GpuTarget {
            model: gpu,
            verify,
            max_running,
            device,
        })
    }
}
