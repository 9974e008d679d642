//! The target model behind the scheduler: where its forward runs, where its KV cache lives, and
//! where a verify step's acceptance rule is applied.
//!
//! `CpuTarget` is the reference (`Transformer` + `PagedKvCache`, the verifier's rules on the host,
//! uniforms from each request's ChaCha8 stream). `GpuTarget` (feature `cuda`, `gpu_target.rs`) runs
//! the forward with `GpuTransformer` and the rules with the GPU sampling kernels, whose uniforms come
//! from the request's Philox stream (key `scheduler::philox_seed(seed)`, counter = verify steps so
//! far), so a GPU run is reproducible per seed but samples differently from a CPU run of that seed.
//! The ChaCha8 stream still feeds the drafter and the first token on both.

use crate::config::DecodeBackend;
use crate::scheduler::FALLBACK_CPU_DEVICE;
use crate::EngineError;
use rand_chacha::ChaCha8Rng;
use specula_kernels::sampling::{self, SamplingParams};
use specula_model::{ForwardOutput, ModelConfig, PagedKvCache, SeqId, SeqInput, Transformer};
use specula_verifier::{AcceptanceRule, DraftProbs, VerifyInput, VerifyOutcome};

/// One running sequence's verify step: its drafts and everything the rule needs. The step's target
/// input for this job carries `[pending, drafts]` with `drafts.len() + 1` logits rows.
pub struct VerifyJob<'r> {
    pub drafts: &'r [u32],
    /// q for each draft slot over `allowed` ids, when the drafter has distributions.
    pub draft_probs: Option<&'r [Vec<f32>]>,
    pub sampling: SamplingParams,
    /// Logits past this id are outside the request's vocabulary (`vocab_limit`).
    pub allowed: usize,
    pub rule: &'r AcceptanceRule,
    /// The request's ChaCha8 stream: the uniforms of a host-side rule.
    pub rng: &'r mut ChaCha8Rng,
    /// The request's Philox key and this step's counter: the uniforms of a device-side rule.
    pub philox_seed: u64,
    pub philox_offset: u64,
}

/// What one target step produced.
#[derive(Debug, Clone, Default)]
pub struct TargetStep {
    /// One per verify job, in order.
    pub outcomes: Vec<VerifyOutcome>,
    /// For each input after the verify jobs' inputs (prefill chunks): its last logits row, empty
    /// when it asked for no logits.
    pub last_logits: Vec<Vec<f32>>,
    /// For each tapped layer, `[total new tokens of all inputs, hidden]` (`ForwardOutput::hidden`).
    pub hidden: Vec<Vec<f32>>,
}

/// A target model with its own KV cache for the scheduler's sequences.
pub trait TargetBackend {
    fn config(&self) -> &ModelConfig;

    /// Where the forward runs, for reports: "cpu" or "cuda (GPU name, arch)".
    fn device(&self) -> String;

    /// Which kind of device that is (the scheduler's fallback reasons depend on it).
    fn device_kind(&self) -> crate::Device;

