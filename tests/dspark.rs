//! The DSpark drafter in the speculative loop, end to end:
//! - greedy DSpark speculation == plain greedy on the embedded default target with the DSpark
//!   drafter trained for it (high acceptance: long accepted blocks), and on the DeepSpec fixture's
//!   tiny Qwen3 target with its random drafter (low acceptance), for k = 1..7, batches of 1..4,
//!   every rule at temperature 0, whole and chunked prefill;
//! - sampled DSpark speculation (standard and block rules, DSpark's full draft distributions, and
//!   drafting at another temperature than the target's) follows the target's exact joint
//!   distribution (chi-square against enumeration).

#[path = "../verifier/tests/common/mod.rs"]
mod common;

use common::pooled_p_value;
use specula_drafters::dspark::DSparkConfig;
use specula_drafters::{DSparkDrafter, DSparkModel, DraftTemperature, Drafter};
use specula_engine::{
    generate, generate_batch, Event, GenerationRequest, Scheduler, SchedulerConfig,
};
use specula_kernels::sampling::{self, SamplingParams};
use specula_model::loader::load;
use specula_model::{ModelConfig, SafetensorsSource, SeqInput, Transformer, WeightDtype};
use specula_verifier::AcceptanceRule;
use std::collections::HashMap;
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn embedded() -> (Transformer, DSparkModel) {
    let target = load(&root().join("models/default/target"), WeightDtype::Auto)
        .unwrap()
        .model;
    let dspark = DSparkModel::load(&root().join("models/default/dspark"), &target).unwrap();
    (target, dspark)
}

fn fixture() -> (Transformer, DSparkModel) {
    let dir = root().join("../shared/fixtures/dspark-deepspec");
    assert!(dir.exists(), "{} is missing", dir.display());
    let cfg = ModelConfig::from_hf_json(
        &std::fs::read_to_string(dir.join("target_config.json")).unwrap(),
    )
    .unwrap();
    let src = SafetensorsSource::open(&[dir.join("target.safetensors")]).unwrap();
    let target = Transformer::load(cfg, &src, WeightDtype::F32).unwrap();
    let dcfg = DSparkConfig::from_file(&dir.join("dspark_config.json")).unwrap();
    let dsrc = SafetensorsSource::open(&[dir.join("dspark_draft.safetensors")]).unwrap();
    let d = DSparkModel::from_source(dcfg, &dsrc, &target).unwrap();
    (target, d)
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

/// Runs requests through a scheduler with a small prefill chunk, so prompt features reach the
/// drafter in several pieces.
fn run_chunked(
    target: &Transformer,
    drafter: &mut dyn Drafter,
    rule: &AcceptanceRule,
    reqs: &[GenerationRequest],
    chunk: usize,
) -> Vec<Vec<u32>> {
    let mut s = Scheduler::new(
        target,
        Some(drafter),
        None,
        SchedulerConfig {
            max_running: 2,
            prefill_chunk_tokens: chunk,
        },
    );
    let ids: Vec<_> = reqs
        .iter()
        .map(|r| s.add_request(r.clone(), rule.clone()).unwrap())
        .collect();
    let mut out: HashMap<_, Vec<u32>> = HashMap::new();
    while !s.is_idle() {
        for e in s.step().unwrap() {
            if let Event::Finished { id, output, .. } = e {
                out.insert(id, output.token_ids);
            }
        }
    }
    ids.iter().map(|id| out.remove(id).unwrap()).collect()
}

fn check_greedy_equality(target: &Transformer, model: DSparkModel, prompts: &[Vec<u32>]) -> f64 {
    let max_new = 40;
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            generate(target, &request(p.clone(), max_new, 0), |_| {})
                .unwrap()
                .token_ids
        })
        .collect();
    let mut d = DSparkDrafter::new(model);
    let (mut accepted, mut steps) = (0u64, 0u64);
    for k in [1, 2, 4, 7] {
        for rule in [
            AcceptanceRule::Greedy,
            AcceptanceRule::Standard,
            AcceptanceRule::Block,
        ] {
            for batch in [1, 4] {
                let reqs: Vec<GenerationRequest> = prompts
                    .iter()
                    .take(batch)
                    .map(|p| request(p.clone(), max_new, k))
                    .collect();
                let out = generate_batch(target, Some(&mut d), &rule, &reqs, None).unwrap();
                for (o, w) in out.outputs.iter().zip(&want) {
                    assert_eq!(&o.token_ids, w, "k={k} rule={rule:?} batch={batch}");
                }
                let steps_here = out.run.num_verify_steps;
                let al = out.run.acceptance_length.unwrap_or(1.0);
                accepted += ((al - 1.0) * steps_here as f64).round() as u64;
                steps += steps_here;
            }
        }
        let reqs: Vec<GenerationRequest> = prompts
            .iter()
            .map(|p| request(p.clone(), max_new, k))
            .collect();
        let got = run_chunked(target, &mut d, &AcceptanceRule::Greedy, &reqs, 3);
        assert_eq!(got, want, "chunked prefill, k={k}");
    }
    1.0 + accepted as f64 / steps as f64
}

