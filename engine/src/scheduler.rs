//! A step-wise speculative scheduler (continuous batching): requests join and leave the running batch
//! between steps. Each `step` runs one target forward over every running sequence's verify block
//! `[pending, drafts]` together with a bounded chunk of newly admitted prompts (chunked prefill), so a
//! long prompt never stalls the running streams for more than one chunk.
//!
//! A request's tokens depend only on its own prompt, settings and seed: the CPU forward is
//! batch-invariant (a position's logits do not depend on the other rows of the forward or on how the
//! prompt was chunked) and every random draw comes from the request's own stream. That is what lets
//! `generate_batch` be a thin wrapper over this scheduler with bit-identical results.
//!
//! The target is a `TargetBackend`: the CPU reference (`CpuTarget`, what `Scheduler::new` builds) or
//! the GPU (`GpuTarget`, feature `cuda`). The scheduler itself is the same for both; only where the
//! forward and the acceptance rule run differs (see `target.rs` for which random stream each uses).

use crate::config::DecodeBackend;
use crate::generate::GenerationRequest;
use crate::generate::{next_token, validate_request_for, FinishReason, GenerationOutput};
use crate::stats::{GenerationStats, LatencySummary, SpeculativeStats};
use crate::target::{CpuTarget, TargetBackend, VerifyJob};
use crate::EngineError;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use specula_drafters::{DraftProposal, DraftRequest, Drafter};
use specula_model::tokenizer::Tokenizer;
use specula_model::{SeqId, SeqInput, Transformer};
use specula_verifier::{AcceptanceCounter, AcceptanceRule};
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// Identifies a request for its whole life in the scheduler.
pub type RequestId = u64;

/// The most draft tokens a request may ask for per verify step.
pub const MAX_DRAFT_TOKENS: usize = 16;

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    /// Requests in the running batch at once; further requests wait in arrival order.
    pub max_running: usize,
    /// Prompt tokens prefilled per step over all admitted requests (at least 1).
    pub prefill_chunk_tokens: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_running: 16,
            prefill_chunk_tokens: 256,
        }
    }
}

/// What a step produced for one request.
// `Finished` is large, but each request produces it once and it is moved, never copied in a loop.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Event {
    /// Tokens emitted this step, in order (stop tokens included, like the final output).
    Tokens { id: RequestId, tokens: Vec<u32> },
    /// The request is done and has left the scheduler.
    Finished {
        id: RequestId,
        output: GenerationOutput,
        /// The request's verify-step record (serving metrics aggregate it exactly).
        acceptance: AcceptanceCounter,
    },
}

/// Totals over every verify step the scheduler has run.
#[derive(Debug, Clone, Default)]
pub struct SchedulerTotals {
    pub acceptance: AcceptanceCounter,
    pub draft_time: Duration,
    pub verify_time: Duration,
    pub steps: u64,
    /// Steps that ran another decode backend than the one configured, by reason (never silent).
    pub decode_backend_fallbacks: BTreeMap<String, u64>,
    /// Steps that ran the configured `latency_specialized` backend (the fused kernel).
    pub specialized_steps: u64,
}
/// Why a `latency_specialized` step ran the standard decode path on the CPU: the fused backend is a
/// GPU backend; the CPU device never has it.
pub const FALLBACK_CPU_DEVICE: &str = "cpu_device";