    /// Where verify steps apply the acceptance rule, for reports.
    fn verifier(&self) -> &'static str {
        "host"
    }

    /// Positions a sequence may hold (the model's context unless the backend's cache is smaller).
    fn max_positions(&self) -> usize {
        self.config().max_position_embeddings
    }

    /// Prompt tokens one step may prefill on top of the verify blocks of `max_running` sequences
    /// (a backend whose step has a fixed row capacity lowers the scheduler's chunk to fit it).
    fn max_prefill_tokens_per_step(&self, max_running: usize) -> usize {
        let _ = max_running;
        usize::MAX
    }

    /// Selects the decode path of later steps. The default (the CPU) has only the standard path and
    /// accepts any selection: its steps are then counted as fallbacks (`decode_backend_unavailable`).
    fn set_decode_backend(&mut self, backend: DecodeBackend) -> Result<(), EngineError> {
        let _ = backend;
        Ok(())
    }

    /// Why no step can run `backend` here (the device or the model lacks it), if none can.
    fn decode_backend_unavailable(&self, backend: DecodeBackend) -> Option<&'static str> {
        match backend {
            DecodeBackend::Standard => None,
            DecodeBackend::LatencySpecialized => Some(FALLBACK_CPU_DEVICE),
        }
    }

    /// Why the most recent step ran the standard path although `backend` is selected (a fallback
    /// reason the scheduler counts), None when it ran `backend`.
    fn last_step_fallback(&self, backend: DecodeBackend) -> Option<&'static str> {
        self.decode_backend_unavailable(backend)
    }

    fn add_sequence(&mut self) -> Result<SeqId, EngineError>;
    fn remove_sequence(&mut self, seq: SeqId) -> Result<(), EngineError>;
    fn len(&self, seq: SeqId) -> Result<usize, EngineError>;
    /// Rolls a sequence back to `len` positions (rejected drafts).
    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<(), EngineError>;

    /// One forward with host logits and the outputs of the `tapped` layers.
    fn forward(
        &mut self,
        inputs: &[SeqInput],
        tapped: &[usize],
    ) -> Result<ForwardOutput, EngineError>;

    /// One scheduler step: the forward over `inputs` (the first `jobs.len()` are the jobs' verify
    /// blocks, the rest prefill chunks) and every job's acceptance rule. The default runs the rules
    /// on the host from host logits, with each request's ChaCha8 stream.
    fn step(
        &mut self,
        inputs: &[SeqInput],
        tapped: &[usize],
        jobs: &mut [VerifyJob<'_>],
    ) -> Result<TargetStep, EngineError> {
        let out = self.forward(inputs, tapped)?;
        verify_on_host(out, inputs, jobs)
    }
}

/// A borrowed backend is a backend: one target (a GPU model, uploaded once) can serve several
/// schedulers in turn, each given `Box::new(&mut target)`.
impl<B: TargetBackend + ?Sized> TargetBackend for &mut B {
    fn config(&self) -> &ModelConfig {
        (**self).config()
    }
    fn device(&self) -> String {
        (**self).device()
    }
    fn device_kind(&self) -> crate::Device {
        (**self).device_kind()
    }
    fn verifier(&self) -> &'static str {
        (**self).verifier()
    }
    fn max_positions(&self) -> usize {
        (**self).max_positions()
    }
    fn max_prefill_tokens_per_step(&self, max_running: usize) -> usize {
        (**self).max_prefill_tokens_per_step(max_running)
    }
    fn set_decode_backend(&mut self, backend: DecodeBackend) -> Result<(), EngineError> {
        (**self).set_decode_backend(backend)
    }
    fn decode_backend_unavailable(&self, backend: DecodeBackend) -> Option<&'static str> {
        (**self).decode_backend_unavailable(backend)
    }
    fn last_step_fallback(&self, backend: DecodeBackend) -> Option<&'static str> {
        (**self).last_step_fallback(backend)
    }
    fn add_sequence(&mut self) -> Result<SeqId, EngineError> {
        (**self).add_sequence()
    }
    fn remove_sequence(&mut self, seq: SeqId) -> Result<(), EngineError> {
        (**self).remove_sequence(seq)
    }
    fn len(&self, seq: SeqId) -> Result<usize, EngineError> {
        (**self).len(seq)
    }
    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<(), EngineError> {
        (**self).truncate(seq, len)
    }
    fn forward(
        &mut self,
        inputs: &[SeqInput],
        tapped: &[usize],
    ) -> Result<ForwardOutput, EngineError> {
        (**self).forward(inputs, tapped)
    }
    fn step(
        &mut self,
        inputs: &[SeqInput],
        tapped: &[usize],
        jobs: &mut [VerifyJob<'_>],
    ) -> Result<TargetStep, EngineError> {
        (**self).step(inputs, tapped, jobs)
    }
}