#[test]
fn greedy_dspark_speculation_equals_plain_greedy_on_the_embedded_pair() {
    let (target, model) = embedded();
    let path = root().join("models/default/target");
    let tok = load(&path, WeightDtype::Auto).unwrap().tokenizer.unwrap();
    let prompts: Vec<Vec<u32>> = [
        "def read_config(path):",
        "import os\n\nclass Cache:\n    def __init__(self",
        "KING HENRY:\nWhat says",
        "for i in range(",
    ]
    .iter()
    .map(|t| tok.encode(t, false).unwrap())
    .collect();
    let al = check_greedy_equality(&target, model, &prompts);
    // The trained drafter must actually be accepting long blocks here, or the test would not
    // exercise multi-row feature hand-over.
    assert!(al > 2.0, "mean AL {al}");
}

#[test]
fn greedy_dspark_speculation_equals_plain_greedy_on_the_fixture_pair() {
    let (target, model) = fixture();
    let prompts = vec![
        vec![5, 17, 33, 5, 17, 33, 5, 17],
        vec![100, 101, 102, 103, 100, 101],
        vec![7; 5],
        (0..20).map(|i| (i * 31 + 3) % 500).collect(),
    ];
    check_greedy_equality(&target, model, &prompts);
}

/// Exact probability of every continuation of `len` tokens below `vocab` (temperature 1).
fn exact_joint(target: &Transformer, prompt: &[u32], vocab: usize, len: usize) -> Vec<f64> {
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
    };
    let mut joint = vec![1.0f64];
    let mut prefixes: Vec<Vec<u32>> = vec![Vec::new()];
    for _ in 0..len {
        let mut next_joint = Vec::new();
        let mut next_prefixes = Vec::new();
        for (prefix, &p) in prefixes.iter().zip(&joint) {
            let mut cache = target.new_cache(64);
            let seq = cache.add_sequence();
            let mut tokens = prompt.to_vec();
            tokens.extend_from_slice(prefix);
            let out = target
                .forward(
                    &mut cache,
                    &[SeqInput {
                        seq,
                        tokens: &tokens,
                        num_logits: 1,
                    }],
                    &[],
                )
                .unwrap();
            let probs = sampling::probabilities(&out.row(0, 0)[..vocab], &params).unwrap();
            for (t, &q) in probs.iter().enumerate() {
                let mut s = prefix.clone();
                s.push(t as u32);
                next_prefixes.push(s);
                next_joint.push(p * q as f64);
            }
        }
        joint = next_joint;
        prefixes = next_prefixes;
    }
    joint
}

