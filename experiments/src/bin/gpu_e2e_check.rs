//! The engine's GPU decode backend end to end (`--device cuda`) against the CPU engine, on the embedded
//! default pair (`models/default/{target,draft,dspark}`), 8 prompts x 64 new tokens, running batches of
//! 1 and 4 through the scheduler (continuous batching: a finished request's slot goes to the next):
//!
//! (a) greedy: plain decoding on the GPU, and speculative decoding on the GPU with the draft model
//!     (k = 4, 7), DSpark (k = 7) and n-gram (k = 5), each against plain greedy decoding on the CPU.
//!     The GPU computes in bf16 x bf16 -> f32 and is not batch-invariant across launch shapes, so a
//!     sequence may leave the CPU's path at a near-tie. Where the GPU's tokens first differ, the CPU
//!     target's logits at that position (same prefix on both sides) decide: the gap between the CPU's
//!     top logit and the logit of the token the GPU chose must be within what the forward's error
//!     allows (2 x tolerance x max |logit|, tolerance 1e-2 as in `gpu_forward_check`); a larger gap
//!     is a FAIL. The CPU's top-2 margin is printed too.
//! (b) the acceptance rules on the device against the same steps with the host verifier (GPU forward,
//!     logits copied back, CPU rules): greedy output must be identical token for token, because both
//!     see the same GPU logits (the GPU forward is deterministic per launch shape).
//! (c) temperature 1 (standard rule, draft model k = 4 and DSpark k = 7, batch 4): every output is
//!     64 valid ids, acceptance stats are consistent (1 <= AL <= k + 1, accepted counts per slot
//!     non-increasing and adding up); the CPU engine's AL on the same requests is printed beside it.
//! (d) synthetic acceptance (DSpark k = 7, mean length 3.78) on the device: the measured AL must be
//!     within 0.3 of 3.78 (steps near max tokens draft fewer, which lowers it slightly).
//! (e) decode backend `latency_specialized` (the fused kernel): greedy plain, draft model k = 7 and
//!     DSpark k = 7 at batch 1 and 4 judged as (a); synthetic 3.78 (batch 1) as (d); T = 1 standard
//!     rule with DSpark k = 7 (batch 4) as (c). Each run must have run fused steps, and its only
//!     fallbacks must be steps with a prompt chunk (`prefill_chunk`). These runs set
//!     `specialized_shapes` all, so that every verify step runs the kernel.
//! (f) `latency_specialized` with `specialized_shapes` measured (the engine's default): greedy draft
//!     model k = 7 and plain at batch 1 and 4 judged as (a); its only fallbacks may be prompt chunks
//!     and the shapes that timed slower fused (`measured_slower`).
//!
//! Prints a table and exits nonzero on any FAIL.
//! cargo build --release -p specula-experiments --features cuda --bin gpu_e2e_check
//! Usage: gpu_e2e_check [--root DIR] [--max-tokens N] [--tolerance T]

use anyhow::{bail, Context, Result};
use specula_drafters::Drafter;
use specula_engine::{
    build_drafter_on, build_target, generate, DecodeBackend, DrafterDevice, Event,
    GenerationRequest, RequestId, Scheduler, SchedulerConfig, SpecializedShapes, SpeculativeConfig,
    TargetBackend, TargetOptions,
};
use specula_kernels::cuda::driver_available;
use specula_kernels::sampling::SamplingParams;
use specula_model::loader::{load, LoadedModel};
use specula_model::{SeqInput, Transformer, WeightDtype};
use specula_verifier::{AcceptanceCounter, AcceptanceRule, SyntheticAcceptance};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

const PROMPTS: [&str; 8] = [
    "def read_config(path):",
    "import os\n\nclass Cache:\n    def __init__(self",
    "KING HENRY:\nWhat says",
    "for i in range(",
    "The quick brown fox",
    "fn main() {\n    let",
    "ROMEO:\nBut soft, what light",
    "# Compute the mean of a list\ndef mean(xs):",
];
const MAX_RUNNING: usize = 4;
const SYNTHETIC_LENGTH: f64 = 3.78;

/// Which drafter a run uses.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Method {
    Plain,
    DraftModel,
    Dspark,
    Ngram,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::Plain => "plain",
            Method::DraftModel => "draft_model",
            Method::Dspark => "dspark",
            Method::Ngram => "ngram",
        }
    }
}

