//! The speculative configuration in the JSON shape serving engines use
//! (`{"method": "draft_model", "model": PATH, "num_speculative_tokens": 7,
//!   "rejection_sample_method": "standard", "synthetic_acceptance_length": 3.78}`).

use crate::{EngineError, GoldenAcceptance};
use serde::{Deserialize, Serialize};
use specula_verifier::{AcceptanceRule, SyntheticAcceptance};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpeculativeMethod {
    /// No speculation: plain decoding.
    None,
    /// Prompt lookup (n-gram matching in the sequence's own history).
    Ngram,
    /// An independent draft model sharing the target's tokenizer.
    DraftModel,
    /// DSpark parallel block drafter conditioned on target hidden states; `model` is its directory
    /// (DeepSpec layout).
    Dspark,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeConfig {
    pub method: SpeculativeMethod,
    /// Draft model path (method draft_model).
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default = "default_k")]
    pub num_speculative_tokens: usize,
    /// greedy | standard | block | synthetic. Default: greedy at temperature 0, else standard.
    #[serde(default)]
    pub rejection_sample_method: Option<String>,
    #[serde(default)]
    pub synthetic_acceptance_length: Option<f64>,
    /// Unconditional per-position rates (non-increasing), one per draft slot.
    #[serde(default)]
    pub synthetic_acceptance_rates: Option<Vec<f64>>,
    /// A golden acceptance file (natural rates exported from an experiment run) whose unconditional
    /// rates drive the synthetic rule; its k must equal num_speculative_tokens.
    #[serde(default)]
    pub synthetic_acceptance_rates_from: Option<String>,
    #[serde(default = "default_min_n")]
    pub prompt_lookup_min: usize,
    #[serde(default = "default_max_n")]
    pub prompt_lookup_max: usize,
    /// Drafting temperature for sampled requests (greedy ones stay greedy): the drafter samples from
    /// q = softmax(logits / draft_temperature) instead of the request's temperature; 0 drafts greedily
    /// (q one-hot). Lossless either way (the standard and block rules use the q that was sampled
    /// from). Default: the request's temperature. See `specula_drafters::DraftTemperature`.
    #[serde(default)]
    pub draft_temperature: Option<f32>,
}

fn default_k() -> usize {
    5
}
fn default_min_n() -> usize {
    1
}
fn default_max_n() -> usize {
    4
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        SpeculativeConfig {
            method: SpeculativeMethod::None,
            model: None,
            num_speculative_tokens: default_k(),
            rejection_sample_method: None,
            synthetic_acceptance_length: None,
            synthetic_acceptance_rates: None,
            synthetic_acceptance_rates_from: None,
            prompt_lookup_min: default_min_n(),
            prompt_lookup_max: default_max_n(),
            draft_temperature: None,
        }
    }
}

impl SpeculativeConfig {
    pub fn from_json(text: &str) -> Result<SpeculativeConfig, EngineError> {
        serde_json::from_str(text)
            .map_err(|e| EngineError::InvalidRequest(format!("--speculative-config: {e}")))
    }

    /// Draft tokens per step: 0 without speculation.
    pub fn draft_tokens(&self) -> usize {
        if self.method == SpeculativeMethod::None {
            0
        } else {
            self.num_speculative_tokens
        }
    }

