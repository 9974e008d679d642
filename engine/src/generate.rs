//! Plain autoregressive generation: prefill, then one target forward per token.

use crate::stats::{GenerationStats, LatencySummary};
use crate::EngineError;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use specula_kernels::sampling::{self, SamplingParams};
use specula_model::{PagedKvCache, SeqInput, Transformer};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub prompt_ids: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Seeds the request's own random stream: the same seed gives the same tokens.
    pub seed: u64,
    /// Generation stops after emitting any of these (the token is kept in the output).
    pub stop_token_ids: Vec<u32>,
    /// Only ids below this are ever sampled. Checkpoints pad the embedding past the tokenizer's
    /// vocabulary (Qwen2.5: 151936 rows, 151665 tokens); padded ids have no text. None = all.
    pub vocab_limit: Option<usize>,
    /// Generation stops once the text contains any of these (speculative loop; needs a tokenizer).
    pub stop_strings: Vec<String>,
    /// Draft tokens per verify step for this request (0..=16; 0 = plain decoding).
    pub num_draft_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_new_tokens` reached.
    Length,
    /// A stop token was emitted.
    Stop,
    /// The model's context is full.
    ContextFull,
}

#[derive(Debug, Clone)]
pub struct GenerationOutput {
    pub token_ids: Vec<u32>,
    pub finish_reason: FinishReason,
    pub stats: GenerationStats,
}

/// Validates a request against a model before any work is done.
pub fn validate_request(model: &Transformer, req: &GenerationRequest) -> Result<(), EngineError> {
    validate_request_for(&model.config, model.config.max_position_embeddings, req)
}

/// `validate_request` for a model of config `c` whose sequences hold at most `max_positions`
/// positions (a backend's cache can be smaller than the model's context).
pub fn validate_request_for(
    c: &specula_model::ModelConfig,
    max_positions: usize,
    req: &GenerationRequest,
) -> Result<(), EngineError> {
    let context = c.max_position_embeddings.min(max_positions);
    if req.prompt_ids.is_empty() {
        return Err(EngineError::InvalidRequest("the prompt is empty".into()));
    }
    if let Some(&id) = req.prompt_ids.iter().find(|&&t| t as usize >= c.vocab_size) {
        return Err(EngineError::InvalidRequest(format!(
            "prompt token {id} is outside the vocabulary (size {})",
            c.vocab_size
        )));
    }
    if req.prompt_ids.len() >= context {
        return Err(EngineError::InvalidRequest(format!(
            "the prompt has {} tokens; the model's context is {} tokens and one must remain to generate",
            req.prompt_ids.len(),
            context
        )));
    }
    if req.vocab_limit == Some(0) {
        return Err(EngineError::InvalidRequest(
            "vocab_limit is 0: no token could be sampled".into(),
        ));
    }
    req.sampling.validate()?;
    Ok(())
}

/// Samples the next token from `logits` with the request's settings and random stream.
pub fn next_token(
    logits: &[f32],
    params: &SamplingParams,
    rng: &mut ChaCha8Rng,
) -> Result<u32, EngineError> {
    if params.is_greedy() {
        return Ok(sampling::argmax(logits)?);
    }
    let probs = sampling::probabilities(logits, params)?;
    Ok(sampling::sample_from(&probs, rng.random::<f64>()))
}

/// Generates for one request on its own cache. `on_token` sees every token as it is produced
/// (streaming output).
pub fn generate(
    model: &Transformer,
    req: &GenerationRequest,
    mut on_token: impl FnMut(u32),
) -> Result<GenerationOutput, EngineError> {
    validate_request(model, req)?;
    let limit = model.config.max_position_embeddings;
    let start = Instant::now();
    let mut cache: PagedKvCache =
        model.new_cache((req.prompt_ids.len() + req.max_new_tokens).min(limit));
    let seq = cache.add_sequence();
    let mut rng = ChaCha8Rng::seed_from_u64(req.seed);

    let out = model.forward(
        &mut cache,
        &[SeqInput {
            seq,
            tokens: &req.prompt_ids,
            num_logits: 1,
        }],
        &[],
    )?;
    let prefill = start.elapsed();
    let mut tokens = Vec::with_capacity(req.max_new_tokens);
    let mut gaps: Vec<Duration> = Vec::new();
    let mut ttft = Duration::ZERO;
    let mut last = start;
    let mut finish = FinishReason::Length;
    let mut logits = out.row(0, 0).to_vec();
    while tokens.len() < req.max_new_tokens {
        let allowed = req
            .vocab_limit
            .map_or(logits.len(), |v| v.min(logits.len()));
        let t = next_token(&logits[..allowed], &req.sampling, &mut rng)?;
        let now = Instant::now();
        if tokens.is_empty() {
            ttft = now - start;
        } else {
            gaps.push(now - last);
        }
        last = now;
        tokens.push(t);
        on_token(t);
        if req.stop_token_ids.contains(&t) {
            finish = FinishReason::Stop;
            break;
        }
        if tokens.len() == req.max_new_tokens {
            break;
        }
        if req.prompt_ids.len() + tokens.len() >= limit {
            finish = FinishReason::ContextFull;
            break;
        }
        let out = model.forward(
            &mut cache,
            &[SeqInput {
                seq,
                tokens: &[t],
                num_logits: 1,
            }],
            &[],
        )?;
        logits.copy_from_slice(out.row(0, 0));
    }
    let total = last - start;
    let decode_s = (total - ttft).as_secs_f64();
    let stats = GenerationStats {
        mode: "plain".into(),
        prompt_tokens: req.prompt_ids.len(),
        generated_tokens: tokens.len(),
        prefill_ms: prefill.as_secs_f64() * 1e3,
        ttft_ms: ttft.as_secs_f64() * 1e3,
        inter_token_latency: LatencySummary::from_durations(&gaps),
        total_ms: total.as_secs_f64() * 1e3,
        decode_tokens_per_s: if decode_s > 0.0 {
            (tokens.len() - 1) as f64 / decode_s
        } else {
            0.0
        },
        speculative: None,
    };
    Ok(GenerationOutput {
        token_ids: tokens,
        finish_reason: finish,
        stats,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_summary_uses_nearest_rank() {
        let d: Vec<Duration> = (1..=10).map(Duration::from_millis).collect();
        let s = LatencySummary::from_durations(&d);
        assert_eq!((s.median_ms, s.p90_ms), (5.0, 9.0));
    }
}
