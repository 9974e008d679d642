//! Golden acceptance files: natural per-position acceptance measured by an experiment run
//! (`specula experiment export-golden`), consumed by synthetic runs so that a latency benchmark
//! uses measured acceptance without the drafter's cost or noise.

use crate::EngineError;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Format tag written into every golden file.
pub const GOLDEN_FORMAT: &str = "specula-golden-acceptance/1";

/// The fields a synthetic run needs; the file carries more (config, provenance), kept as JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GoldenAcceptance {
    pub format: String,
    /// Must be "natural": a golden file made from a synthetic run would only echo its settings.
    pub acceptance_mode: String,
    pub num_speculative_tokens: usize,
    /// Unconditional rate per draft slot (slot 1 first), merged exactly from per-step counts.
    pub unconditional_rates: Vec<f64>,
    /// The measured AL (tokens per verify step, bonus included).
    pub acceptance_length: f64,
    pub num_verify_steps: u64,
    pub drafter: String,
    pub acceptance_rule: String,
    pub temperature: f32,
    pub dataset: String,
    /// Everything else (experiment config, model hashes, provenance).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl GoldenAcceptance {
    /// Reads a golden file and checks that it can drive a synthetic run with `k` draft slots.
    pub fn load_for(path: &Path, k: usize) -> Result<GoldenAcceptance, EngineError> {
        let bad =
            |m: String| EngineError::InvalidRequest(format!("golden file {}: {m}", path.display()));
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let golden: GoldenAcceptance = serde_json::from_str(&text)
            .map_err(|e| bad(format!("not a golden acceptance file: {e}")))?;
        if golden.format != GOLDEN_FORMAT {
            return Err(bad(format!(
                "format {:?}, expected {GOLDEN_FORMAT:?}",
                golden.format
            )));
        }
        if golden.acceptance_mode != "natural" {
            return Err(bad(format!(
                "its rates come from a {} run; only natural measurements can drive a synthetic run",
                golden.acceptance_mode
            )));
        }
        if golden.num_speculative_tokens != k {
            return Err(bad(format!(
                "it was measured with k = {} draft tokens but this run drafts {k}; export a golden file for k = {k}",
                golden.num_speculative_tokens
            )));
        }
        if golden.unconditional_rates.len() != k {
            return Err(bad(format!(
                "{} rates for k = {k}",
                golden.unconditional_rates.len()
            )));
        }
        Ok(golden)
    }
}