    /// Checks the combination and builds the acceptance rule for a given temperature.
    pub fn rule(&self, temperature: f32) -> Result<AcceptanceRule, EngineError> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        let k = self.num_speculative_tokens;
        if self.method != SpeculativeMethod::None && !(1..=16).contains(&k) {
            return bad(format!("num_speculative_tokens must be in 1..=16, got {k}"));
        }
        if self.method == SpeculativeMethod::DraftModel && self.model.is_none() {
            return bad(
                "method draft_model needs a draft model path (\"model\" or --draft PATH)".into(),
            );
        }
        if self.method == SpeculativeMethod::Dspark && self.model.is_none() {
            return bad(
                "method dspark needs the DSpark drafter's directory (\"model\"); only the embedded default target has one built in".into(),
            );
        }
        let has_synthetic_settings = self.synthetic_acceptance_length.is_some()
            || self.synthetic_acceptance_rates.is_some()
            || self.synthetic_acceptance_rates_from.is_some();
        let name = match &self.rejection_sample_method {
            Some(n) => n.as_str(),
            None if has_synthetic_settings => "synthetic",
            None if temperature == 0.0 => "greedy",
            None => "standard",
        };
        if name != "synthetic" && has_synthetic_settings {
            return bad(format!(
                "synthetic acceptance settings given with rejection_sample_method {name:?}"
            ));
        }
        if self.method == SpeculativeMethod::None {
            if name == "synthetic" {
                return bad(
                    "synthetic acceptance needs a drafter (method ngram, draft_model or dspark)"
                        .into(),
                );
            }
            // Zero drafts: the standard rule with k = 0 is exactly plain sampling (greedy at T = 0).
            return Ok(AcceptanceRule::Standard);
        }
        match name {
            "greedy" if temperature != 0.0 => {
                bad(format!("the greedy acceptance rule needs temperature 0 (got {temperature}); use standard or block"))
            }
            "greedy" => Ok(AcceptanceRule::Greedy),
            "standard" => Ok(AcceptanceRule::Standard),
            "block" => Ok(AcceptanceRule::Block),
            "synthetic" => {
                let given = [
                    self.synthetic_acceptance_length.is_some(),
                    self.synthetic_acceptance_rates.is_some(),
                    self.synthetic_acceptance_rates_from.is_some(),
                ];
                if given.iter().filter(|&&g| g).count() > 1 {
                    return bad("give one of synthetic_acceptance_length, synthetic_acceptance_rates, synthetic_acceptance_rates_from".into());
                }
                if let Some(path) = &self.synthetic_acceptance_rates_from {
                    let golden = GoldenAcceptance::load_for(std::path::Path::new(path), k)?;
                    return Ok(AcceptanceRule::Synthetic(
                        SyntheticAcceptance::from_unconditional_rates(&golden.unconditional_rates)?,
                    ));
                }
                let s = match (self.synthetic_acceptance_length, &self.synthetic_acceptance_rates) {
                    (Some(l), None) => SyntheticAcceptance::from_mean_length(l, k)?,
                    (None, Some(r)) if r.len() == k => SyntheticAcceptance::from_unconditional_rates(r)?,
                    (None, Some(r)) => {
                        return bad(format!("{} synthetic acceptance rates for {k} draft tokens", r.len()))
                    }
                    (Some(_), Some(_)) => {
                        return bad("give synthetic_acceptance_length or synthetic_acceptance_rates, not both".into())
                    }
                    (None, None) => {
                        return bad("synthetic acceptance needs synthetic_acceptance_length or synthetic_acceptance_rates".into())
                    }
                };
                Ok(AcceptanceRule::Synthetic(s))
            }
            other => bad(format!("unknown rejection_sample_method {other:?} (greedy, standard, block, synthetic)")),
        }
    }
}

/// Which decode path serves steps (`--additional-config '{"decode_backend": ...}'`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecodeBackend {
    /// The scheduler's step: drafts, one target forward, the acceptance rule.
    #[default]
    Standard,
    /// A decode path tuned for per-user latency: on the GPU, the fused verify kernel
    /// (`specula_model::gpu_fused`) for the steps whose shape it takes and, with `SpecializedShapes::
    /// Measured` (the default), where it timed faster than the standard step. Every other step
    /// (prefill, mixed prefill/verify, too many sequences or tokens, a shape measured slower, an
    /// unsupported model, the CPU device) runs `standard` and is counted as a fallback with its
    /// reason, never silently.
    LatencySpecialized,
}

impl DecodeBackend {
    pub fn name(self) -> &'static str {
        match self {
            DecodeBackend::Standard => "standard",
            DecodeBackend::LatencySpecialized => "latency_specialized",
        }
    }
}

/// Which step shapes `latency_specialized` runs on the fused kernel
/// (`--additional-config '{"specialized_shapes": ...}'`; the fused kernel is slower than the
/// standard step at some shapes, e.g. several tokens per sequence).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpecializedShapes {
    /// Those measured faster fused: the first step of each shape (again each time the longest
    /// cache doubles past 512 keys) times both paths on the device and keeps the faster; the
    /// shapes that lost count as `measured_slower` fallbacks. Selecting the backend then never
    /// costs a shape speed, as far as those measurements tell.
    #[default]
    Measured,
    /// Every shape the fused kernel takes (what parity checks and `bench step` use).
    All,
}

impl SpecializedShapes {
    pub fn name(self) -> &'static str {
        match self {
            SpecializedShapes::Measured => "measured",
            SpecializedShapes::All => "all",
        }
    }
}

/// `--additional-config` JSON (the serving engines' extra settings).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdditionalConfig {
    #[serde(default)]
    pub decode_backend: DecodeBackend,
    #[serde(default)]
    pub specialized_shapes: SpecializedShapes,
}

