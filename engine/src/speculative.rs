//! The speculative decode loop for a batch of running sequences:
//! draft -> one target forward over [pending token, drafts] per sequence -> accept -> commit the
//! accepted tokens and roll back rejected positions in the target cache (drafters roll back their own
//! state on `commit`) -> emit, stopping on max tokens, stop tokens (exactly where they occur inside an
//! accepted block) and stop strings.

use crate::generate::{
    next_token, validate_request, FinishReason, GenerationOutput, GenerationRequest,
};
use crate::stats::{GenerationStats, LatencySummary, PerPositionAcceptance, SpeculativeStats};
use crate::EngineError;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use specula_drafters::{DraftProposal, DraftRequest, Drafter};
use specula_kernels::sampling;
use specula_model::tokenizer::Tokenizer;
use specula_model::{SeqId, SeqInput, Transformer};
use specula_verifier::{AcceptanceCounter, AcceptanceRule, DraftProbs, VerifyInput};
use std::time::{Duration, Instant};

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
}

pub struct BatchOutput {
    pub outputs: Vec<GenerationOutput>,
    pub run: RunStats,
}

struct Running {
    seq: SeqId,
    rng: ChaCha8Rng,
    /// Emitted but not yet in the target cache.
    pending: u32,
    tokens: Vec<u32>,
    finish: Option<FinishReason>,
    counter: AcceptanceCounter,
    start: Instant,
    emit_times: Vec<Instant>,
    draft_time: Duration,
    verify_time: Duration,
}

/// Appends `t` and reports whether the request is finished.
fn emit(
    r: &mut Running,
    req: &GenerationRequest,
    t: u32,
    now: Instant,
    tokenizer: Option<&Tokenizer>,
) -> bool {
    r.tokens.push(t);
    r.emit_times.push(now);
    if req.stop_token_ids.contains(&t) {
        r.finish = Some(FinishReason::Stop);
    } else if !req.stop_strings.is_empty()
        && stop_string_hit(&r.tokens, &req.stop_strings, tokenizer)
    {
        r.finish = Some(FinishReason::Stop);
    } else if r.tokens.len() >= req.max_new_tokens {
        r.finish = Some(FinishReason::Length);
    }
    r.finish.is_some()
}

fn stop_string_hit(tokens: &[u32], stops: &[String], tokenizer: Option<&Tokenizer>) -> bool {
    let Some(tok) = tokenizer else { return false };
    // A stop string can only newly appear at the end: decode a short tail, not the whole text.
    let tail_tokens = stops.iter().map(|s| s.len()).max().unwrap_or(0) + 8;
    let tail = &tokens[tokens.len().saturating_sub(tail_tokens)..];
    let last = &tokens[tokens.len() - 1..];
    match (
        tok.decode(tail, false),
        tok.decode(&tail[..tail.len() - last.len()], false),
    ) {
        (Ok(text), Ok(before)) => stops
            .iter()
            .any(|s| text.contains(s.as_str()) && !before.contains(s.as_str())),
        _ => false,
    }
}