/// One row of the final table.
struct Row {
    what: String,
    batch: usize,
    verdict: Verdict,
    detail: String,
    acceptance_length: Option<f64>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Identical,
    NearTie,
    Pass,
    Fail,
}

impl Verdict {
    fn label(self) -> &'static str {
        match self {
            Verdict::Identical => "identical",
            Verdict::NearTie => "near-tie",
            Verdict::Pass => "ok",
            Verdict::Fail => "FAIL",
        }
    }
}

/// What a run produced: tokens per request (in request order) and the run's acceptance record.
struct RunResult {
    tokens: Vec<Vec<u32>>,
    acceptance: AcceptanceCounter,
    verifier: &'static str,
    wall_s: f64,
    /// Steps that ran the latency_specialized backend, and the others by fallback reason.
    specialized_steps: u64,
    fallbacks: BTreeMap<String, u64>,
}

struct Setup {
    root: PathBuf,
    loaded: LoadedModel,
    prompts: Vec<Vec<u32>>,
    max_tokens: usize,
    vocab_limit: usize,
}

impl Setup {
    fn requests(&self, k: usize, sampling: SamplingParams) -> Vec<GenerationRequest> {
        self.prompts
            .iter()
            .enumerate()
            .map(|(i, p)| GenerationRequest {
                prompt_ids: p.clone(),
                max_new_tokens: self.max_tokens,
                sampling,
                seed: 1000 + i as u64,
                // Fixed-length outputs: every position is compared.
                stop_token_ids: Vec::new(),
                vocab_limit: Some(self.vocab_limit),
                stop_strings: Vec::new(),
                num_draft_tokens: k,
            })
            .collect()
    }

    fn drafter(&self, method: Method, k: usize, gpu: bool) -> Result<Option<Box<dyn Drafter>>> {
        let d = self.root.join("models/default");
        let json = match method {
            Method::Plain => return Ok(None),
            Method::DraftModel => format!(
                r#"{{"method": "draft_model", "model": {:?}, "num_speculative_tokens": {k}}}"#,
                d.join("draft").display().to_string()
            ),
            Method::Dspark => format!(
                r#"{{"method": "dspark", "model": {:?}, "num_speculative_tokens": {k}}}"#,
                d.join("dspark").display().to_string()
            ),
            Method::Ngram => format!(r#"{{"method": "ngram", "num_speculative_tokens": {k}}}"#),
        };
        let spec = SpeculativeConfig::from_json(&json)?;
        let device = if gpu {
            DrafterDevice::Cuda {
                max_sequences: MAX_RUNNING,
                max_context: self.loaded.model.config.max_position_embeddings,
            }
        } else {
            DrafterDevice::Cpu
        };
        build_drafter_on(&spec, &self.loaded, WeightDtype::Auto, device)
            .with_context(|| format!("building the {} drafter", method.name()))
    }
}

/// Runs `requests` through a scheduler of `batch` running sequences over `target` (borrowed: one
/// uploaded model serves every run).
fn run<'t>(
    target: &'t mut (dyn TargetBackend + 't),
    drafter: &'t mut Option<Box<dyn Drafter>>,
    rule: &AcceptanceRule,
    requests: &[GenerationRequest],
    batch: usize,
    backend: DecodeBackend,
) -> Result<RunResult> {
    let t = Instant::now();
    let drafter: Option<&mut dyn Drafter> = match drafter {
        Some(d) => Some(&mut **d),
        None => None,
    };
    let mut s = Scheduler::with_target(
        Box::new(target),
        drafter,
        None,
        SchedulerConfig {
            max_running: batch,
            prefill_chunk_tokens: 256,
        },
    );
    s.set_decode_backend(backend)?;
    let verifier = s.verifier();
    let mut ids: HashMap<RequestId, usize> = HashMap::new();
    for (i, r) in requests.iter().enumerate() {
        ids.insert(s.add_request(r.clone(), rule.clone())?, i);
    }
    let mut tokens = vec![Vec::new(); requests.len()];
    let mut acceptance = AcceptanceCounter::new();
    let mut finished = 0;
    while finished < requests.len() {
        for e in s.step()? {
            if let Event::Finished {
                id,
                output,
                acceptance: a,
            } = e
            {
                tokens[ids[&id]] = output.token_ids;
                acceptance.merge(&a);
                finished += 1;
            }
        }
    }
    let wall_s = t.elapsed().as_secs_f64();
    Ok(RunResult {
        tokens,
        acceptance,
        verifier,
        wall_s,
        specialized_steps: s.totals().specialized_steps,
        fallbacks: s.totals().decode_backend_fallbacks.clone(),
    })
}

