//! Per-request timing statistics. Definitions follow `shared/docs/reference.md` section 3:
//! TTFT includes prefill; inter-token latency is the gap between consecutive emitted tokens.

use serde::Serialize;
use std::time::Duration;

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct LatencySummary {
    pub count: usize,
    pub median_ms: f64,
    pub p90_ms: f64,
    pub mean_ms: f64,
}

impl LatencySummary {
    /// Median and P90 by the nearest-rank method on the sorted samples.
    pub fn from_durations(samples: &[Duration]) -> LatencySummary {
        let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        if ms.is_empty() {
            return LatencySummary::default();
        }
        ms.sort_by(f64::total_cmp);
        let rank = |q: f64| ms[((q * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1];
        LatencySummary {
            count: ms.len(),
            median_ms: rank(0.5),
            p90_ms: rank(0.9),
            mean_ms: ms.iter().sum::<f64>() / ms.len() as f64,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct GenerationStats {
    /// "plain" for non-speculative generation.
    pub mode: String,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Time of the prefill forward.
    pub prefill_ms: f64,
    /// Time to first token: prefill plus sampling of the first token.
    pub ttft_ms: f64,
    /// Gaps between consecutive generated tokens (decode steps).
    pub inter_token_latency: LatencySummary,
    /// Wall time from the request start to its last token.
    pub total_ms: f64,
    /// Generated tokens after the first, per second of decode time (decode-only throughput of this
    /// single request).
    pub decode_tokens_per_s: f64,
}
