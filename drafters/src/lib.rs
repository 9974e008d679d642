//! Drafters propose tokens for the target to verify. One trait, `Drafter`; implementations:
//! `NgramDrafter` (prompt lookup, no model), `ModelDrafter` (an independent small model sharing the
//! target's tokenizer) and `DSparkDrafter` (a parallel block drafter conditioned on target hidden
//! states).
//!
//! A drafter keeps its own per-sequence state (token history, KV cache). The engine tells it what was
//! committed after each verify step; the drafter rolls back whatever it had speculated past that.

mod draft_temperature;
pub mod dspark;
mod model_drafter;
mod ngram;

pub use draft_temperature::DraftTemperature;
pub use dspark::{DSparkConfig, DSparkDrafter, DSparkModel};
pub use model_drafter::{check_shared_vocabulary, ModelDrafter};
pub use ngram::NgramDrafter;

use specula_kernels::sampling::SamplingParams;
use specula_verifier::UniformSource;

/// Identifies a sequence across the engine, the target cache and every drafter.
pub type SeqKey = u64;

#[derive(Debug, thiserror::Error)]
pub enum DraftError {
    #[error("drafter has no sequence {0}")]
    UnknownSequence(SeqKey),
    #[error("sequence {0} is already registered with the drafter")]
    DuplicateSequence(SeqKey),
    #[error("draft model: {0}")]
    Model(#[from] specula_model::ModelError),
    #[error("draft model sampling: {0}")]
    Sampling(#[from] specula_kernels::sampling::SamplingError),
    #[error("draft model and target do not share a vocabulary: {0}")]
    VocabularyMismatch(String),
    #[error("drafter configuration: {0}")]
    Config(String),
    /// The CUDA backend failed (driver, kernel launch, capacity), or was asked for on a build or a
    /// machine without it.
    #[error("GPU drafter: {0}")]
    Gpu(String),
}

#[cfg(feature = "cuda")]
impl From<specula_kernels::cuda::CudaError> for DraftError {
    fn from(e: specula_kernels::cuda::CudaError) -> Self {
        DraftError::Gpu(e.to_string())
    }
}

/// What one sequence asks of the drafter in one step.
pub struct DraftRequest<'a> {
    pub seq: SeqKey,
    /// Propose at most this many tokens (may be 0).
    pub max_tokens: usize,
    /// The target's sampling settings: a drafter with distributions applies them to its own logits
    /// so that p and q are processed identically.
    pub sampling: SamplingParams,
    /// Only ids below this may be proposed (see `GenerationRequest::vocab_limit`).
    pub vocab_limit: usize,
    /// The request's random stream, for drafters that sample.
    pub uniforms: &'a mut dyn UniformSource,
}

/// Proposed tokens for one sequence, with their draft distributions when the drafter has them
/// (`probs[i]` is q for slot i, over `vocab_limit` ids, already processed with the sampling settings).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DraftProposal {
    pub tokens: Vec<u32>,
    pub probs: Option<Vec<Vec<f32>>>,
}

pub trait Drafter: Send {
    /// Short name for reports ("ngram", "draft_model").
    fn name(&self) -> &str;

    /// Starts tracking a sequence whose committed tokens so far are `tokens` (the prompt, or the
    /// prompt plus tokens emitted before the drafter joined).
    fn add_sequence(&mut self, seq: SeqKey, tokens: &[u32]) -> Result<(), DraftError>;

    fn remove_sequence(&mut self, seq: SeqKey) -> Result<(), DraftError>;

    /// Proposes tokens continuing each sequence's committed tokens. One proposal per request, in order.
    fn propose(
        &mut self,
        requests: &mut [DraftRequest<'_>],
    ) -> Result<Vec<DraftProposal>, DraftError>;

    /// Appends tokens the engine committed (accepted drafts plus the target's token) to a sequence.
    fn commit(&mut self, seq: SeqKey, tokens: &[u32]) -> Result<(), DraftError>;

    /// Target layers whose outputs (HF `hidden_states[l + 1]`) this drafter conditions on, in the
    /// order it concatenates them. Empty (the default): the engine asks the target for nothing.
    fn tapped_target_layers(&self) -> &[usize] {
        &[]
    }

    /// Hands over the tapped layers' outputs for target positions `start..start + n` of a sequence
    /// (`features` is `[n, layers x hidden]`), once those positions are committed to the target's
    /// cache: after prefill (every prompt position) and after each verify step (the previous
    /// anchor plus the accepted drafts). Called only for drafters that tap layers.
    fn append_target_features(
        &mut self,
        seq: SeqKey,
        start: usize,
        features: &[f32],
    ) -> Result<(), DraftError> {
        let _ = (seq, start, features);
        Ok(())
    }
}