/// A latency_specialized run: steps ran the fused kernel (unless `measured`), and the only fallbacks
/// are steps with a prompt chunk (prefill alone, or mixed with verify blocks when a request joins a
/// running batch) and, with `measured` (`specialized_shapes` measured), shapes that timed slower fused.
fn judge_backend(r: &RunResult, measured: bool) -> (bool, String) {
    // Per request; a scheduler step verifies up to `batch` of them at once.
    let verify_steps = r.acceptance.steps();
    let others: Vec<String> = r
        .fallbacks
        .iter()
        .filter(|(reason, _)| {
            reason.as_str() != "prefill_chunk"
                && !(measured && reason.as_str() == "measured_slower")
        })
        .map(|(reason, n)| format!("{reason} x{n}"))
        .collect();
    let ok = others.is_empty() && (measured || r.specialized_steps > 0);
    let detail = format!(
        "{} fused steps ({verify_steps} request verify steps), fallbacks {:?}",
        r.specialized_steps, r.fallbacks
    );
    (ok, detail)
}

/// A synthetic-acceptance run: `judge_sampled`, and the measured AL within 0.3 of the asked length.
fn judge_synthetic(setup: &Setup, r: &RunResult, k: usize) -> (Verdict, String, f64) {
    let (mut verdict, mut detail) = judge_sampled(setup, r, k, None);
    let al = r.acceptance.mean_acceptance_length().unwrap_or(f64::NAN);
    if al.is_nan() || (al - SYNTHETIC_LENGTH).abs() > 0.3 {
        verdict = Verdict::Fail;
        detail.push_str(&format!(
            "; AL {al:.3} is not within 0.3 of {SYNTHETIC_LENGTH}"
        ));
    }
    (verdict, detail, al)
}

/// Prints and records a sampled run on the fused backend, failed as well when its steps did not run
/// fused (`judge_backend`).
fn push_fused_sampled(
    rows: &mut Vec<Row>,
    what: String,
    batch: usize,
    mut verdict: Verdict,
    detail: String,
    r: &RunResult,
    acceptance_length: Option<f64>,
) {
    let (fused_ok, backend_detail) = judge_backend(r, false);
    if !fused_ok {
        verdict = Verdict::Fail;
    }
    println!(
        "  {what:<28} batch {batch}: {} {backend_detail}; {detail}",
        verdict.label()
    );
    rows.push(Row {
        what,
        batch,
        verdict,
        detail: format!("{backend_detail}; {detail}"),
        acceptance_length,
    });
}

/// The CPU target's logits after `prompt` + `prefix`.
fn cpu_logits(model: &Transformer, prompt: &[u32], prefix: &[u32]) -> Result<Vec<f32>> {
    let tokens: Vec<u32> = prompt.iter().chain(prefix).copied().collect();
    let mut cache = model.new_cache(tokens.len() + 16);
    let seq = cache.add_sequence();
    let out = model.forward(
        &mut cache,
        &[SeqInput {
            seq,
            tokens: &tokens,
            num_logits: 1,
        }],
        &[],
    )?;
    Ok(out.row(0, 0).to_vec())
}

