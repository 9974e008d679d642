//! Builds the drafter a `SpeculativeConfig` names, one place for the CLI, the server and the
//! experiment runner, so that every entry point checks the same things (shared vocabulary, DSpark
//! tapped layers inside the target).

use crate::{EngineError, SpeculativeConfig, SpeculativeMethod};
use specula_drafters::{
    check_shared_vocabulary, DSparkDrafter, DSparkModel, Drafter, ModelDrafter, NgramDrafter,
};
use specula_model::loader::{load, LoadedModel};
use specula_model::WeightDtype;
use std::path::{Path, PathBuf};

/// The drafter for `spec` against `target`, or `None` for plain decoding. Draft models are loaded
/// with `dtype`; DSpark checkpoints keep their own dtype (they are small).
pub fn build_drafter(
    spec: &SpeculativeConfig,
    target: &LoadedModel,
    dtype: WeightDtype,
) -> Result<Option<Box<dyn Drafter>>, EngineError> {
    let model_path = || -> Result<PathBuf, EngineError> {
        spec.model.as_deref().map(PathBuf::from).ok_or_else(|| {
            EngineError::InvalidRequest(format!(
                "method {:?} needs a model path (\"model\")",
                spec.method
            ))
        })
    };
    Ok(match spec.method {
        SpeculativeMethod::None => None,
        SpeculativeMethod::Ngram => Some(Box::new(NgramDrafter::new(
            spec.prompt_lookup_min,
            spec.prompt_lookup_max,
        ))),
        SpeculativeMethod::DraftModel => {
            let path = model_path()?;
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
            Some(Box::new(ModelDrafter::new(draft.model)))
        }
        SpeculativeMethod::Dspark => Some(Box::new(load_dspark_for(
            &model_path()?,
            target,
            spec.num_speculative_tokens,
        )?)),
    })
}

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