/// The Philox key of a request's GPU verify uniforms: its seed through SplitMix64, so that the
/// GPU stream of seed s is unrelated to the ChaCha8 stream of seed s (which still feeds the
/// drafter and the first token) and nearby seeds give unrelated keys.
pub fn philox_seed(request_seed: u64) -> u64 {
    let mut z = request_seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct RequestState {
    id: RequestId,
    req: GenerationRequest,
    rule: AcceptanceRule,
    /// Set when the request is admitted to the running batch.
    seq: Option<SeqId>,
    /// Prompt tokens already in the target cache.
    prefilled: usize,
    /// Whether the drafter tracks this sequence (after its first token).
    in_drafter: bool,
    /// Tapped target features of the prompt positions prefilled so far (`[positions, width]`),
    /// kept until the drafter takes the sequence; empty unless the drafter taps target layers.
    prompt_features: Vec<f32>,
    rng: ChaCha8Rng,
    /// Verify steps run so far: the Philox counter of the next one (GPU verification).
    verify_steps: u64,
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

impl RequestState {
    fn decoding(&self) -> bool {
        self.seq.is_some() && self.prefilled == self.req.prompt_ids.len() && self.finish.is_none()
    }
}

/// Owns the target backend (model and cache) and borrows the drafter and tokenizer.
pub struct Scheduler<'a> {
    target: Box<dyn TargetBackend + 'a>,
    drafter: Option<&'a mut dyn Drafter>,
    tokenizer: Option<&'a Tokenizer>,
    config: SchedulerConfig,
    decode_backend: DecodeBackend,
    waiting: VecDeque<RequestState>,
    running: Vec<RequestState>,
    next_id: RequestId,
    totals: SchedulerTotals,
}

impl<'a> Scheduler<'a> {
    /// On the CPU backend. `tokenizer` is needed only for stop strings.
    pub fn new(
        target: &'a Transformer,
        drafter: Option<&'a mut dyn Drafter>,
        tokenizer: Option<&'a Tokenizer>,
        config: SchedulerConfig,
    ) -> Scheduler<'a> {
        let cpu = CpuTarget::new(target, config.max_running.max(1));
        Scheduler::with_target(Box::new(cpu), drafter, tokenizer, config)
    }

    /// On any backend (`target::build_target` makes one for a `Device`).
    pub fn with_target(
        target: Box<dyn TargetBackend + 'a>,
        drafter: Option<&'a mut dyn Drafter>,
        tokenizer: Option<&'a Tokenizer>,
        config: SchedulerConfig,
    ) -> Scheduler<'a> {
        let max_running = config.max_running.max(1);
        let config = SchedulerConfig {
            max_running,
            prefill_chunk_tokens: config
                .prefill_chunk_tokens
                .min(target.max_prefill_tokens_per_step(max_running))
                .max(1),
        };
        Scheduler {
            target,
            drafter,
            tokenizer,
            config,
            decode_backend: DecodeBackend::Standard,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            totals: SchedulerTotals::default(),
        }
    }

    /// The decode path steps should take. With `latency_specialized` each step whose shape the fused
    /// kernel takes (and, by default, timed faster on) runs it (`totals().specialized_steps`); every
    /// other step (prefill, mixed prefill/verify, too many sequences or tokens, a shape measured
    /// slower, a model or device without it) runs the standard path and is counted with its reason
    /// in `totals().decode_backend_fallbacks`. An error when the
    /// target cannot set the backend up (e.g. the fused kernel does not compile or fit).
    pub fn set_decode_backend(&mut self, backend: DecodeBackend) -> Result<(), EngineError> {
        self.target.set_decode_backend(backend)?;
        self.decode_backend = backend;
        Ok(())
    }

    pub fn decode_backend(&self) -> DecodeBackend {
        self.decode_backend
    }

    /// Why no step will run the configured decode backend (device or model), if none will. Steps
    /// that fall back for their shape alone are counted per step, not reported here.
    pub fn fallback_reason(&self) -> Option<&'static str> {
        self.target.decode_backend_unavailable(self.decode_backend)
    }

    /// Where the target runs ("cpu", "cuda (...)").
    pub fn device(&self) -> String {
        self.target.device()
    }

    /// Where acceptance rules run ("host" or "device").
    pub fn verifier(&self) -> &'static str {
        self.target.verifier()
    }

    /// Positions a sequence may hold: the model's context, or less where the backend's cache is
    /// smaller (requests are validated against this).
    pub fn max_positions(&self) -> usize {
        self.target
            .config()
            .max_position_embeddings
            .min(self.target.max_positions())
    }

    /// "none" without a drafter.
    pub fn drafter_name(&self) -> String {
        self.drafter
            .as_deref()
            .map_or("none".to_string(), |d| d.name().to_string())
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    pub fn totals(&self) -> &SchedulerTotals {
        &self.totals
    }

    /// Checks a request without queueing it.
    pub fn validate(&self, req: &GenerationRequest) -> Result<(), EngineError> {
        validate_request_for(self.target.config(), self.target.max_positions(), req)?;
        if req.num_draft_tokens > MAX_DRAFT_TOKENS {
            return Err(EngineError::InvalidRequest(format!(
                "num_draft_tokens is {}; the supported range is 0..={MAX_DRAFT_TOKENS}",
                req.num_draft_tokens
            )));
        }
        Ok(())
    }

    /// Queues a request; it joins the running batch at a step boundary when a slot is free.
    pub fn add_request(
        &mut self,
        req: GenerationRequest,
        rule: AcceptanceRule,
    ) -> Result<RequestId, EngineError> {
        self.validate(&req)?;
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(RequestState {
            id,
            rng: ChaCha8Rng::seed_from_u64(req.seed),
            verify_steps: 0,
            req,
            rule,
            seq: None,
            prefilled: 0,
            in_drafter: false,
            prompt_features: Vec::new(),
            pending: 0,
            tokens: Vec::new(),
            finish: None,
            counter: AcceptanceCounter::new(),
            start: Instant::now(),
            emit_times: Vec::new(),
            draft_time: Duration::ZERO,
            verify_time: Duration::ZERO,
        });
        Ok(id)
    }

    /// Drops a request wherever it is; returns whether it was known. Its cache and drafter state are
    /// freed at once, so the next step runs without it.
    pub fn cancel(&mut self, id: RequestId) -> Result<bool, EngineError> {
        if let Some(i) = self.waiting.iter().position(|r| r.id == id) {
            self.waiting.remove(i);
            return Ok(true);
        }
        if let Some(i) = self.running.iter().position(|r| r.id == id) {
            let r = self.running.remove(i);
            self.release(&r)?;
            return Ok(true);
        }
        Ok(false)
    }

    fn release(&mut self, r: &RequestState) -> Result<(), EngineError> {
        if r.in_drafter {
            if let Some(d) = self.drafter.as_deref_mut() {
                d.remove_sequence(r.seq.expect("a drafted sequence was admitted"))?;
            }
        }
        if let Some(seq) = r.seq {
            self.target.remove_sequence(seq)?;
        }
        Ok(())
    }

    /// Runs one scheduling step: admit waiting requests, draft for decoding sequences, one target
    /// forward over the verify blocks and this step's prefill chunks, accept, emit, retire.
    /// An error here is an engine failure (the forward or a drafter failed), not a request error.
    pub fn step(&mut self) -> Result<Vec<Event>, EngineError> {
        let mut events = Vec::new();
        while self.running.len() < self.config.max_running {
            let Some(mut r) = self.waiting.pop_front() else {
                break;
            };
            r.seq = Some(self.target.add_sequence()?);
            self.running.push(r);
        }
        if self.running.is_empty() {
            return Ok(events);
        }
        let c = self.target.config();
        let limit = c.max_position_embeddings.min(self.target.max_positions());
        let vocab = c.vocab_size;

        // Decoding sequences, and how many drafts each may take this step.
        let mut decode: Vec<(usize, usize)> = Vec::new();
        for (i, r) in self.running.iter_mut().enumerate() {
            if !r.decoding() {
                continue;
            }
            let cached = self.target.len(r.seq.expect("admitted"))?;
            if cached + 1 > limit {
                r.finish = Some(FinishReason::ContextFull);
                continue;
            }
            let remaining = r.req.max_new_tokens - r.tokens.len();
            let k = r
                .req
                .num_draft_tokens
                .min(remaining - 1)
                .min(limit - cached - 1);
            decode.push((i, k));
        }

        // Prefill chunks, in admission order, within this step's token budget.
        let mut prefill: Vec<(usize, usize, usize)> = Vec::new(); // (index, from, to)
        let mut budget = self.config.prefill_chunk_tokens;
        for (i, r) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            let n = r.req.prompt_ids.len();
            if r.finish.is_none() && r.prefilled < n {
                let to = n.min(r.prefilled + budget);
                budget -= to - r.prefilled;
                prefill.push((i, r.prefilled, to));
            }
        }

        // Draft.
        let t_draft = Instant::now();
        let mut proposals: Vec<DraftProposal> = vec![DraftProposal::default(); decode.len()];
        if let (Some(d), false) = (self.drafter.as_deref_mut(), decode.is_empty()) {
            let mut rngs: Vec<ChaCha8Rng> = decode
                .iter()
                .map(|&(i, _)| self.running[i].rng.clone())
                .collect();
            let mut reqs: Vec<DraftRequest> = decode
                .iter()
                .zip(rngs.iter_mut())
                .map(|(&(i, k), rng)| {
                    let r = &self.running[i];
                    DraftRequest {
                        seq: r.seq.expect("admitted"),
                        max_tokens: k,
                        sampling: r.req.sampling,
                        vocab_limit: r.req.vocab_limit.unwrap_or(vocab).min(vocab),
                        uniforms: rng,
                    }
                })
                .collect();
            proposals = d.propose(&mut reqs)?;
            drop(reqs);
            for (&(i, _), rng) in decode.iter().zip(rngs) {
                self.running[i].rng = rng;
            }
            if proposals.len() != decode.len() {
                return Err(EngineError::Drafter(format!(
                    "drafter {} returned {} proposals for {} sequences",
                    d.name(),
                    proposals.len(),
                    decode.len()
                )));
            }
        }
        let draft_elapsed = t_draft.elapsed();
        if !decode.is_empty() {
            self.totals.draft_time += draft_elapsed;
        }

        // One target forward: verify blocks first, then prefill chunks.
        let t_verify = Instant::now();
        let mut blocks: Vec<Vec<u32>> = Vec::with_capacity(decode.len());
        for (p, &(i, k)) in proposals.iter_mut().zip(&decode) {
            p.tokens.truncate(k);
            if let Some(q) = p.probs.as_mut() {
                q.truncate(p.tokens.len());
            }
            let mut b = Vec::with_capacity(p.tokens.len() + 1);
            b.push(self.running[i].pending);
            b.extend_from_slice(&p.tokens);
            blocks.push(b);
        }
        let starts: Vec<usize> = decode
            .iter()
            .map(|&(i, _)| self.target.len(self.running[i].seq.expect("admitted")))
            .collect::<Result<_, _>>()?;
        let mut inputs: Vec<SeqInput> = decode
            .iter()
            .zip(&blocks)
            .map(|(&(i, _), b)| SeqInput {
                seq: self.running[i].seq.expect("admitted"),
                tokens: b,
                num_logits: b.len(),
            })
            .collect();
        for &(i, from, to) in &prefill {
            let r = &self.running[i];
            inputs.push(SeqInput {
                seq: r.seq.expect("admitted"),
                tokens: &r.req.prompt_ids[from..to],
                // Only the last chunk's last position samples the first token.
                num_logits: usize::from(to == r.req.prompt_ids.len()),
            });
        }
        if inputs.is_empty() {
            // Everything running has finished (e.g. context full): retire below.
            return self.retire(events);
        }
        // Target layers the drafter conditions on (DSpark): their outputs come out of this same
        // forward, so drafting on hidden states costs no extra target pass.
        let tapped: Vec<usize> = self
            .drafter
            .as_deref()
            .map(|d| d.tapped_target_layers().to_vec())
            .unwrap_or_default();
        // The verify rules' random streams are taken out of the requests for the step (the inputs
        // borrow the requests' prompts) and put back right after.
        let mut rngs: Vec<ChaCha8Rng> = decode
            .iter()
            .map(|&(i, _)| self.running[i].rng.clone())
            .collect();
        let mut jobs: Vec<VerifyJob> = decode
            .iter()
            .zip(&proposals)
            .zip(rngs.iter_mut())
            .map(|((&(i, _), p), rng)| {
                let r = &self.running[i];
                VerifyJob {
                    drafts: &p.tokens,
                    draft_probs: p.probs.as_deref(),
                    sampling: r.req.sampling,
                    allowed: r.req.vocab_limit.map_or(vocab, |v| v.min(vocab)),
                    rule: &r.rule,
                    rng,
                    philox_seed: philox_seed(r.req.seed),
                    philox_offset: r.verify_steps,
                }
            })
            .collect();
        let out = self.target.step(&inputs, &tapped, &mut jobs)?;
        drop(jobs);
        if self.decode_backend != DecodeBackend::Standard {
            match self.target.last_step_fallback(self.decode_backend) {
                Some(reason) => {
                    *self
                        .totals
                        .decode_backend_fallbacks
                        .entry(reason.to_string())
                        .or_insert(0) += 1;
                }
                None => self.totals.specialized_steps += 1,
            }
        }
        // Row of each input's first new token in `out.hidden`.
        let mut first_row = Vec::with_capacity(inputs.len());
        let mut row = 0;
        for inp in &inputs {
            first_row.push(row);
            row += inp.tokens.len();
        }
        drop(inputs);
        for (&(i, _), rng) in decode.iter().zip(rngs) {
            self.running[i].rng = rng;
        }
        let hidden_size = self.target.config().hidden_size;
        let now = Instant::now();

        for (a, &(i, _)) in decode.iter().enumerate() {
            let r = &mut self.running[i];
            let drafts = &proposals[a].tokens;
            let outcome = &out.outcomes[a];
            r.verify_steps += 1;
            r.counter.record(drafts.len(), outcome.num_accepted)?;
            self.totals
                .acceptance
                .record(drafts.len(), outcome.num_accepted)?;
            // Keep [pending, accepted drafts] in the target cache; drop the rejected positions.
            self.target.truncate(
                r.seq.expect("admitted"),
                starts[a] + 1 + outcome.num_accepted,
            )?;
            let mut kept = Vec::with_capacity(outcome.emitted.len());
            for &t in &outcome.emitted {
                kept.push(t);
                if emit(r, t, now, self.tokenizer) {
                    break;
                }
            }
            r.pending = *kept.last().expect("a verify step emits at least one token");
            r.draft_time += draft_elapsed;
            r.verify_time += now - t_verify;
            if let Some(d) = self.drafter.as_deref_mut() {
                let seq = r.seq.expect("admitted");
                if !tapped.is_empty() {
                    // The positions now committed to the target cache: the old pending token
                    // and the accepted drafts.
                    let rows = first_row[a]..first_row[a] + 1 + outcome.num_accepted;
                    d.append_target_features(
                        seq,
                        starts[a],
                        &gather_features(&out.hidden, hidden_size, rows),
                    )?;
                }
                d.commit(seq, &kept)?;
            }
            events.push(Event::Tokens {
                id: r.id,
                tokens: kept,
            });
        }
        if !decode.is_empty() {
            self.totals.verify_time += t_verify.elapsed();
            self.totals.steps += 1;
        }

        // Prefill results: a finished prompt samples its first token as plain generation does.
        for (p, &(i, from, to)) in prefill.iter().enumerate() {
            let r = &mut self.running[i];
            if !tapped.is_empty() {
                let rows = first_row[decode.len() + p]..first_row[decode.len() + p] + (to - from);
                r.prompt_features.extend_from_slice(&gather_features(
                    &out.hidden,
                    hidden_size,
                    rows,
                ));
            }
            r.prefilled = to;
            if to < r.req.prompt_ids.len() {
                continue;
            }
            let logits = &out.last_logits[p];
            let allowed = r
                .req
                .vocab_limit
                .map_or(logits.len(), |v| v.min(logits.len()));
            let t = next_token(&logits[..allowed], &r.req.sampling, &mut r.rng)?;
            r.pending = t;
            if r.req.max_new_tokens == 0 {
                r.finish = Some(FinishReason::Length);
                continue;
            }
            let done = emit(r, t, now, self.tokenizer);
            events.push(Event::Tokens {
                id: r.id,
                tokens: vec![t],
            });
            if !done {
                if let Some(d) = self.drafter.as_deref_mut() {
                    let mut committed = r.req.prompt_ids.clone();
                    committed.push(t);
                    let seq = r.seq.expect("admitted");
                    d.add_sequence(seq, &committed)?;
                    r.in_drafter = true;
                    if !tapped.is_empty() {
                        let features = std::mem::take(&mut r.prompt_features);
                        d.append_target_features(seq, 0, &features)?;
                    }
                }
            }
        }
        self.retire(events)
    }

    /// Moves finished requests out of the running batch, freeing their state.
    fn retire(&mut self, mut events: Vec<Event>) -> Result<Vec<Event>, EngineError> {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].finish.is_none() {
                i += 1;
                continue;
            }
            let r = self.running.remove(i);
            self.release(&r)?;
            let output = self.output(r);
            events.push(output);
        }
        Ok(events)
    }

    fn output(&self, r: RequestState) -> Event {
        let drafter_name = self.drafter_name();
        let ttft = r
            .emit_times
            .first()
            .map_or(Duration::ZERO, |t| *t - r.start);
        let last = r.emit_times.last().copied().unwrap_or(r.start);
        let gaps: Vec<Duration> = r.emit_times.windows(2).map(|w| w[1] - w[0]).collect();
        let decode_s = (last - r.start - ttft).as_secs_f64();
        let decode_tps = if decode_s > 0.0 {
            (r.tokens.len().saturating_sub(1)) as f64 / decode_s
        } else {
            0.0
        };
        let acceptance = r.counter.clone();
        let stats = GenerationStats {
            mode: if drafter_name == "none" {
                "plain".into()
            } else {
                "speculative".into()
            },
            prompt_tokens: r.req.prompt_ids.len(),
            generated_tokens: r.tokens.len(),
            prefill_ms: ttft.as_secs_f64() * 1e3,
            ttft_ms: ttft.as_secs_f64() * 1e3,
            inter_token_latency: LatencySummary::from_durations(&gaps),
            total_ms: (last - r.start).as_secs_f64() * 1e3,
            decode_tokens_per_s: decode_tps,
            speculative: Some(SpeculativeStats::new(
                crate::speculative::acceptance_mode(&r.rule),
                r.rule.name(),
                &drafter_name,
                r.req.num_draft_tokens,
                &r.counter,
                r.draft_time,
                r.verify_time,
            )),
        };
        Event::Finished {
            id: r.id,
            output: GenerationOutput {
                token_ids: r.tokens,
                finish_reason: r.finish.unwrap_or(FinishReason::Length),
                stats,
            },
            acceptance,
        }
    }
}

/// The tapped layers' outputs for forward rows `rows`, concatenated per row in tap order:
/// `[rows, layers x hidden]`.
fn gather_features(hidden: &[Vec<f32>], h: usize, rows: std::ops::Range<usize>) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * hidden.len() * h);
    for r in rows {
        for layer in hidden {
            out.extend_from_slice(&layer[r * h..(r + 1) * h]);
        }
    }
    out
}

/// Appends `t` and reports whether the request is finished.
fn emit(r: &mut RequestState, t: u32, now: Instant, tokenizer: Option<&Tokenizer>) -> bool {
    r.tokens.push(t);
    r.emit_times.push(now);
    let req = &r.req;
    if req.stop_token_ids.contains(&t)
        || (!req.stop_strings.is_empty()
            && stop_string_hit(&r.tokens, &req.stop_strings, tokenizer))
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