/// Compares greedy GPU outputs with the CPU's plain greedy outputs; a difference passes only as a
/// near-tie at the first differing position.
fn judge_greedy(
    setup: &Setup,
    cpu: &[Vec<u32>],
    gpu: &[Vec<u32>],
    tolerance: f64,
) -> Result<(Verdict, String)> {
    let mut verdict = Verdict::Identical;
    let mut notes = Vec::new();
    let mut same = 0;
    for (i, (c, g)) in cpu.iter().zip(gpu).enumerate() {
        if g.len() != c.len() {
            notes.push(format!(
                "prompt {i}: {} tokens vs the CPU's {}",
                g.len(),
                c.len()
            ));
            verdict = Verdict::Fail;
            continue;
        }
        let Some(pos) = c.iter().zip(g).position(|(a, b)| a != b) else {
            same += 1;
            continue;
        };
        let logits = cpu_logits(&setup.loaded.model, &setup.prompts[i], &c[..pos])?;
        let allowed = &logits[..setup.vocab_limit.min(logits.len())];
        let mut order: Vec<usize> = (0..allowed.len()).collect();
        order.sort_by(|&a, &b| allowed[b].total_cmp(&allowed[a]));
        let top = allowed[order[0]];
        let margin = (top - allowed[order[1]]) as f64;
        let chosen = g[pos] as usize;
        let gap = match allowed.get(chosen) {
            Some(&l) => (top - l) as f64,
            None => f64::INFINITY,
        };
        let rank = order.iter().position(|&t| t == chosen).map_or(0, |r| r + 1);
        let scale = allowed.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
        let allowed_gap = 2.0 * tolerance * scale;
        let tie = gap <= allowed_gap;
        notes.push(format!(
            "prompt {i} pos {pos}: GPU {} (CPU rank {rank}, gap {gap:.4}) vs CPU {}; CPU top-2 margin {margin:.4}; allowed {allowed_gap:.4}{}",
            g[pos],
            c[pos],
            if tie { "" } else { " -> FAIL" }
        ));
        if !tie {
            verdict = Verdict::Fail;
        } else if verdict == Verdict::Identical {
            verdict = Verdict::NearTie;
        }
    }
    let mut detail = format!("{same}/{} identical", cpu.len());
    for n in notes {
        detail.push_str("\n      ");
        detail.push_str(&n);
    }
    Ok((verdict, detail))
}

/// The CPU engine's AL for the same temperature-1 requests, drafter and standard rule: the reference
/// a GPU run's AL is printed beside (sampled runs differ in their draws, so only roughly equal).
fn cpu_standard_al(
    setup: &Setup,
    opts: &TargetOptions,
    method: Method,
    k: usize,
    requests: &[GenerationRequest],
) -> Result<Option<f64>> {
    let mut drafter = setup.drafter(method, k, false)?;
    let mut cpu = build_target(specula_engine::Device::Cpu, &setup.loaded.model, opts)?;
    let r = run(
        &mut *cpu,
        &mut drafter,
        &AcceptanceRule::Standard,
        requests,
        MAX_RUNNING,
        DecodeBackend::Standard,
    )?;
    Ok(r.acceptance.mean_acceptance_length())
}