/// The acceptance rules on the host over a forward's host logits (the CPU backend's verify, and the
/// GPU backend's when device verification is off).
pub fn verify_on_host(
    out: ForwardOutput,
    inputs: &[SeqInput],
    jobs: &mut [VerifyJob<'_>],
) -> Result<TargetStep, EngineError> {
    let mut outcomes = Vec::with_capacity(jobs.len());
    for (a, job) in jobs.iter_mut().enumerate() {
        let target_probs: Vec<Vec<f32>> = (0..=job.drafts.len())
            .map(|j| sampling::probabilities(&out.row(a, j)[..job.allowed], &job.sampling))
            .collect::<Result<_, _>>()?;
        let draft_probs = match job.draft_probs {
            Some(q) => DraftProbs::Full(q),
            None => DraftProbs::OneHot,
        };
        let input = VerifyInput {
            draft_tokens: job.drafts,
            draft_probs,
            target_probs: &target_probs,
        };
        outcomes.push(job.rule.verify(&input, job.rng)?);
    }
    let last_logits = (jobs.len()..inputs.len())
        .map(|i| match inputs[i].num_logits {
            0 => Vec::new(),
            n => out.row(i, n - 1).to_vec(),
        })
        .collect();
    Ok(TargetStep {
        outcomes,
        last_logits,
        hidden: out.hidden,
    })
}

/// The reference backend: the CPU forward over a paged KV cache.
pub struct CpuTarget<'a> {
    model: &'a Transformer,
    cache: PagedKvCache,
}

impl<'a> CpuTarget<'a> {
    /// A cache with room for `max_running` sequences at full context.
    pub fn new(model: &'a Transformer, max_running: usize) -> CpuTarget<'a> {
        // Every running sequence can reach the full context plus a partly filled block; the cache
        // grows lazily, so this only caps memory.
        let per_seq = model.config.max_position_embeddings + PagedKvCache::DEFAULT_BLOCK_SIZE;
        CpuTarget {
            model,
            cache: model.new_cache(per_seq.saturating_mul(max_running.max(1))),
        }
    }
}

impl TargetBackend for CpuTarget<'_> {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    fn device(&self) -> String {
        "cpu".into()
    }

    fn device_kind(&self) -> crate::Device {
        crate::Device::Cpu
    }

    fn add_sequence(&mut self) -> Result<SeqId, EngineError> {
        Ok(self.cache.add_sequence())
    }

    fn remove_sequence(&mut self, seq: SeqId) -> Result<(), EngineError> {
        Ok(self.cache.remove_sequence(seq)?)
    }

    fn len(&self, seq: SeqId) -> Result<usize, EngineError> {
        Ok(self.cache.len(seq)?)
    }

    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<(), EngineError> {
        Ok(self.cache.truncate(seq, len)?)
    }

    fn forward(
        &mut self,
        inputs: &[SeqInput],
        tapped: &[usize],
    ) -> Result<ForwardOutput, EngineError> {
        Ok(self.model.forward(&mut self.cache, inputs, tapped)?)
    }
}

/// What a backend is sized for.
#[derive(Debug, Clone)]
pub struct TargetOptions {
    /// Sequences running at once (the scheduler's `max_running`).
    pub max_running: usize,
    /// Prompt tokens prefilled per step (the scheduler's `prefill_chunk_tokens`; the GPU backend
    /// caps it, because its step buffers are allocated up front).
    pub prefill_chunk_tokens: usize,
    /// How many target layers the drafter taps (`Drafter::tapped_target_layers().len()`).
    pub tapped_layers: usize,
    /// GPU only: positions per sequence the device KV pool holds (capped at the model's context).
    /// The pool is allocated up front for `max_running` sequences, so a 128k-context model cannot
    /// simply take its full context; requests are validated against this.
    pub max_positions: usize,
    /// GPU only: apply the acceptance rules on the device (the GPU sampling kernels, one readback
    /// per step; the default) or on the host from logits copied back.
    pub verify_on_device: bool,
    /// GPU only: which step shapes the `latency_specialized` backend runs on the fused kernel.
    pub specialized_shapes: crate::SpecializedShapes,
}

impl Default for TargetOptions {
    fn default() -> Self {
        TargetOptions {
            max_running: 16,
            prefill_chunk_tokens: 256,
            tapped_layers: 0,
            max_positions: 4096,
            verify_on_device: true,
            specialized_shapes: crate::SpecializedShapes::default(),
        }
    }
}

/// The backend for `device`. `--device cuda` without the `cuda` feature, without a driver or
/// without a GPU is a `DeviceUnavailable` error that says what is missing and that `--device cpu`
/// works; never a panic.
pub fn build_target<'a>(
    device: crate::Device,
    model: &'a Transformer,
    opts: &TargetOptions,
) -> Result<Box<dyn TargetBackend + 'a>, EngineError> {
    match device {
        crate::Device::Cpu => Ok(Box::new(CpuTarget::new(model, opts.max_running))),
        crate::Device::Cuda => build_gpu_target(model, opts),
    }
}