#[test]
fn sampled_dspark_speculation_follows_the_target_distribution() {
    let (target, model) = fixture();
    let mut d = DSparkDrafter::new(model);
    let prompt: Vec<u32> = vec![5, 17, 33, 5, 17, 33];
    // A small allowed vocabulary keeps the joint enumerable; the target and DSpark's draft
    // distributions are both restricted to it, as `vocab_limit` does in serving. Four tokens: the
    // first comes from prefill, the next three from one verify step with two drafts plus the
    // bonus token (k is capped by the tokens left), so the test looks at the joint of tokens 2..4
    // (6^3 cells), marginalised over the first.
    let (vocab, len, k) = (6usize, 4usize, 3usize);
    let marginal = |joint: Vec<f64>| -> Vec<f64> {
        let cells = vocab.pow(len as u32 - 1);
        let mut m = vec![0f64; cells];
        for (i, p) in joint.into_iter().enumerate() {
            m[i % cells] += p;
        }
        m
    };
    let cell = |ids: &[u32]| ids[1..].iter().fold(0usize, |c, &t| c * vocab + t as usize);
    let expected = marginal(exact_joint(&target, &prompt, vocab, len));
    // Outputs of `runs` seeded requests at T=1 (in batches of 100) drafted by `drafter` and verified
    // by `rule`: counts per cell, verify steps, accepted drafts.
    let sample = |drafter: &mut dyn Drafter, rule: &AcceptanceRule, runs: u64| {
        let mut counts = vec![0u64; expected.len()];
        let (mut steps, mut accepted) = (0u64, 0f64);
        for batch_start in (0..runs).step_by(100) {
            let reqs: Vec<GenerationRequest> = (batch_start..(batch_start + 100).min(runs))
                .map(|seed| GenerationRequest {
                    sampling: SamplingParams {
                        temperature: 1.0,
                        top_k: 0,
                        top_p: 1.0,
                    },
                    seed,
                    vocab_limit: Some(vocab),
                    ..request(prompt.clone(), len, k)
                })
                .collect();
            let out = generate_batch(&target, Some(&mut *drafter), rule, &reqs, None).unwrap();
            for o in &out.outputs {
                counts[cell(&o.token_ids)] += 1;
            }
            let al = out.run.acceptance_length.unwrap_or(1.0);
            accepted += (al - 1.0) * out.run.num_verify_steps as f64;
            steps += out.run.num_verify_steps;
        }
        (counts, steps, accepted)
    };
    for rule in [AcceptanceRule::Standard, AcceptanceRule::Block] {
        let (counts, steps, accepted) = sample(&mut d, &rule, 6000);
        let p = pooled_p_value(&counts, &expected);
        eprintln!("{rule:?}: chi-square p = {p:.3}, {accepted:.0} drafts accepted in {steps} verify steps");
        assert!(
            p > 1e-3,
            "{rule:?}: DSpark speculation deviates from the target, p = {p}"
        );
        assert!(
            steps > 0 && accepted > 100.0,
            "the drafter must actually propose and be accepted"
        );
    }
    // Drafting at another temperature than the target's (sharper, and greedy drafts with a one-hot
    // q) changes acceptance, never the output distribution.
    for draft_t in [0.5f32, 0.0] {
        let mut tempered =
            DraftTemperature::new(Box::new(DSparkDrafter::new(fixture().1)), draft_t).unwrap();
        let (counts, steps, accepted) = sample(&mut tempered, &AcceptanceRule::Standard, 6000);
        let p = pooled_p_value(&counts, &expected);
        eprintln!("draft temperature {draft_t}: chi-square p = {p:.3}, {accepted:.0} drafts accepted in {steps} verify steps");
        assert!(
            p > 1e-3,
            "drafting at {draft_t}: the output deviates from the target, p = {p}"
        );
        assert!(accepted > 100.0, "the tempered drafter must be accepted");
    }
    // The check has power: the same counts against a wrong distribution (the joint of a shifted
    // prompt) are rejected.
    let wrong = marginal(exact_joint(&target, &prompt[1..], vocab, len));
    let (counts, _, _) = sample(&mut d, &AcceptanceRule::Standard, 3000);
    assert!(
        pooled_p_value(&counts, &wrong) < 1e-6,
        "the chi-square check has no power"
    );
}

/// `specula generate` with the seed's DL7 configuration and no model path: the embedded target
/// with its DSpark drafter; greedy output equals plain; drafting and verify time are reported
/// separately; synthetic AL 3.78 is labelled synthetic; a draft length beyond the block is refused.
#[test]
fn cli_runs_the_dl7_configuration_natural_and_synthetic() {
    let run = |extra: &[&str]| -> (bool, serde_json::Value, String) {
        let mut args = vec![
            "generate",
            "--prompt",
            "def read_config(path):",
            "--max-tokens",
            "32",
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_specula"))
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!stderr.contains("panicked"), "{stderr}");
        let json = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
        (out.status.success(), json, stderr)
    };
    let (ok, plain, e) = run(&["--draft", "none"]);
    assert!(ok, "{e}");
    let (ok, dl7, e) = run(&[
        "--speculative-config",
        r#"{"method": "dspark", "num_speculative_tokens": 7}"#,
    ]);
    assert!(ok, "{e}");
    assert_eq!(dl7["token_ids"], plain["token_ids"]);
    let st = &dl7["stats"];
    assert_eq!(st["acceptance_mode"], "natural");
    assert!(st["acceptance_length"].as_f64().unwrap() > 1.5, "{st}");
    assert!(st["draft_ms"].as_f64().unwrap() > 0.0 && st["verify_ms"].as_f64().unwrap() > 0.0);
    let (ok, syn, e) = run(&[
        "--speculative-config",
        r#"{"method": "dspark", "num_speculative_tokens": 7, "synthetic_acceptance_length": 3.78}"#,
    ]);
    assert!(ok, "{e}");
    assert_eq!(syn["stats"]["acceptance_mode"], "synthetic");
    let (ok, _, e) = run(&[
        "--speculative-config",
        r#"{"method": "dspark", "num_speculative_tokens": 9}"#,
    ]);
    assert!(!ok && e.contains("drafts blocks of 7"), "{e}");
}
