//! The speculative decode loop for a batch of running sequences:
//! draft -> one target forward over [pending token, drafts] per sequence -> accept -> commit the
//! accepted tokens and roll back rejected positions in the target cache (drafters roll back their own
//! state on `commit`) -> emit, stopping on max tokens, stop tokens (exactly where they occur inside an
//! accepted block) and stop strings.

use crate::config::DecodeBackend;
use crate::generate::{GenerationOutput, GenerationRequest};
use crate::scheduler::{Event, Scheduler, SchedulerConfig};
use crate::stats::PerPositionAcceptance;
use crate::target::{CpuTarget, TargetBackend};
use crate::EngineError;
use serde::Serialize;
use specula_drafters::Drafter;
use specula_model::tokenizer::Tokenizer;
use specula_model::Transformer;
use specula_verifier::AcceptanceRule;
use std::collections::BTreeMap;
use std::time::Instant;

/// Whether the accepted lengths came from the rule's real decisions or were forced.
pub fn acceptance_mode(rule: &AcceptanceRule) -> &'static str {
    if matches!(rule, AcceptanceRule::Synthetic(_)) {
        "synthetic"
    } else {
        "natural"
    }
}

/// Run-level report over all requests of a batch.
#[derive(Debug, Clone, Serialize)]
pub struct RunStats {
    pub acceptance_mode: String,
    pub rule: String,
    pub drafter: String,
    pub requests: usize,
    pub generated_tokens: usize,
    pub wall_ms: f64,
    /// All generated tokens / wall time of the run (prefill included).
    pub aggregate_tokens_per_s: f64,
    /// Per-user decode tokens/s: median, and the value 90% of users reach or exceed (the 10th
    /// percentile of speed, i.e. the P90 user experience).
    pub per_user_tokens_per_s_median: f64,
    pub per_user_tokens_per_s_p90: f64,
    pub acceptance_length: Option<f64>,
    pub num_verify_steps: u64,
    pub per_position_acceptance: PerPositionAcceptance,
    pub draft_ms: f64,
    pub verify_ms: f64,
    /// Where the target ran: "cpu" or "cuda (GPU name, arch)".
    pub device: String,
    /// Where the acceptance rules ran: "host" or "device".
    pub verifier: String,
    /// The decode backend asked for (`--additional-config`).
    pub decode_backend: String,
    /// Steps that ran another decode path than the one asked for, by reason.
    pub decode_backend_fallbacks: BTreeMap<String, u64>,
    /// Steps that ran the `latency_specialized` path (0 unless it was asked for).
    pub decode_backend_specialized_steps: u64,
}

pub struct BatchOutput {
    pub outputs: Vec<GenerationOutput>,
    pub run: RunStats,
}

/// Generates for every request together on the CPU backend. With `drafter == None` every step
/// verifies zero drafts (plain decoding through the same loop). `tokenizer` is needed only for stop
/// strings.
pub fn generate_batch(
    target: &Transformer,
    drafter: Option<&mut dyn Drafter>,
    rule: &AcceptanceRule,
    requests: &[GenerationRequest],
    tokenizer: Option<&Tokenizer>,
) -> Result<BatchOutput, EngineError> {
    let cpu = CpuTarget::new(target, requests.len().max(1));
    generate_batch_on(
        Box::new(cpu),
        DecodeBackend::Standard,
        drafter,
        rule,
        requests,
        tokenizer,
    )
}

/// `generate_batch` on any backend (`target::build_target`), with `decode_backend` as configured.
/// The backend must have room for `requests.len()` running sequences.
pub fn generate_batch_on(
    target: Box<dyn TargetBackend + '_>,
    decode_backend: DecodeBackend,
    drafter: Option<&mut dyn Drafter>,
    rule: &AcceptanceRule,
    requests: &[GenerationRequest],
    tokenizer: Option<&Tokenizer>,
) -> Result<BatchOutput, EngineError> {
    let run_start = Instant::now();
    // Everything is admitted at once and each prompt is prefilled in one piece (as far as the
    // backend's step allows), as a static batch.
    let config = SchedulerConfig {
        max_running: requests.len().max(1),
        prefill_chunk_tokens: usize::MAX,
    };
    let drafter_name = drafter
        .as_deref()
        .map_or("none".to_string(), |d| d.name().to_string());
    // Re-borrow so the drafter's lifetime can shrink to the scheduler's (`&mut` is invariant, so the
    // Option cannot be passed through as it is).
    #[allow(clippy::needless_match)]
    let drafter: Option<&mut dyn Drafter> = match drafter {
        Some(d) => Some(d),
        None => None,
    };
    let mut scheduler = Scheduler::with_target(target, drafter, tokenizer, config);
    scheduler.set_decode_backend(decode_backend)?;
    // Validate everything before any work, so a bad request fails the batch without side effects.
    for req in requests {
        scheduler.validate(req)?;
    }
    let mut ids = Vec::with_capacity(requests.len());
    for req in requests {
        ids.push(scheduler.add_request(req.clone(), rule.clone())?);
    }
    let mut finished: Vec<Option<GenerationOutput>> = vec![None; requests.len()];
    while !scheduler.is_idle() {
        for event in scheduler.step()? {
            if let Event::Finished { id, output, .. } = event {
                let slot = ids.iter().position(|&x| x == id).expect("our request");
                finished[slot] = Some(output);
            }
        }
    }
    let outputs: Vec<GenerationOutput> = finished
        .into_iter()
        .map(|o| o.expect("every request finishes before the scheduler is idle"))
        .collect();
    let wall = run_start.elapsed();
    let totals = scheduler.totals().clone();
    let mode = acceptance_mode(rule);
    let mut sorted: Vec<f64> = outputs
        .iter()
        .map(|o| o.stats.decode_tokens_per_s)
        .collect();
    sorted.sort_by(f64::total_cmp);
    let pick = |q: f64| -> f64 {
        if sorted.is_empty() {
            0.0
        } else {
            sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1]
        }
    };
    let generated: usize = outputs.iter().map(|o| o.token_ids.len()).sum();
    let run = RunStats {
        acceptance_mode: mode.into(),
        rule: rule.name().into(),
        drafter: drafter_name,
        requests: requests.len(),
        generated_tokens: generated,
        wall_ms: wall.as_secs_f64() * 1e3,
        aggregate_tokens_per_s: generated as f64 / wall.as_secs_f64(),
        per_user_tokens_per_s_median: pick(0.5),
        per_user_tokens_per_s_p90: pick(0.1),
        acceptance_length: totals.acceptance.mean_acceptance_length(),
        num_verify_steps: totals.acceptance.steps(),
        per_position_acceptance: PerPositionAcceptance::from_counter(&totals.acceptance),
        draft_ms: totals.draft_time.as_secs_f64() * 1e3,
        verify_ms: totals.verify_time.as_secs_f64() * 1e3,
        device: scheduler.device(),
        verifier: scheduler.verifier().into(),
        decode_backend: decode_backend.name().into(),
        decode_backend_fallbacks: totals.decode_backend_fallbacks.clone(),
        decode_backend_specialized_steps: totals.specialized_steps,
    };
    Ok(BatchOutput { outputs, run })
}