impl AdditionalConfig {
    /// Parses the JSON object; unknown keys and values are errors that name them.
    pub fn from_json(text: &str) -> Result<AdditionalConfig, EngineError> {
        let bad = |e: String| EngineError::InvalidRequest(format!("--additional-config: {e}"));
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        // serde would read a struct from a JSON array too (fields by position): only an object
        // is a configuration.
        if !value.is_object() {
            return Err(bad(format!(
                "expected a JSON object such as {{\"decode_backend\": \"standard\"}}, got {value}"
            )));
        }
        serde_json::from_value(value).map_err(|e| bad(e.to_string()))
    }
}

/// Where the target model runs (`--device cpu|cuda`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Device {
    /// The CPU reference backend (always built).
    #[default]
    Cpu,
    /// The GPU backend (`GpuTransformer` and the GPU sampling kernels; needs the `cuda` feature, an
    /// NVIDIA driver and NVRTC).
    Cuda,
}

impl Device {
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Device, String> {
        match s.to_ascii_lowercase().as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda),
            other => Err(format!("unknown device {other:?}: use cpu or cuda")),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn additional_config_and_device_parse() {
        assert_eq!(
            AdditionalConfig::from_json(r#"{"decode_backend": "standard"}"#)
                .unwrap()
                .decode_backend,
            DecodeBackend::Standard
        );
        assert_eq!(
            AdditionalConfig::from_json(r#"{"decode_backend": "latency_specialized"}"#)
                .unwrap()
                .decode_backend,
            DecodeBackend::LatencySpecialized
        );
        assert_eq!(
            AdditionalConfig::from_json("{}").unwrap().decode_backend,
            DecodeBackend::Standard
        );
        let e = AdditionalConfig::from_json(r#"{"decode_backend": "turbo"}"#).unwrap_err();
        assert!(e.to_string().contains("--additional-config"), "{e}");
        assert_eq!(
            AdditionalConfig::from_json("{}")
                .unwrap()
                .specialized_shapes,
            SpecializedShapes::Measured
        );
        let all = AdditionalConfig::from_json(
            r#"{"decode_backend": "latency_specialized", "specialized_shapes": "all"}"#,
        )
        .unwrap();
        assert_eq!(all.specialized_shapes, SpecializedShapes::All);
        assert_eq!(all.specialized_shapes.name(), "all");
        let e = AdditionalConfig::from_json(r#"{"specialized_shapes": "some"}"#).unwrap_err();
        assert!(e.to_string().contains("some"), "{e}");
        assert!(AdditionalConfig::from_json(r#"{"decode_backnd": "standard"}"#).is_err());
        assert!(AdditionalConfig::from_json("not json").is_err());
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("CUDA".parse::<Device>().unwrap(), Device::Cuda);
        let e = "tpu".parse::<Device>().unwrap_err();
        assert!(e.contains("cpu or cuda"), "{e}");
        assert_eq!(Device::Cuda.to_string(), "cuda");
    }

    #[test]
    fn parses_the_serving_shape_and_checks_combinations() {
        let c = SpeculativeConfig::from_json(
            r#"{"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 7,
                "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 3.78}"#,
        )
        .unwrap();
        match c.rule(0.0).unwrap() {
            AcceptanceRule::Synthetic(s) => {
                let u = s.unconditional_rates();
                assert_eq!(u.len(), 7);
                assert!((u[2] - 0.78).abs() < 1e-12);
            }
            r => panic!("{}", r.name()),
        }
        assert!(SpeculativeConfig::from_json(r#"{"method": "eagle"}"#).is_err());
        assert!(SpeculativeConfig::from_json(r#"{"method": "ngram", "typo": 1}"#).is_err());
        let ngram = SpeculativeConfig::from_json(r#"{"method": "ngram"}"#).unwrap();
        assert_eq!(
            ngram.rule(0.0).unwrap().name(),
            AcceptanceRule::Greedy.name()
        );
        assert_eq!(
            ngram.rule(0.8).unwrap().name(),
            AcceptanceRule::Standard.name()
        );
        let greedy_hot = SpeculativeConfig {
            rejection_sample_method: Some("greedy".into()),
            ..ngram.clone()
        };
        assert!(greedy_hot.rule(0.8).is_err());
        assert!(SpeculativeConfig {
            num_speculative_tokens: 17,
            ..ngram.clone()
        }
        .rule(0.0)
        .is_err());
        assert!(SpeculativeConfig {
            method: SpeculativeMethod::DraftModel,
            ..ngram.clone()
        }
        .rule(0.0)
        .is_err());
    }
}
