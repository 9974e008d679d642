//! Builds the drafter a `SpeculativeConfig` names, one place for the CLI, the server and the
//! experiment runner, so that every entry point checks the same things (shared vocabulary, DSpark
//! tapped layers inside the target).

use crate::{EngineError, SpeculativeConfig, SpeculativeMethod};
use specula_drafters::{
    check_shared_vocabulary, DSparkDrafter, DSparkModel, DraftTemperature, Drafter, ModelDrafter,
    NgramDrafter,
};
use specula_model::loader::{load, LoadedModel};
use specula_model::WeightDtype;
use std::path::{Path, PathBuf};

/// Where a drafter's network runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DrafterDevice {
    #[default]
    Cpu,
    /// GPU 0 (DSpark and the draft model; needs the crate feature `cuda` and a CUDA driver).
    /// Capacities of the drafter's device state (DSpark's context K/V, the draft model's KV pool):
    /// sequences held at once, and target positions per sequence (DSpark's slot gets room for its
    /// block on top).
    Cuda {
        max_sequences: usize,
        max_context: usize,
    },
}

impl DrafterDevice {
    /// The GPU with the GPU DSpark drafter's default capacities (8 sequences, 4096 positions).
    pub fn cuda() -> DrafterDevice {
        DrafterDevice::Cuda {
            max_sequences: 8,
            max_context: 4096,
        }
    }
}

/// The drafter for `spec` against `target`, or `None` for plain decoding. Draft models are loaded
/// with `dtype`; DSpark checkpoints keep their own dtype (they are small).
pub fn build_drafter(
    spec: &SpeculativeConfig,
    target: &LoadedModel,
    dtype: WeightDtype,
) -> Result<Option<Box<dyn Drafter>>, EngineError> {
    build_drafter_on(spec, target, dtype, DrafterDevice::Cpu)
}

/// `build_drafter` with the drafter's network on `device`. On the GPU, DSpark runs its block pass
/// and Markov loop there (`DSparkDrafter::to_gpu`), an independent draft model its forward and KV
/// cache (`ModelDrafter::to_gpu`); n-gram lookup has no network and stays on the CPU.
pub fn build_drafter_on(
    spec: &SpeculativeConfig,
    target: &LoadedModel,
    dtype: WeightDtype,
    device: DrafterDevice,
) -> Result<Option<Box<dyn Drafter>>, EngineError> {
    let drafter = build_untempered(spec, target, dtype, device)?;
    match (drafter, spec.draft_temperature) {
        (Some(d), Some(t)) => Ok(Some(Box::new(
            DraftTemperature::new(d, t).map_err(|e| EngineError::InvalidRequest(e.to_string()))?,
        ))),
        (d, _) => Ok(d),
    }
}

/// The drafter of `spec` on `device`, before any drafting temperature is applied.
fn build_untempered(
    spec: &SpeculativeConfig,
    target: &LoadedModel,
    dtype: WeightDtype,
    device: DrafterDevice,
) -> Result<Option<Box<dyn Drafter>>, EngineError> {
    if let DrafterDevice::Cuda {
        max_sequences,
        max_context,
    } = device
    {
        return match spec.method {
            SpeculativeMethod::None | SpeculativeMethod::Ngram => {
                build_untempered(spec, target, dtype, DrafterDevice::Cpu)
            }
            SpeculativeMethod::DraftModel => {
                let d = load_draft_model(spec, target, dtype)?;
                Ok(Some(draft_model_on_gpu(d, max_sequences, max_context)?))
            }
            SpeculativeMethod::Dspark => {
                let d = load_dspark_for(&model_path(spec)?, target, spec.num_speculative_tokens)?;
                Ok(Some(dspark_on_gpu(d, max_sequences, max_context)?))
            }
        };
    }
    Ok(match spec.method {
        SpeculativeMethod::None => None,
        SpeculativeMethod::Ngram => Some(Box::new(NgramDrafter::new(
            spec.prompt_lookup_min,
            spec.prompt_lookup_max,
        ))),
        SpeculativeMethod::DraftModel => Some(Box::new(load_draft_model(spec, target, dtype)?)),
        SpeculativeMethod::Dspark => Some(Box::new(load_dspark_for(
            &model_path(spec)?,
            target,
            spec.num_speculative_tokens,
        )?)),
    })
}