/// Generates for every request together. With `drafter == None` every step verifies zero drafts
/// (plain decoding through the same loop). `tokenizer` is needed only for stop strings.
pub fn generate_batch(
    target: &Transformer,
    mut drafter: Option<&mut dyn Drafter>,
    rule: &AcceptanceRule,
    requests: &[GenerationRequest],
    tokenizer: Option<&Tokenizer>,
) -> Result<BatchOutput, EngineError> {
    let run_start = Instant::now();
    let c = &target.config;
    for req in requests {
        validate_request(target, req)?;
        if req.num_draft_tokens > 16 {
            return Err(EngineError::InvalidRequest(format!(
                "num_draft_tokens is {}; the supported range is 0..=16",
                req.num_draft_tokens
            )));
        }
    }
    let limit = c.max_position_embeddings;
    let positions: usize = requests
        .iter()
        .map(|r| (r.prompt_ids.len() + r.max_new_tokens + 17).min(limit))
        .sum();
    let mut cache = target.new_cache(positions);
    let mut running: Vec<Running> = Vec::with_capacity(requests.len());
    for req in requests {
        running.push(Running {
            seq: cache.add_sequence(),
            rng: ChaCha8Rng::seed_from_u64(req.seed),
            pending: 0,
            tokens: Vec::new(),
            finish: None,
            counter: AcceptanceCounter::new(),
            start: run_start,
            emit_times: Vec::new(),
            draft_time: Duration::ZERO,
            verify_time: Duration::ZERO,
        });
    }

    // Prefill every prompt in one forward; the first token is sampled as in plain generation.
    let inputs: Vec<SeqInput> = requests
        .iter()
        .zip(&running)
        .map(|(q, r)| SeqInput {
            seq: r.seq,
            tokens: &q.prompt_ids,
            num_logits: 1,
        })
        .collect();
    let out = target.forward(&mut cache, &inputs, &[])?;
    let now = Instant::now();
    for (i, (req, r)) in requests.iter().zip(running.iter_mut()).enumerate() {
        let logits = out.row(i, 0);
        let allowed = req
            .vocab_limit
            .map_or(logits.len(), |v| v.min(logits.len()));
        let t = next_token(&logits[..allowed], &req.sampling, &mut r.rng)?;
        r.pending = t;
        if req.max_new_tokens == 0 {
            r.finish = Some(FinishReason::Length);
            continue;
        }
        emit(r, req, t, now, tokenizer);
        if let Some(d) = drafter.as_deref_mut() {
            let mut committed = req.prompt_ids.clone();
            committed.push(t);
            d.add_sequence(r.seq, &committed)?;
        }
    }

    let mut run_counter = AcceptanceCounter::new();
    let (mut draft_total, mut verify_total) = (Duration::ZERO, Duration::ZERO);
    loop {
        // Sequences still running, and how many drafts each may take this step.
        let mut active = Vec::new();
        for (i, (req, r)) in requests.iter().zip(running.iter_mut()).enumerate() {
            if r.finish.is_some() {
                continue;
            }
            let cached = cache.len(r.seq)?;
            if cached + 1 > limit {
                r.finish = Some(FinishReason::ContextFull);
                continue;
            }
            let remaining = req.max_new_tokens - r.tokens.len();
            let k = req
                .num_draft_tokens
                .min(remaining - 1)
                .min(limit - cached - 1);
            active.push((i, k));
        }
        if active.is_empty() {
            break;
        }

        // Draft.
        let t_draft = Instant::now();
        let mut proposals: Vec<DraftProposal> = vec![DraftProposal::default(); active.len()];
        if let Some(d) = drafter.as_deref_mut() {
            let mut rngs: Vec<(usize, ChaCha8Rng)> = active
                .iter()
                .map(|&(i, _)| (i, running[i].rng.clone()))
                .collect();
            let mut reqs: Vec<DraftRequest> = active
                .iter()
                .zip(rngs.iter_mut())
                .map(|(&(i, k), (_, rng))| DraftRequest {
                    seq: running[i].seq,
                    max_tokens: k,
                    sampling: requests[i].sampling,
                    vocab_limit: requests[i]
                        .vocab_limit
                        .unwrap_or(c.vocab_size)
                        .min(c.vocab_size),
                    uniforms: rng,
                })
                .collect();
            proposals = d.propose(&mut reqs)?;
            drop(reqs);
            for (i, rng) in rngs {
                running[i].rng = rng;
            }
            if proposals.len() != active.len() {
                return Err(EngineError::Drafter(format!(
                    "drafter {} returned {} proposals for {} sequences",
                    d.name(),
                    proposals.len(),
                    active.len()
                )));
            }
        }
        let draft_elapsed = t_draft.elapsed();
        draft_total += draft_elapsed;

        // One target forward over [pending, drafts] for every active sequence.
        let t_verify = Instant::now();
        let mut blocks: Vec<Vec<u32>> = Vec::with_capacity(active.len());
        for (p, &(i, k)) in proposals.iter_mut().zip(&active) {
            p.tokens.truncate(k);
            if let Some(q) = p.probs.as_mut() {
                q.truncate(p.tokens.len());
            }
            let mut b = Vec::with_capacity(p.tokens.len() + 1);
            b.push(running[i].pending);
            b.extend_from_slice(&p.tokens);
            blocks.push(b);
        }
        let starts: Vec<usize> = active
            .iter()
            .map(|&(i, _)| cache.len(running[i].seq))
            .collect::<Result<_, _>>()?;
        let inputs: Vec<SeqInput> = active
            .iter()
            .zip(&blocks)
            .map(|(&(i, _), b)| SeqInput {
                seq: running[i].seq,
                tokens: b,
                num_logits: b.len(),
            })
            .collect();
        let out = target.forward(&mut cache, &inputs, &[])?;
        let now_verified = Instant::now();

        for (a, &(i, _)) in active.iter().enumerate() {
            let req = &requests[i];
            let r = &mut running[i];
            let drafts = &proposals[a].tokens;
            let allowed = req
                .vocab_limit
                .map_or(c.vocab_size, |v| v.min(c.vocab_size));
            let target_probs: Vec<Vec<f32>> = (0..=drafts.len())
                .map(|j| sampling::probabilities(&out.row(a, j)[..allowed], &req.sampling))
                .collect::<Result<_, _>>()?;
            let draft_probs = match &proposals[a].probs {
                Some(q) => DraftProbs::Full(q),
                None => DraftProbs::OneHot,
            };
            let input = VerifyInput {
                draft_tokens: drafts,
                draft_probs,
                target_probs: &target_probs,
            };
            let outcome = rule.verify(&input, &mut r.rng)?;
            r.counter.record(drafts.len(), outcome.num_accepted)?;
            run_counter.record(drafts.len(), outcome.num_accepted)?;
            // Keep [pending, accepted drafts] in the target cache; drop the rejected positions.
            cache.truncate(r.seq, starts[a] + 1 + outcome.num_accepted)?;
            let mut kept = Vec::with_capacity(outcome.emitted.len());
            for &t in &outcome.emitted {
                kept.push(t);
                if emit(r, req, t, now_verified, tokenizer) {
                    break;
                }
            }
            r.pending = *kept.last().expect("a verify step emits at least one token");
            r.draft_time += draft_elapsed;
            r.verify_time += now_verified - t_verify;
            if let Some(d) = drafter.as_deref_mut() {
                d.commit(r.seq, &kept)?;
            }
        }
        verify_total += t_verify.elapsed();
        for &(i, _) in &active {
            if running[i].finish.is_some() {
                if let Some(d) = drafter.as_deref_mut() {
                    d.remove_sequence(running[i].seq)?;
                }
            }
        }
    }

    let wall = run_start.elapsed();
    let mode = acceptance_mode(rule);
    let drafter_name = drafter
        .as_deref()
        .map_or("none".to_string(), |d| d.name().to_string());
    let mut outputs = Vec::with_capacity(requests.len());
    let mut per_user = Vec::new();
    for (req, r) in requests.iter().zip(running) {
        let ttft = r
            .emit_times
            .first()
            .map_or(Duration::ZERO, |t| *t - r.start);
        let last = r.emit_times.last().copied().unwrap_or(r.start);
        let gaps: Vec<Duration> = r.emit_times.windows(2).map(|w| w[1] - w[0]).collect();
        let decode_s = (last - r.start - ttft).as_secs_f64();
        let decode_tps = if decode_s > 0.0 {
            (r.tokens.len() - 1) as f64 / decode_s
        } else {
            0.0
        };
        per_user.push(decode_tps);
        let stats = GenerationStats {
            mode: if drafter_name == "none" {
                "plain".into()
            } else {
                "speculative".into()
            },
            prompt_tokens: req.prompt_ids.len(),
            generated_tokens: r.tokens.len(),
            prefill_ms: ttft.as_secs_f64() * 1e3,
            ttft_ms: ttft.as_secs_f64() * 1e3,
            inter_token_latency: LatencySummary::from_durations(&gaps),
            total_ms: (last - r.start).as_secs_f64() * 1e3,
            decode_tokens_per_s: decode_tps,
            speculative: Some(SpeculativeStats::new(
                mode,
                rule.name(),
                &drafter_name,
                req.num_draft_tokens,
                &r.counter,
                r.draft_time,
                r.verify_time,
            )),
        };
        outputs.push(GenerationOutput {
            token_ids: r.tokens,
            finish_reason: r.finish.unwrap_or(FinishReason::Length),
            stats,
        });
    }
    let mut sorted = per_user.clone();
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
        acceptance_length: run_counter.mean_acceptance_length(),
        num_verify_steps: run_counter.steps(),
        per_position_acceptance: PerPositionAcceptance::from_counter(&run_counter),
        draft_ms: draft_total.as_secs_f64() * 1e3,
        verify_ms: verify_total.as_secs_f64() * 1e3,
    };
    Ok(BatchOutput { outputs, run })
}
