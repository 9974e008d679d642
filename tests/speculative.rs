//! The speculative loop end to end on tiny random models (the HF parity fixtures: every one has a
//! 320-token vocabulary, so any of them can draft for any other).
//!
//! - greedy speculative output == plain greedy output, for every drafter, k = 1..8, batches of 1..4;
//! - k = 0 is plain decoding; a stop token inside an accepted block stops exactly there;
//! - draft caches after any accept/reject history equal a fresh forward over their tokens;
//! - a draft model capped at fewer rows per forward than a prompt drafts the same as an uncapped one;
//! - synthetic acceptance reaches its configured AL and is labelled synthetic;
//! - a drafter proposing an out-of-vocabulary token is an error, not an out-of-range output.

use proptest::prelude::*;
use rand::SeedableRng;
use specula_drafters::{
    DraftError, DraftProposal, DraftRequest, Drafter, ModelDrafter, NgramDrafter, SeqKey,
};
use specula_engine::{generate, generate_batch, GenerationRequest};
use specula_kernels::sampling::SamplingParams;
use specula_model::loader::load;
use specula_model::{SeqInput, Transformer, WeightDtype};
use specula_verifier::{AcceptanceRule, SyntheticAcceptance};
use std::path::Path;

fn model(arch: &str, dtype: WeightDtype) -> Transformer {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf_parity")
        .join(arch);
    load(&dir, dtype).unwrap().model
}

fn request(prompt: Vec<u32>, max_new: usize, k: usize) -> GenerationRequest {
    GenerationRequest {
        prompt_ids: prompt,
        max_new_tokens: max_new,
        sampling: SamplingParams::greedy(),
        seed: 0,
        stop_token_ids: vec![],
        vocab_limit: None,
        stop_strings: vec![],
        num_draft_tokens: k,
    }
}

/// Prompts with internal repetition so the n-gram drafter finds matches.
fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![5, 17, 33, 5, 17, 33, 5, 17],
        vec![100, 101, 102, 103, 100, 101],
        vec![7; 5],
        (0..20).map(|i| (i * 31 + 3) % 320).collect(),
    ]
}

fn plain(target: &Transformer, req: &GenerationRequest) -> Vec<u32> {
    generate(target, req, |_| {}).unwrap().token_ids
}

#[test]
fn greedy_speculation_equals_plain_greedy_for_every_drafter_k_and_batch() {
    let target = model("qwen2", WeightDtype::Bf16);
    let prompts = prompts();
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| plain(&target, &request(p.clone(), 24, 0)))
        .collect();
    for drafter_name in ["ngram", "draft_model_other", "draft_model_same"] {
        for k in 1..=8 {
            for batch in 1..=4 {
                let mut drafter: Box<dyn Drafter> = match drafter_name {
                    "ngram" => Box::new(NgramDrafter::default()),
                    "draft_model_other" => {
                        Box::new(ModelDrafter::new(model("qwen3", WeightDtype::Bf16)))
                    }
                    _ => Box::new(ModelDrafter::new(model("qwen2", WeightDtype::Bf16))),
                };
                // Requests in a batch get different draft lengths, to mix shapes in every step.
                let reqs: Vec<GenerationRequest> = (0..batch)
                    .map(|b| request(prompts[b].clone(), 24, (k + b) % 9))
                    .collect();
                for rule in [
                    AcceptanceRule::Greedy,
                    AcceptanceRule::Standard,
                    AcceptanceRule::Block,
                ] {
                    let out = generate_batch(&target, Some(drafter.as_mut()), &rule, &reqs, None)
                        .unwrap();
                    for (b, (o, w)) in out.outputs.iter().zip(&want).enumerate() {
                        assert_eq!(
                            o.token_ids,
                            *w,
                            "{drafter_name}, k={k}, batch={batch}, request {b}, rule {}",
                            rule.name()
                        );
                    }
                    if drafter_name == "draft_model_same" && k >= 1 {
                        // The target drafting for itself is always right: AL = k + 1 except where
                        // max tokens clip a step.
                        let al = out.run.acceptance_length.unwrap();
                        assert!(al > 1.5, "self-drafting AL {al}");
                    }
                    assert_eq!(out.run.acceptance_mode, "natural");
                }
            }
        }
    }
}

