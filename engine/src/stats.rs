//! Per-request timing statistics. Definitions follow `shared/docs/reference.md` section 3:
//! TTFT includes prefill; inter-token latency is the gap between consecutive emitted tokens.

use serde::Serialize;
use specula_verifier::AcceptanceCounter;
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
    /// Present when the request ran through the speculative loop.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpeculativeStats>,
}

/// Per-position acceptance rates (slot 1 first); see reference.md section 3.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PerPositionAcceptance {
    /// Fraction of verify steps whose accepted prefix reaches slot i.
    pub unconditional: Vec<f64>,
    /// The same, given slot i-1 was reached (None when slot i-1 was never reached).
    pub conditional: Vec<Option<f64>>,
}

impl PerPositionAcceptance {
    pub fn from_counter(c: &AcceptanceCounter) -> Self {
        PerPositionAcceptance {
            unconditional: c.unconditional_rates(),
            conditional: c.conditional_rates(),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SpeculativeStats {
    /// "natural" (the rule decided) or "synthetic" (acceptance forced); never mixed in one report.
    pub acceptance_mode: String,
    pub acceptance_rule: String,
    pub drafter: String,
    pub num_draft_tokens: usize,
    pub num_verify_steps: u64,
    pub drafted_tokens: u64,
    pub accepted_tokens: u64,
    /// AL: tokens emitted per verify step, bonus token included (= 1 + accepted / steps).
    pub acceptance_length: Option<f64>,
    pub per_position_acceptance: PerPositionAcceptance,
    /// Index a: verify steps that accepted exactly a drafts. With `slot_drafted_steps` this
    /// merges exactly across requests (unconditional rate at slot i = steps with a >= i / steps
    /// that drafted slot i).
    pub accepted_histogram: Vec<u64>,
    /// Index i - 1: verify steps that drafted slot i (steps can draft fewer than k).
    pub slot_drafted_steps: Vec<u64>,
    pub draft_ms: f64,
    pub verify_ms: f64,
}

impl SpeculativeStats {
    pub fn new(
        mode: &str,
        rule: &str,
        drafter: &str,
        k: usize,
        c: &AcceptanceCounter,
        draft: Duration,
        verify: Duration,
    ) -> Self {
        SpeculativeStats {
            acceptance_mode: mode.into(),
            acceptance_rule: rule.into(),
            drafter: drafter.into(),
            num_draft_tokens: k,
            num_verify_steps: c.steps(),
            drafted_tokens: c.drafted_tokens(),
            accepted_tokens: c.accepted_tokens(),
            acceptance_length: c.mean_acceptance_length(),
            per_position_acceptance: PerPositionAcceptance::from_counter(c),
            accepted_histogram: c.accepted_histogram().to_vec(),
            slot_drafted_steps: c.slot_drafted_steps().to_vec(),
            draft_ms: draft.as_secs_f64() * 1e3,
            verify_ms: verify.as_secs_f64() * 1e3,
        }
    }
}