/// Structural checks of a sampled run: lengths, ids, acceptance consistency.
fn judge_sampled(
    setup: &Setup,
    result: &RunResult,
    k: usize,
    cpu_al: Option<f64>,
) -> (Verdict, String) {
    let mut problems = Vec::new();
    for (i, t) in result.tokens.iter().enumerate() {
        if t.len() != setup.max_tokens {
            problems.push(format!("prompt {i}: {} tokens", t.len()));
        }
        if let Some(bad) = t.iter().find(|&&x| x as usize >= setup.vocab_limit) {
            problems.push(format!("prompt {i}: id {bad} outside the vocabulary"));
        }
    }
    let al = result.acceptance.mean_acceptance_length();
    match al {
        Some(l) if (1.0..=(k + 1) as f64).contains(&l) => {}
        other => problems.push(format!("AL {other:?} outside 1..={}", k + 1)),
    }
    // A step that accepted slot i accepted every slot before it: per-slot counts never increase,
    // and they add up to the accepted total. (The rates may increase: later slots are drafted by
    // fewer steps near max_tokens.)
    let per_slot = result.acceptance.accepted_per_slot();
    if per_slot.windows(2).any(|w| w[1] > w[0]) {
        problems.push(format!("accepted counts per slot increase: {per_slot:?}"));
    }
    if per_slot.iter().sum::<u64>() != result.acceptance.accepted_tokens() {
        problems.push(format!(
            "accepted counts per slot {per_slot:?} do not add up to {}",
            result.acceptance.accepted_tokens()
        ));
    }
    let rates = result.acceptance.unconditional_rates();
    if result.acceptance.steps() == 0 {
        problems.push("no verify steps".into());
    }
    let detail = format!(
        "{} steps, AL {:.3} (CPU engine {}), rates {:?}{}",
        result.acceptance.steps(),
        al.unwrap_or(f64::NAN),
        cpu_al.map_or("-".into(), |a| format!("{a:.3}")),
        rates
            .iter()
            .map(|r| (r * 100.0).round() / 100.0)
            .collect::<Vec<_>>(),
        if problems.is_empty() {
            String::new()
        } else {
            format!("; {}", problems.join("; "))
        }
    );
    let verdict = if problems.is_empty() {
        Verdict::Pass
    } else {
        Verdict::Fail
    };
    (verdict, detail)
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let root = arg("--root").map_or_else(repo_root, PathBuf::from);
    let max_tokens: usize = arg("--max-tokens").map_or(Ok(64), |v| v.parse())?;
    let tolerance: f64 = arg("--tolerance").map_or(Ok(1e-2), |v| v.parse())?;
    if !driver_available() {
        bail!(
            "no CUDA driver on this machine: the GPU end-to-end check needs a GPU (specula runs on \
             the CPU with --device cpu)"
        );
    }
    let started = Instant::now();
    let loaded = load(&root.join("models/default/target"), WeightDtype::Auto)
        .context("loading models/default/target")?;
    let tok = loaded
        .tokenizer
        .as_ref()
        .context("the embedded target has a tokenizer")?;
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|t| tok.encode(t, false))
        .collect::<Result<_, _>>()?;
    let vocab_limit = tok.vocab_size();
    let setup = Setup {
        root: root.clone(),
        loaded,
        prompts,
        max_tokens,
        vocab_limit,
    };
    let model = &setup.loaded.model;
    let device_opts = TargetOptions {
        max_running: MAX_RUNNING,
        max_positions: model.config.max_position_embeddings,
        ..TargetOptions::default()
    };
    let host_opts = TargetOptions {
        verify_on_device: false,
        ..device_opts.clone()
    };
    let mut gpu = build_target(specula_engine::Device::Cuda, model, &device_opts)
        .context("the GPU target (rules on the device)")?;
    let mut gpu_host = build_target(specula_engine::Device::Cuda, model, &host_opts)
        .context("the GPU target (rules on the host)")?;
    println!(
        "target on {} ({}); {} prompts x {max_tokens} tokens",
        gpu.device(),
        Path::new("models/default/target").display(),
        setup.prompts.len()
    );

    let greedy = SamplingParams::greedy();
    let cpu_plain: Vec<Vec<u32>> = setup
        .requests(0, greedy)
        .iter()
        .map(|r| generate(model, r, |_| {}).map(|o| o.token_ids))
        .collect::<Result<_, _>>()?;
    let mut rows: Vec<Row> = Vec::new();

    println!("\n(a) greedy on the GPU vs plain greedy on the CPU:");
    let greedy_cases = [
        (Method::Plain, 0),
        (Method::DraftModel, 4),
        (Method::DraftModel, 7),
        (Method::Dspark, 7),
        (Method::Ngram, 5),
    ];
    let mut device_greedy: HashMap<(Method, usize, usize), Vec<Vec<u32>>> = HashMap::new();
    for &(method, k) in &greedy_cases {
        for batch in [1, MAX_RUNNING] {
            let mut drafter = setup.drafter(method, k, true)?;
            let r = run(
                &mut *gpu,
                &mut drafter,
                &AcceptanceRule::Greedy,
                &setup.requests(k, greedy),
                batch,
                DecodeBackend::Standard,
            )?;
            let (verdict, detail) = judge_greedy(&setup, &cpu_plain, &r.tokens, tolerance)?;
            let what = format!("greedy {} k={k}", method.name());
            println!(
                "  {what:<24} batch {batch}: {} ({:.2} s, rules on the {}) {detail}",
                verdict.label(),
                r.wall_s,
                r.verifier
            );
            rows.push(Row {
                what,
                batch,
                verdict,
                detail: detail.lines().next().unwrap_or("").to_string(),
                acceptance_length: r.acceptance.mean_acceptance_length(),
            });
            device_greedy.insert((method, k, batch), r.tokens);
        }
    }

    println!("\n(b) rules on the device vs the host verifier over the same GPU forward (greedy):");
    for &(method, k) in &[(Method::DraftModel, 4), (Method::Dspark, 7)] {
        for batch in [1, MAX_RUNNING] {
            let mut drafter = setup.drafter(method, k, true)?;
            let r = run(
                &mut *gpu_host,
                &mut drafter,
                &AcceptanceRule::Greedy,
                &setup.requests(k, greedy),
                batch,
                DecodeBackend::Standard,
            )?;
            let device = &device_greedy[&(method, k, batch)];
            let same = device.iter().zip(&r.tokens).filter(|(a, b)| a == b).count();
            let verdict = if same == device.len() {
                Verdict::Identical
            } else {
                Verdict::Fail
            };
            let what = format!("device vs host rules {} k={k}", method.name());
            let detail = format!("{same}/{} identical", device.len());
            println!("  {what:<36} batch {batch}: {} {detail}", verdict.label());
            rows.push(Row {
                what,
                batch,
                verdict,
                detail,
                acceptance_length: r.acceptance.mean_acceptance_length(),
            });
        }
    }

    println!("\n(c) temperature 1, standard rule, batch {MAX_RUNNING}:");
    let t1 = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
    };
    for &(method, k) in &[(Method::DraftModel, 4), (Method::Dspark, 7)] {
        let requests = setup.requests(k, t1);
        let mut drafter = setup.drafter(method, k, true)?;
        let r = run(
            &mut *gpu,
            &mut drafter,
            &AcceptanceRule::Standard,
            &requests,
            MAX_RUNNING,
            DecodeBackend::Standard,
        )?;
        let cpu_al = cpu_standard_al(&setup, &device_opts, method, k, &requests)?;
        let (verdict, detail) = judge_sampled(&setup, &r, k, cpu_al);
        let what = format!("T=1 standard {} k={k}", method.name());
        println!("  {what:<28} {} {detail}", verdict.label());
        rows.push(Row {
            what,
            batch: MAX_RUNNING,
            verdict,
            detail,
            acceptance_length: r.acceptance.mean_acceptance_length(),
        });
    }

    println!("\n(d) synthetic acceptance on the device (DSpark k=7, L={SYNTHETIC_LENGTH}):");
    {
        let k = 7;
        let rule =
            AcceptanceRule::Synthetic(SyntheticAcceptance::from_mean_length(SYNTHETIC_LENGTH, k)?);
        let mut drafter = setup.drafter(Method::Dspark, k, true)?;
        let r = run(
            &mut *gpu,
            &mut drafter,
            &rule,
            &setup.requests(k, greedy),
            MAX_RUNNING,
            DecodeBackend::Standard,
        )?;
        let (verdict, detail, al) = judge_synthetic(&setup, &r, k);
        let what = format!("synthetic L={SYNTHETIC_LENGTH} dspark k={k}");
        println!("  {what:<28} {} {detail}", verdict.label());
        rows.push(Row {
            what,
            batch: MAX_RUNNING,
            verdict,
            detail,
            acceptance_length: Some(al),
        });
    }

    println!(
        "\n(e) decode backend latency_specialized (the fused kernel) vs plain greedy on the CPU; its \
         verify steps must run fused, only prefill may fall back:"
    );
    let all_opts = TargetOptions {
        specialized_shapes: SpecializedShapes::All,
        ..device_opts.clone()
    };
    let mut fused_target = build_target(specula_engine::Device::Cuda, model, &all_opts)
        .context("the GPU target for latency_specialized")?;
    for &(method, k) in &[
        (Method::Plain, 0),
        (Method::DraftModel, 7),
        (Method::Dspark, 7),
    ] {
        for batch in [1, MAX_RUNNING] {
            let mut drafter = setup.drafter(method, k, true)?;
            let r = run(
                &mut *fused_target,
                &mut drafter,
                &AcceptanceRule::Greedy,
                &setup.requests(k, greedy),
                batch,
                DecodeBackend::LatencySpecialized,
            )?;
            let (mut verdict, mut detail) = judge_greedy(&setup, &cpu_plain, &r.tokens, tolerance)?;
            let (fused_ok, backend_detail) = judge_backend(&r, false);
            if !fused_ok {
                verdict = Verdict::Fail;
            }
            detail = format!("{backend_detail}; {detail}");
            let what = format!("fused greedy {} k={k}", method.name());
            println!(
                "  {what:<28} batch {batch}: {} ({:.2} s) {detail}",
                verdict.label(),
                r.wall_s
            );
            rows.push(Row {
                what,
                batch,
                verdict,
                detail: detail.lines().next().unwrap_or("").to_string(),
                acceptance_length: r.acceptance.mean_acceptance_length(),
            });
        }
    }
    {
        let k = 7;
        let rule =
            AcceptanceRule::Synthetic(SyntheticAcceptance::from_mean_length(SYNTHETIC_LENGTH, k)?);
        let mut drafter = setup.drafter(Method::Dspark, k, true)?;
        let r = run(
            &mut *fused_target,
            &mut drafter,
            &rule,
            &setup.requests(k, greedy),
            1,
            DecodeBackend::LatencySpecialized,
        )?;
        let (verdict, detail, al) = judge_synthetic(&setup, &r, k);
        let what = format!("fused synthetic L={SYNTHETIC_LENGTH} dspark k={k}");
        push_fused_sampled(&mut rows, what, 1, verdict, detail, &r, Some(al));
    }
    {
        // Temperature 1, standard rule, on the fused backend, judged as (c) (the sampling and verify
        // kernels are the standard path's; the fused kernel only supplies the logits).
        let k = 7;
        let requests = setup.requests(k, t1);
        let mut drafter = setup.drafter(Method::Dspark, k, true)?;
        let r = run(
            &mut *fused_target,
            &mut drafter,
            &AcceptanceRule::Standard,
            &requests,
            MAX_RUNNING,
            DecodeBackend::LatencySpecialized,
        )?;
        let cpu_al = cpu_standard_al(&setup, &device_opts, Method::Dspark, k, &requests)?;
        let (verdict, detail) = judge_sampled(&setup, &r, k, cpu_al);
        let what = format!("fused T=1 standard dspark k={k}");
        let al = r.acceptance.mean_acceptance_length();
        push_fused_sampled(&mut rows, what, MAX_RUNNING, verdict, detail, &r, al);
    }

    println!(
        "\n(f) latency_specialized with specialized_shapes measured vs plain greedy on the CPU; \
         only prefill and the shapes that timed slower fused may fall back:"
    );
    let mut measured_target = build_target(specula_engine::Device::Cuda, model, &device_opts)
        .context("the GPU target for latency_specialized (measured shapes)")?;
    for &(method, k) in &[(Method::Plain, 0), (Method::DraftModel, 7)] {
        for batch in [1, MAX_RUNNING] {
            let mut drafter = setup.drafter(method, k, true)?;
            let r = run(
                &mut *measured_target,
                &mut drafter,
                &AcceptanceRule::Greedy,
                &setup.requests(k, greedy),
                batch,
                DecodeBackend::LatencySpecialized,
            )?;
            let (mut verdict, detail) = judge_greedy(&setup, &cpu_plain, &r.tokens, tolerance)?;
            let (backend_ok, backend_detail) = judge_backend(&r, true);
            if !backend_ok {
                verdict = Verdict::Fail;
            }
            let detail = format!("{backend_detail}; {detail}");
            let what = format!("measured greedy {} k={k}", method.name());
            println!(
                "  {what:<28} batch {batch}: {} ({:.2} s) {detail}",
                verdict.label(),
                r.wall_s
            );
            rows.push(Row {
                what,
                batch,
                verdict,
                detail: detail.lines().next().unwrap_or("").to_string(),
                acceptance_length: r.acceptance.mean_acceptance_length(),
            });
        }
    }

    println!("\nsummary ({:.1} s):", started.elapsed().as_secs_f64());
    println!(
        "  {:<40} {:>5} {:>10} {:>7}  detail",
        "run", "batch", "verdict", "AL"
    );
    for r in &rows {
        println!(
            "  {:<40} {:>5} {:>10} {:>7}  {}",
            r.what,
            r.batch,
            r.verdict.label(),
            r.acceptance_length
                .map_or("-".into(), |a| format!("{a:.3}")),
            r.detail.lines().next().unwrap_or("")
        );
    }
    let failures = rows.iter().filter(|r| r.verdict == Verdict::Fail).count();
    let ties = rows
        .iter()
        .filter(|r| r.verdict == Verdict::NearTie)
        .count();
    println!(
        "  {} runs: {} identical or ok, {ties} with near-ties only, {failures} FAIL",
        rows.len(),
        rows.len() - failures - ties
    );
    if failures > 0 {
        bail!("{failures} run(s) failed");
    }
    Ok(())
}