#[test]
fn k_zero_is_plain_decoding_and_sampling_is_reproducible() {
    let target = model("llama", WeightDtype::F32);
    let prompt = prompts()[3].clone();
    let greedy = request(prompt.clone(), 16, 0);
    let out = generate_batch(
        &target,
        None,
        &AcceptanceRule::Standard,
        std::slice::from_ref(&greedy),
        None,
    )
    .unwrap();
    assert_eq!(out.outputs[0].token_ids, plain(&target, &greedy));
    assert_eq!(out.run.acceptance_length, Some(1.0));
    // With sampling, k = 0 consumes the random stream exactly as plain generation does.
    let mut sampled = request(prompt, 16, 0);
    sampled.sampling = SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
    };
    sampled.seed = 11;
    let out = generate_batch(
        &target,
        None,
        &AcceptanceRule::Standard,
        &[sampled.clone()],
        None,
    )
    .unwrap();
    assert_eq!(out.outputs[0].token_ids, plain(&target, &sampled));
    // Speculative sampling is reproducible per seed.
    let mut d1 = ModelDrafter::new(model("qwen3", WeightDtype::F32));
    let mut d2 = ModelDrafter::new(model("qwen3", WeightDtype::F32));
    sampled.num_draft_tokens = 4;
    let a = generate_batch(
        &target,
        Some(&mut d1),
        &AcceptanceRule::Standard,
        &[sampled.clone()],
        None,
    )
    .unwrap();
    let b = generate_batch(
        &target,
        Some(&mut d2),
        &AcceptanceRule::Standard,
        &[sampled],
        None,
    )
    .unwrap();
    assert_eq!(a.outputs[0].token_ids, b.outputs[0].token_ids);
}

#[test]
fn stop_token_inside_an_accepted_block_stops_exactly_there() {
    let target = model("qwen2", WeightDtype::Bf16);
    let prompt = prompts()[0].clone();
    let full = plain(&target, &request(prompt.clone(), 30, 0));
    // Pick a token that first occurs mid-way; with the target drafting for itself, it arrives inside
    // a fully accepted block.
    let stop_at = 9.min(full.len() - 1);
    let stop = full[stop_at];
    let first = full.iter().position(|&t| t == stop).unwrap();
    let mut req = request(prompt, 30, 7);
    req.stop_token_ids = vec![stop];
    let mut drafter = ModelDrafter::new(model("qwen2", WeightDtype::Bf16));
    let out = generate_batch(
        &target,
        Some(&mut drafter),
        &AcceptanceRule::Greedy,
        &[req],
        None,
    )
    .unwrap();
    assert_eq!(out.outputs[0].token_ids, full[..=first].to_vec());
    assert_eq!(
        out.outputs[0].finish_reason,
        specula_engine::FinishReason::Stop
    );
}

#[test]
fn synthetic_acceptance_reaches_its_length_and_is_labelled() {
    let target = model("qwen3", WeightDtype::Bf16);
    let rule = AcceptanceRule::Synthetic(SyntheticAcceptance::from_mean_length(3.78, 7).unwrap());
    // A drafter that always offers k tokens, so every step has all 7 slots.
    let reqs: Vec<GenerationRequest> = (0..4)
        .map(|i| request(prompts()[i].clone(), 400, 7))
        .collect();
    let mut drafter = ModelDrafter::new(model("llama", WeightDtype::Bf16));
    let out = generate_batch(&target, Some(&mut drafter), &rule, &reqs, None).unwrap();
    assert_eq!(out.run.acceptance_mode, "synthetic");
    // Steps near max tokens draft fewer slots; count only full steps through per-position rates.
    let u = &out.run.per_position_acceptance.unconditional;
    assert!(
        (u[0] - 1.0).abs() < 1e-12 && (u[1] - 1.0).abs() < 1e-12,
        "{u:?}"
    );
    assert!((u[2] - 0.78).abs() < 0.06, "{u:?}");
    assert!(u[3..].iter().all(|&r| r == 0.0), "{u:?}");
    let al = out.run.acceptance_length.unwrap();
    assert!((al - 3.78).abs() < 0.12, "AL {al}");
    for o in &out.outputs {
        assert_eq!(
            o.stats.speculative.as_ref().unwrap().acceptance_mode,
            "synthetic"
        );
    }
}