/// Loads the draft model of `spec`, refusing one that does not share the target's vocabulary.
fn load_draft_model(
    spec: &SpeculativeConfig,
    target: &LoadedModel,
    dtype: WeightDtype,
) -> Result<ModelDrafter, EngineError> {
    let path = model_path(spec)?;
    let draft = load(&path, dtype).map_err(|e| {
        EngineError::Drafter(format!("loading draft model {}: {e}", path.display()))
    })?;
    check_shared_vocabulary(
        draft.model.config.vocab_size,
        target.model.config.vocab_size,
        draft.tokenizer.as_ref(),
        target.tokenizer.as_ref(),
    )
    .map_err(|e| EngineError::Drafter(format!("draft model {}: {e}", path.display())))?;
    Ok(ModelDrafter::new(draft.model))
}

#[cfg(feature = "cuda")]
fn draft_model_on_gpu(
    d: ModelDrafter,
    max_sequences: usize,
    max_context: usize,
) -> Result<Box<dyn Drafter>, EngineError> {
    let opts = specula_model::gpu::GpuOptions {
        max_sequences,
        max_positions: max_context,
        ..Default::default()
    };
    let d = d
        .to_gpu(opts)
        .map_err(|e| EngineError::Drafter(format!("draft model on the GPU: {e}")))?;
    Ok(Box::new(d))
}

#[cfg(not(feature = "cuda"))]
fn draft_model_on_gpu(
    _: ModelDrafter,
    _: usize,
    _: usize,
) -> Result<Box<dyn Drafter>, EngineError> {
    Err(EngineError::InvalidRequest(NO_CUDA_DRAFTER.into()))
}

fn model_path(spec: &SpeculativeConfig) -> Result<PathBuf, EngineError> {
    spec.model.as_deref().map(PathBuf::from).ok_or_else(|| {
        EngineError::InvalidRequest(format!(
            "method {:?} needs a model path (\"model\")",
            spec.method
        ))
    })
}

#[cfg(feature = "cuda")]
fn dspark_on_gpu(
    d: DSparkDrafter,
    max_sequences: usize,
    max_context: usize,
) -> Result<Box<dyn Drafter>, EngineError> {
    // The device context slot holds the block's own rows after the context rows.
    let opts = specula_drafters::dspark::gpu::GpuDSparkOptions {
        max_sequences,
        max_context: max_context + d.block_size(),
        ..Default::default()
    };
    let d = d
        .on_gpu(opts)
        .map_err(|e| EngineError::Drafter(format!("DSpark drafter on the GPU: {e}")))?;
    Ok(Box::new(d))
}

#[cfg(not(feature = "cuda"))]
fn dspark_on_gpu(_: DSparkDrafter, _: usize, _: usize) -> Result<Box<dyn Drafter>, EngineError> {
    Err(EngineError::InvalidRequest(NO_CUDA_DRAFTER.into()))
}

#[cfg(not(feature = "cuda"))]
const NO_CUDA_DRAFTER: &str = "this build has no CUDA backend (enable the specula-engine feature \
     `cuda`); run the drafter on the CPU";

/// Loads a DSpark drafter directory (`config.json` + `model.safetensors`, DeepSpec layout) for
/// `target`, checking that its draft length covers the requested one.
pub fn load_dspark(dir: &Path, target: &LoadedModel) -> Result<DSparkDrafter, EngineError> {
    let model = DSparkModel::load(dir, &target.model).map_err(|e| {
        EngineError::Drafter(format!("loading DSpark drafter {}: {e}", dir.display()))
    })?;
    Ok(DSparkDrafter::new(model))
}

/// `load_dspark`, refusing a draft length the checkpoint's block cannot cover.
fn load_dspark_for(
    dir: &Path,
    target: &LoadedModel,
    k: usize,
) -> Result<DSparkDrafter, EngineError> {
    let d = load_dspark(dir, target)?;
    if k > d.block_size() {
        return Err(EngineError::InvalidRequest(format!(
            "the DSpark drafter {} drafts blocks of {} tokens; num_speculative_tokens {k} exceeds it",
            dir.display(),
            d.block_size()
        )));
    }
    Ok(d)
}