/// Checks that `device` can run here without building anything: for `Cuda`, that this build has the
/// GPU backend and the machine a CUDA driver, a GPU and NVRTC. The error says what is missing and
/// that `--device cpu` works. Entry points call it before loading GPU drafters, so the first error a
/// user sees is about the device, not about a drafter.
pub fn check_device(device: crate::Device) -> Result<(), EngineError> {
    match device {
        crate::Device::Cpu => Ok(()),
        crate::Device::Cuda => check_cuda(),
    }
}

#[cfg(feature = "cuda")]
fn check_cuda() -> Result<(), EngineError> {
    use specula_kernels::cuda::{driver_available, nvrtc_available, CudaError};
    let unavailable = |e: CudaError| {
        EngineError::DeviceUnavailable(format!(
            "--device cuda: {e} (the CPU backend, --device cpu, needs no GPU)"
        ))
    };
    // The driver first: cudarc panics on a missing libcuda when asked anything else.
    if !driver_available() {
        return Err(unavailable(CudaError::NoDriver));
    }
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) if n > 0 => {}
        Ok(_) => return Err(unavailable(CudaError::NoDevice)),
        Err(e) => return Err(unavailable(CudaError::Driver(e))),
    }
    if !nvrtc_available() {
        return Err(unavailable(CudaError::NoNvrtc));
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn check_cuda() -> Result<(), EngineError> {
    Err(EngineError::DeviceUnavailable(NO_CUDA_FEATURE.into()))
}

#[cfg(feature = "cuda")]
fn build_gpu_target<'a>(
    model: &'a Transformer,
    opts: &TargetOptions,
) -> Result<Box<dyn TargetBackend + 'a>, EngineError> {
    check_cuda()?;
    let gpu = crate::gpu_target::GpuTarget::new(model, opts).map_err(|e| {
        EngineError::DeviceUnavailable(format!(
            "--device cuda: {e} (the CPU backend, --device cpu, needs no GPU)"
        ))
    })?;
    Ok(Box::new(gpu))
}

#[cfg(not(feature = "cuda"))]
fn build_gpu_target<'a>(
    _model: &'a Transformer,
    _opts: &TargetOptions,
) -> Result<Box<dyn TargetBackend + 'a>, EngineError> {
    Err(EngineError::DeviceUnavailable(NO_CUDA_FEATURE.into()))
}

/// The error of `--device cuda` in a build without the GPU backend.
pub const NO_CUDA_FEATURE: &str = "--device cuda: this build has no GPU backend; rebuild with \
     `cargo build --release --features cuda`, or run on the CPU with --device cpu";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_device_without_a_gpu_backend_is_a_clear_error() {
        let model = specula_model::random::random_transformer(tiny_config(), 1).unwrap();
        match build_target(crate::Device::Cuda, &model, &TargetOptions::default()) {
            // Only possible in a cuda build on a machine with a working GPU.
            Ok(_) if cfg!(feature = "cuda") => {}
            Ok(_) => panic!("--device cuda built a target without the GPU backend"),
            Err(e) => {
                let msg = e.to_string();
                assert!(matches!(e, EngineError::DeviceUnavailable(_)), "{msg}");
                assert!(msg.contains("--device cpu"), "{msg}");
                if cfg!(feature = "cuda") {
                    // No driver (CI): the driver check names the problem before cudarc is touched.
                    assert!(msg.contains("CUDA") || msg.contains("GPU"), "{msg}");
                } else {
                    assert!(msg.contains("--features cuda"), "{msg}");
                }
            }
        }
        let cpu = build_target(crate::Device::Cpu, &model, &TargetOptions::default()).unwrap();
        assert_eq!(cpu.device(), "cpu");
        assert_eq!(cpu.verifier(), "host");
    }

    fn tiny_config() -> ModelConfig {
        let mut c = specula_model::random::preset("llama3.2-1b").unwrap();
        c.hidden_size = 64;
        c.num_layers = 2;
        c.num_heads = 2;
        c.num_kv_heads = 1;
        c.head_dim = 32;
        c.intermediate_size = 96;
        c.vocab_size = 100;
        c.max_position_embeddings = 128;
        c
    }
}