/// A drafter that proposes a fixed (possibly invalid) token.
struct FixedDrafter(u32);
impl Drafter for FixedDrafter {
    fn name(&self) -> &str {
        "fixed"
    }
    fn add_sequence(&mut self, _: SeqKey, _: &[u32]) -> Result<(), DraftError> {
        Ok(())
    }
    fn remove_sequence(&mut self, _: SeqKey) -> Result<(), DraftError> {
        Ok(())
    }
    fn propose(&mut self, reqs: &mut [DraftRequest<'_>]) -> Result<Vec<DraftProposal>, DraftError> {
        Ok(reqs
            .iter()
            .map(|r| DraftProposal {
                tokens: vec![self.0; r.max_tokens],
                probs: None,
            })
            .collect())
    }
    fn commit(&mut self, _: SeqKey, _: &[u32]) -> Result<(), DraftError> {
        Ok(())
    }
}

#[test]
fn out_of_vocabulary_drafts_are_errors() {
    let target = model("qwen2", WeightDtype::F32);
    for rule in [
        AcceptanceRule::Greedy,
        AcceptanceRule::Standard,
        AcceptanceRule::Block,
    ] {
        let err = generate_batch(
            &target,
            Some(&mut FixedDrafter(5000)),
            &rule,
            &[request(vec![1, 2, 3], 8, 3)],
            None,
        )
        .err()
        .expect("an out-of-vocabulary draft must be refused");
        assert!(err.to_string().contains("5000"), "{}: {err}", rule.name());
    }
    // In-vocabulary junk drafts are simply rejected: output still equals plain greedy.
    let req = request(vec![1, 2, 3], 12, 3);
    let out = generate_batch(
        &target,
        Some(&mut FixedDrafter(7)),
        &AcceptanceRule::Standard,
        std::slice::from_ref(&req),
        None,
    )
    .unwrap();
    assert_eq!(out.outputs[0].token_ids, plain(&target, &req));
}

/// One draft request per sequence key 0.., each with its own random stream.
fn draft_requests(
    rngs: &mut [rand_chacha::ChaCha8Rng],
    max_tokens: usize,
    sampling: SamplingParams,
) -> Vec<DraftRequest<'_>> {
    rngs.iter_mut()
        .enumerate()
        .map(|(seq, rng)| DraftRequest {
            seq: seq as SeqKey,
            max_tokens,
            sampling,
            vocab_limit: 320,
            uniforms: rng,
        })
        .collect()
}

/// The GPU draft model takes at most `GpuOptions::max_rows` rows per launch, so a prompt longer than
/// that is prefilled in chunks before the first draft. The same code runs on the CPU under
/// `with_max_launch_rows`: chunked, the drafts, their distributions and the caches must be exactly
/// those of one forward over the whole prompt (the CPU forward is batch-invariant), for a batch of
/// prompts longer than, equal to and shorter than the cap, and across later steps.
#[test]
fn a_draft_model_capped_below_the_prompt_drafts_as_an_uncapped_one() {
    let prompts: Vec<Vec<u32>> = vec![
        (0..37).map(|i| (i * 31 + 3) % 320).collect(),
        vec![9],
        (0..8).map(|i| (i * 7 + 100) % 320).collect(),
        (0..20).map(|i| (i * 13 + 50) % 320).collect(),
    ];
    let sampling = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
    };
    let run = |cap: Option<usize>| {
        let mut drafter = ModelDrafter::new(model("qwen3", WeightDtype::F32));
        if let Some(rows) = cap {
            drafter = drafter.with_max_launch_rows(rows);
        }
        for (seq, p) in prompts.iter().enumerate() {
            drafter.add_sequence(seq as SeqKey, p).unwrap();
        }
        let mut rngs: Vec<_> = (0..prompts.len())
            .map(|i| rand_chacha::ChaCha8Rng::seed_from_u64(i as u64))
            .collect();
        let mut out = Vec::new();
        for step in 0..3 {
            let mut reqs = draft_requests(&mut rngs, 4, sampling);
            let proposals = drafter.propose(&mut reqs).unwrap();
            for (seq, p) in proposals.iter().enumerate() {
                // Accept a step-dependent prefix, then a bonus token.
                let mut committed = p.tokens[..(seq + step) % 4].to_vec();
                committed.push((seq * 11 + step) as u32);
                drafter.commit(seq as SeqKey, &committed).unwrap();
            }
            out.push(proposals);
        }
        let caches: Vec<Vec<_>> = (0..prompts.len())
            .map(|seq| {
                let cs = drafter.cache_seq(seq as SeqKey).unwrap();
                (0..drafter.model().config.num_layers)
                    .map(|layer| drafter.cache().unwrap().gather(layer, cs).unwrap())
                    .collect()
            })
            .collect();
        (out, caches)
    };
    let (want, want_caches) = run(None);
    assert!(want.iter().flatten().all(|p| p.tokens.len() == 4));
    for cap in [4, 8, 16] {
        let (got, got_caches) = run(Some(cap));
        assert_eq!(got, want, "proposals with at most {cap} rows per forward");
        assert_eq!(
            got_caches, want_caches,
            "caches with at most {cap} rows per forward"
        );
    }
    // More sequences than rows per forward: a clear error, not a panic or a partial draft.
    let mut drafter = ModelDrafter::new(model("qwen3", WeightDtype::F32)).with_max_launch_rows(2);
    let mut rngs: Vec<_> = (0..3).map(rand_chacha::ChaCha8Rng::seed_from_u64).collect();
    for seq in 0..3 {
        drafter.add_sequence(seq, &[1, 2, 3]).unwrap();
    }
    let mut reqs = draft_requests(&mut rngs, 2, SamplingParams::greedy());
    let err = drafter.propose(&mut reqs).unwrap_err();
    assert!(matches!(err, DraftError::Config(_)), "{err}");
    assert!(err.to_string().contains("3 sequences"), "{err}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// After any sequence of propose/commit with random accept lengths, the draft model's cache equals
    /// a fresh forward over the tokens it holds.
    #[test]
    fn draft_cache_after_rollbacks_equals_fresh_forward(
        prompt in proptest::collection::vec(0u32..320, 1..12),
        steps in proptest::collection::vec((1usize..6, 0usize..6, 0u32..320), 1..6),
    ) {
        let mut drafter = ModelDrafter::new(model("qwen3", WeightDtype::F32));
        drafter.add_sequence(0, &prompt).unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        for (k, accept, bonus) in steps {
            let mut reqs = [DraftRequest { seq: 0, max_tokens: k, sampling: SamplingParams::greedy(), vocab_limit: 320, uniforms: &mut rng }];
            let p = drafter.propose(&mut reqs).unwrap();
            let a = accept.min(p[0].tokens.len());
            let mut committed = p[0].tokens[..a].to_vec();
            committed.push(bonus);
            drafter.commit(0, &committed).unwrap();
        }
        let tokens = drafter.cached_tokens(0).unwrap().to_vec();
        let fresh_model = model("qwen3", WeightDtype::F32);
        let mut fresh = fresh_model.new_cache(256);
        let s = fresh.add_sequence();
        fresh_model.forward(&mut fresh, &[SeqInput { seq: s, tokens: &tokens, num_logits: 1 }], &[]).unwrap();
        let cs = drafter.cache_seq(0).unwrap();
        for layer in 0..fresh_model.config.num_layers {
            prop_assert_eq!(drafter.cache().unwrap().gather(layer, cs).unwrap(), fresh.gather(layer, s).unwrap());
        }
    }
}
