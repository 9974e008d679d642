//! `specula`: the command-line interface.

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use serde_json::json;
use specula_drafters::Drafter;
use specula_engine::{
    build_drafter_on, build_target, generate, generate_batch_on, AdditionalConfig, Device,
    DrafterDevice, GenerationRequest, SpeculativeConfig, SpeculativeMethod, TargetOptions,
};
use specula_experiments::acceptance::{
    export_golden, run_acceptance, AcceptanceConfig, ChatMode, GoldenSelection, RunOptions,
};
use specula_experiments::prompts::{BadLinePolicy, PromptSetSpec};
use specula_kernels::sampling::SamplingParams;
use specula_model::loader::{load, LoadedModel};
use specula_model::tokenizer::ChatMessage;
use specula_model::{SeqInput, WeightDtype};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser)]
#[command(name = "specula", version, about = "Speculative-decoding engine")]
struct Cli {
    /// Worker threads for the CPU backend (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt.
    Generate(GenerateArgs),
    /// Check that greedy generation is deterministic and that feeding the generated tokens
    /// k at a time gives bit-identical logits to feeding them one at a time.
    CheckInvariance(InvarianceArgs),
    /// Experiments: acceptance sweeps and golden acceptance files.
    #[command(subcommand)]
    Experiment(ExperimentCommand),
    /// Serve an OpenAI-compatible HTTP API (completions, chat, streaming, metrics).
    Serve(ServeArgs),
    /// Benchmarks on the GPU (build with `--features cuda`).
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Decode/verify step time of the GPU forward (CUDA graphs) at fixed running requests, against
    /// the copy-bandwidth floor; writes step_bench_<shape>.json and .md into --out.
    Step(StepBenchArgs),
    /// End-to-end tokens/s per user on the GPU: the engine's scheduler, a drafter and the GPU target
    /// with synthetic acceptance, for each decode backend; writes e2e_bench_<shape>.json and .md into
    /// --out.
    E2e(E2eBenchArgs),
}

#[derive(Args)]
struct E2eBenchArgs {
    /// The target: a random-weight model of a real shape (llama3.2-1b | llama3.1-8b |
    /// qwen2.5-coder-1.5b), built on the GPU.
    #[arg(long, default_value = "llama3.2-1b")]
    random_weights: String,
    /// Decode backends measured side by side: standard, latency_specialized.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "standard,latency_specialized"
    )]
    backends: Vec<String>,
    /// draft-random (a random-weight draft model on the GPU: the target's vocabulary, hidden 512,
    /// 4 layers) or ngram (prompt lookup on the CPU; proposes fewer than k tokens when it finds no
    /// match, so the measured acceptance length falls below --acceptance-length).
    #[arg(long, default_value = "draft-random")]
    drafter: String,
    /// Requests running together in each run.
    #[arg(long, default_value_t = 1)]
    requests: usize,
    /// Draft tokens per verify step, 1..=16.
    #[arg(long, default_value_t = 7)]
    k: usize,
    /// Synthetic mean acceptance length (bonus token included), in (1, k + 1].
    #[arg(long, default_value_t = 3.78)]
    acceptance_length: f64,
    /// Prompt tokens per request (seeded random ids).
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Tokens generated per request (exactly: no stop tokens).
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Timed runs per backend (after the warm-up).
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// Seed of the target's weights (the draft model's: seed + 1), prompts and request seeds.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Sampling temperature of the requests (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Skip timing cuBLAS against the skinny kernel for the target's linear layers.
    #[arg(long)]
    no_tune: bool,
    /// Which step shapes latency_specialized runs fused: measured (those whose first step, in each
    /// context bucket, timed faster fused, as the engine does by default) or all (every shape the
    /// kernel takes).
    #[arg(long, default_value = "measured")]
    specialized_shapes: String,
    #[arg(long, default_value = "experiments/results/e2e_bench")]
    out: PathBuf,
}

#[derive(Args)]
struct StepBenchArgs {
    /// A random-weight model of a real shape: llama3.2-1b | llama3.1-8b | qwen2.5-coder-1.5b.
    #[arg(long, conflicts_with = "model")]
    random_weights: Option<String>,
    /// A real checkpoint instead (HF directory or GGUF).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Running requests (held fixed during a setting).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    batches: Vec<usize>,
    /// New tokens per sequence per step: 1 = plain decode, k + 1 = a verify block of k drafts.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    tokens: Vec<usize>,
    /// Prompt positions (seeded random token ids) prefilled before the timed steps.
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Timed steps per prompt group.
    #[arg(long, default_value_t = 64)]
    steps: usize,
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Prompt groups per run.
    #[arg(long, default_value_t = 4)]
    prompts: usize,
    /// Synthetic mean acceptance length (bonus included) of verify steps.
    #[arg(long, default_value_t = 3.78)]
    acceptance_length: f64,
    /// Samples of graph-replay device time per setting (each the mean of 10 back-to-back replays).
    #[arg(long, default_value_t = 20)]
    replay_reps: usize,
    /// Skip timing cuBLAS against the skinny kernel (then the skinny kernel serves every decode shape).
    #[arg(long)]
    no_tune: bool,
    /// Step backends timed side by side: standard, latency_specialized (the fused kernel, issue 6)
    #[arg(long, value_delimiter = ',', default_value = "standard")]
    backends: Vec<String>,
    /// latency_specialized: most rows of a step the dataflow kernel (v2) takes, 1..=16 (default: the
    /// engine's, 16); larger steps run v1. Each row of the report names the kernel it ran.
    #[arg(long)]
    fused_dataflow_max_rows: Option<usize>,
    /// latency_specialized: the dataflow kernel's (v2) producer settings, IN[:L2[:PACE[:LEAD[:ROWS]]]]:
    /// weight copies (32 KB) in flight per CTA, copies in flight from L2, the paced L2 prefetch's
    /// interval in cycles, its lead in chunks (0: off) and the most rows of a step it runs in; empty
    /// fields keep the kernel's defaults (chosen on H100s), e.g. `2` or `2:::4`. The report states them.
    #[arg(long)]
    fused_producer: Option<String>,
    #[arg(long, default_value = "experiments/results/step_bench")]
    out: PathBuf,
}

// Parsed once per process: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum ExperimentCommand {
    /// Sweep drafter x draft length x temperature x rule x prompt set; resumable; writes
    /// results.jsonl, summary.json, table.md and plots/ into --out.
    Acceptance(AcceptanceArgs),
    /// Write the natural per-position rates of one setting of a results directory as a golden
    /// acceptance file for --synthetic-acceptance-rates-from.
    ExportGolden(ExportGoldenArgs),
}

/// Flags override the fields of --config.
#[derive(Args)]
struct AcceptanceArgs {
    /// A .json or .toml file with the AcceptanceConfig fields.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Output directory (resumed when it holds a run of the same configuration).
    #[arg(long)]
    out: PathBuf,
    /// Target model (default: the embedded default target).
    #[arg(long)]
    target: Option<PathBuf>,
    /// Drafters: embedded | ngram | dspark | draft_model:PATH | dspark:PATH (comma-separated or
    /// repeated).
    #[arg(long, value_delimiter = ',')]
    drafters: Vec<String>,
    #[arg(long, value_delimiter = ',')]
    draft_lengths: Vec<usize>,
    #[arg(long, value_delimiter = ',')]
    temperatures: Vec<f32>,
    /// greedy | standard | block | synthetic (greedy runs at T = 0, standard/block at T > 0).
    #[arg(long, value_delimiter = ',')]
    rules: Vec<String>,
    /// Prompt files: JSONL with {"turns": [...]} (first turn used) or plain text, one prompt a line.
    #[arg(long = "prompts")]
    prompt_sets: Vec<PathBuf>,
    /// One dataset per "category" of each JSONL prompt file (Spec-Bench).
    #[arg(long)]
    by_category: bool,
    /// Keep only these categories (comma-separated).
    #[arg(long, value_delimiter = ',')]
    categories: Vec<String>,
    #[arg(long)]
    num_prompts: Option<usize>,
    #[arg(long)]
    max_new_tokens: Option<usize>,
    /// auto | on | off.
    #[arg(long)]
    chat: Option<String>,
    #[arg(long)]
    seed: Option<u64>,
    /// Requests per generate_batch call.
    #[arg(long)]
    batch_size: Option<usize>,
    /// skip | fail: what to do with a malformed prompt line.
    #[arg(long)]
    on_bad_line: Option<String>,
    /// Synthetic run: the unconditional rates of this golden file (rule synthetic).
    #[arg(long)]
    synthetic_acceptance_rates_from: Option<PathBuf>,
    #[arg(long)]
    no_progress: bool,
}

#[derive(Args)]
struct ExportGoldenArgs {
    /// A results directory of `specula experiment acceptance`.
    #[arg(long)]
    from: PathBuf,
    #[arg(long)]
    drafter: String,
    #[arg(long)]
    k: usize,
    #[arg(long)]
    temperature: f32,
    /// Needed only when the directory has several rules for this drafter, k and temperature.
    #[arg(long)]
    rule: Option<String>,
    /// One dataset (default: all datasets pooled).
    #[arg(long)]
    dataset: Option<String>,
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct ServeArgs {
    /// Target model (default: the embedded default pair, drafting with its draft model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Drafter: a draft model path, `ngram`, or `none`.
    #[arg(long)]
    draft: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Speculative configuration JSON (serving engines' shape).
    #[arg(long)]
    speculative_config: Option<String>,
    /// '{"decode_backend": "standard"|"latency_specialized", "specialized_shapes":
    /// "measured"|"all"}': latency_specialized runs the fused verify kernel (GPU, sm_90+) on the
    /// step shapes measured faster with it (or on all it takes); other steps run standard, counted
    /// by reason in /metrics.
    #[arg(long)]
    additional_config: Option<String>,
    #[command(flatten)]
    device: DeviceArgs,
    /// Requests decoded together.
    #[arg(long, default_value_t = 16)]
    max_running: usize,
    /// Requests that may wait for a slot; more get 429.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Prompt tokens prefilled per scheduler step (chunked prefill).
    #[arg(long, default_value_t = 256)]
    prefill_chunk: usize,
    #[arg(long, default_value = "auto")]
    dtype: WeightDtype,
}

/// Where the target runs.
#[derive(Args)]
struct DeviceArgs {
    /// cpu (the reference backend, always built) or cuda (the GPU backend: needs a build with
    /// `--features cuda`, an NVIDIA driver and NVRTC). With cuda the DSpark drafter and a draft
    /// model run on the GPU too; n-gram drafting stays on the CPU.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// With --device cuda: positions per sequence the GPU KV cache holds (capped at the model's
    /// context; the cache is allocated up front for every running sequence).
    #[arg(long, default_value_t = TargetOptions::default().max_positions)]
    gpu_max_context: usize,
}

impl DeviceArgs {
    /// Where the drafter's network runs, for `max_sequences` sequences of `context` positions.
    fn drafter_device(&self, max_sequences: usize, context: usize) -> DrafterDevice {
        match self.device {
            Device::Cpu => DrafterDevice::Cpu,
            Device::Cuda => DrafterDevice::Cuda {
                max_sequences,
                max_context: self.gpu_max_context.min(context),
            },
        }
    }
}

#[derive(Args)]
struct ModelArgs {
    /// A GGUF file, an HF model directory (config.json + *.safetensors + tokenizer.json), or a
    /// .safetensors file with config.json beside it. Default: the embedded default target
    /// (models/default/target; with no --draft it drafts with models/default/draft).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Weight storage: auto (f32 checkpoints stay f32, the rest bf16), f32 or bf16.
    #[arg(long, default_value = "auto")]
    dtype: WeightDtype,
}

#[derive(Args)]
struct PromptArgs {
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt in the model's chat template (ChatML for Qwen instruct models).
    #[arg(long)]
    chat: bool,
    /// System message for --chat (default: the template's own).
    #[arg(long)]
    system: Option<String>,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    prompt: PromptArgs,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object (text, token_ids, prompt_token_ids, stats) instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Do not stop at end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Stop when the text contains this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    #[command(flatten)]
    spec: SpecArgs,
    #[command(flatten)]
    device: DeviceArgs,
    /// '{"decode_backend": "standard"|"latency_specialized", "specialized_shapes":
    /// "measured"|"all"}': latency_specialized runs the fused verify kernel (GPU, sm_90+) on the
    /// step shapes measured faster with it (or on all it takes); other steps run standard, counted
    /// by reason in the run stats (--json: run.decode_backend_fallbacks).
    #[arg(long)]
    additional_config: Option<String>,
}

/// Speculation flags: shorthands for fields of --speculative-config (flags override its fields).
#[derive(Args)]
struct SpecArgs {
    /// Drafter: a draft model path (GGUF or HF directory sharing the target's tokenizer), `ngram`
    /// (prompt lookup), `dspark` (the DSpark drafter shipped with the embedded default target; other
    /// DSpark checkpoints via --speculative-config), or `none` (plain decoding).
    #[arg(long)]
    draft: Option<String>,
    /// Draft tokens per verify step, 1..=16.
    #[arg(long)]
    num_draft_tokens: Option<usize>,
    /// Acceptance rule: greedy | standard | block | synthetic (default: greedy at temperature 0,
    /// else standard).
    #[arg(long)]
    acceptance: Option<String>,
    /// Synthetic mode: mean acceptance length L (bonus included), mapped to minimum-variance rates.
    #[arg(long)]
    synthetic_acceptance_length: Option<f64>,
    /// Synthetic mode: unconditional per-position rates, comma-separated, one per draft slot.
    #[arg(long, value_delimiter = ',')]
    synthetic_acceptance_rates: Option<Vec<f64>>,
    /// Synthetic mode: the unconditional rates of a golden acceptance file exported by
    /// `specula experiment export-golden` (natural measurements only; its k must match).
    #[arg(long)]
    synthetic_acceptance_rates_from: Option<PathBuf>,
    /// The whole speculative configuration as JSON, e.g. '{"method": "draft_model", "model": PATH,
    /// "num_speculative_tokens": 7, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 3.78}'.
    #[arg(long)]
    speculative_config: Option<String>,
}

impl SpecArgs {
    /// `default_draft`: the drafter used when neither --draft nor --speculative-config is given
    /// (the embedded default draft when the target is the embedded default target).
    /// `default_dspark`: the DSpark drafter used by method dspark without a model path (the one
    /// shipped with the embedded default target).
    fn config(
        &self,
        default_draft: Option<PathBuf>,
        default_dspark: Option<PathBuf>,
    ) -> Result<SpeculativeConfig> {
        let mut c = match &self.speculative_config {
            Some(j) => SpeculativeConfig::from_json(j)?,
            None => SpeculativeConfig::default(),
        };
        if self.draft.is_none() && self.speculative_config.is_none() {
            if let Some(d) = default_draft {
                c.method = SpeculativeMethod::DraftModel;
                c.model = Some(d.display().to_string());
            }
        }
        match self.draft.as_deref() {
            None => {}
            Some("none") => c.method = SpeculativeMethod::None,
            Some("ngram") => c.method = SpeculativeMethod::Ngram,
            Some("dspark") => {
                c.method = SpeculativeMethod::Dspark;
                c.model = None;
            }
            Some(path) => {
                c.method = SpeculativeMethod::DraftModel;
                c.model = Some(path.to_string());
            }
        }
        if c.method == SpeculativeMethod::Dspark && c.model.is_none() {
            c.model = default_dspark.map(|d| d.display().to_string());
        }
        if let Some(k) = self.num_draft_tokens {
            c.num_speculative_tokens = k;
        }
        if let Some(a) = &self.acceptance {
            c.rejection_sample_method = Some(a.clone());
        }
        if let Some(l) = self.synthetic_acceptance_length {
            c.synthetic_acceptance_length = Some(l);
        }
        if let Some(r) = &self.synthetic_acceptance_rates {
            c.synthetic_acceptance_rates = Some(r.clone());
        }
        if let Some(f) = &self.synthetic_acceptance_rates_from {
            c.synthetic_acceptance_rates_from = Some(f.display().to_string());
        }
        Ok(c)
    }
}

#[derive(Args)]
struct InvarianceArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    prompt: PromptArgs,
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Tokens per forward in the chunked pass.
    #[arg(long, default_value_t = 8)]
    chunk: usize,
}

/// The embedded default pair: `$SPECULA_DEFAULT_MODELS` or `models/default` of the source tree
/// this binary was built from.
fn default_models_dir() -> PathBuf {
    match std::env::var_os("SPECULA_DEFAULT_MODELS") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/default"),
    }
}

fn load_model(args: &ModelArgs) -> Result<LoadedModel> {
    let default_target = default_models_dir().join("target");
    let path = args.model.as_ref().unwrap_or(&default_target);
    let t = Instant::now();
    let loaded =
        load(path, args.dtype).with_context(|| format!("loading model {}", path.display()))?;
    let c = &loaded.model.config;
    eprintln!(
        "loaded {} ({}, {} layers, hidden {}, vocab {}, {:.2} B params, {} weights, {:.1} GB) in {:.1} s",
        path.display(),
        c.arch.name(),
        c.num_layers,
        c.hidden_size,
        c.vocab_size,
        c.num_parameters() as f64 / 1e9,
        loaded.model.weight_dtype_name(),
        loaded.model.weight_bytes() as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    Ok(loaded)
}

fn prompt_ids(loaded: &LoadedModel, p: &PromptArgs) -> Result<Vec<u32>> {
    let tok = loaded.tokenizer()?;
    let text = if p.chat {
        let mut messages = Vec::new();
        if let Some(s) = &p.system {
            messages.push(ChatMessage {
                role: "system".into(),
                content: s.clone(),
            });
        }
        messages.push(ChatMessage {
            role: "user".into(),
            content: p.prompt.clone(),
        });
        tok.apply_chat_template(&messages, true)?
    } else {
        p.prompt.clone()
    };
    let ids = tok.encode(&text, true)?;
    if ids.is_empty() {
        bail!("the prompt is empty: nothing to condition generation on");
    }
    Ok(ids)
}

fn cmd_generate(a: GenerateArgs) -> Result<()> {
    let embedded = a.model.model.is_none();
    let spec = a.spec.config(
        embedded.then(|| default_models_dir().join("draft")),
        embedded.then(|| default_models_dir().join("dspark")),
    )?;
    let rule = spec.rule(a.temperature)?;
    let additional = match &a.additional_config {
        Some(j) => AdditionalConfig::from_json(j)?,
        None => AdditionalConfig::default(),
    };
    // Before loading anything: a missing GPU is reported as that, with the CPU fallback.
    specula_engine::target::check_device(a.device.device)?;
    let loaded = load_model(&a.model)?;
    let tok = loaded.tokenizer()?;
    let target = build_target(
        a.device.device,
        &loaded.model,
        &TargetOptions {
            max_running: 1,
            max_positions: a.device.gpu_max_context,
            specialized_shapes: additional.specialized_shapes,
            ..TargetOptions::default()
        },
    )?;
    let context = target.max_positions();
    let mut drafter = build_drafter_on(
        &spec,
        &loaded,
        a.model.dtype,
        a.device.drafter_device(1, context),
    )?;
    let prompt_token_ids = prompt_ids(&loaded, &a.prompt)?;
    let req = GenerationRequest {
        prompt_ids: prompt_token_ids.clone(),
        max_new_tokens: a.max_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
        },
        seed: a.seed,
        stop_token_ids: if a.ignore_eos {
            Vec::new()
        } else {
            loaded.eos_token_ids()
        },
        vocab_limit: Some(tok.vocab_size()),
        stop_strings: a.stop.clone(),
        num_draft_tokens: spec.draft_tokens(),
    };
    let drafter_ref: Option<&mut dyn Drafter> = match &mut drafter {
        Some(d) => Some(&mut **d),
        None => None,
    };
    let out = generate_batch_on(
        target,
        additional.decode_backend,
        drafter_ref,
        &rule,
        std::slice::from_ref(&req),
        Some(tok),
    )?;
    let run = out.run;
    let out = out.outputs.into_iter().next().expect("one request");
    let mut text = tok.decode(&out.token_ids, true)?;
    // Like serving APIs, the stop string itself is not part of the returned text.
    if let Some(cut) = a.stop.iter().filter_map(|s| text.find(s.as_str())).min() {
        text.truncate(cut);
    }
    if a.json {
        let v = json!({
            "text": text,
            "token_ids": out.token_ids,
            "prompt_token_ids": prompt_token_ids,
            "finish_reason": out.finish_reason,
            "stats": out.stats,
            "run": run,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("{}{}", a.prompt.prompt, text);
        let s = &out.stats;
        let spec_line = match &s.speculative {
            Some(sp) if sp.drafter != "none" => format!(
                "; {} acceptance ({}, {} drafter, k={}): AL {:.2} over {} verify steps; draft {:.0} ms, verify {:.0} ms",
                sp.acceptance_mode,
                sp.acceptance_rule,
                sp.drafter,
                sp.num_draft_tokens,
                sp.acceptance_length.unwrap_or(f64::NAN),
                sp.num_verify_steps,
                sp.draft_ms,
                sp.verify_ms
            ),
            _ => String::new(),
        };
        eprintln!(
            "[{} prompt tokens, {} generated ({:?}); TTFT {:.0} ms; {:.2} tok/s decode{}]",
            s.prompt_tokens,
            s.generated_tokens,
            out.finish_reason,
            s.ttft_ms,
            s.decode_tokens_per_s,
            spec_line
        );
        let fallbacks: Vec<String> = run
            .decode_backend_fallbacks
            .iter()
            .map(|(reason, n)| format!("{n} steps: {reason}"))
            .collect();
        eprintln!(
            "[target on {} (acceptance rules on the {}); decode backend {}{}]",
            run.device,
            run.verifier,
            run.decode_backend,
            if fallbacks.is_empty() {
                String::new()
            } else {
                format!(", fell back to standard: {}", fallbacks.join(", "))
            }
        );
    }
    Ok(())
}

fn cmd_check_invariance(a: InvarianceArgs) -> Result<()> {
    if a.chunk == 0 {
        bail!("--chunk must be at least 1");
    }
    let loaded = load_model(&a.model)?;
    let model = &loaded.model;
    let prompt = prompt_ids(&loaded, &a.prompt)?;
    let req = GenerationRequest {
        prompt_ids: prompt.clone(),
        max_new_tokens: a.max_tokens,
        sampling: SamplingParams::greedy(),
        seed: 0,
        stop_token_ids: Vec::new(),
        vocab_limit: None,
        stop_strings: Vec::new(),
        num_draft_tokens: 0,
    };
    let first = generate(model, &req, |_| {})?;
    let second = generate(model, &req, |_| {})?;
    let deterministic = first.token_ids == second.token_ids;
    println!(
        "determinism: two greedy runs of {} tokens are {}",
        first.token_ids.len(),
        if deterministic {
            "identical"
        } else {
            "DIFFERENT"
        }
    );

    // Logits of every generated position, one token per forward vs `chunk` tokens per forward.
    let per_position = |chunk: usize| -> Result<Vec<Vec<u32>>> {
        let mut cache = model.new_cache(prompt.len() + first.token_ids.len() + 1);
        let seq = cache.add_sequence();
        model.forward(
            &mut cache,
            &[SeqInput {
                seq,
                tokens: &prompt,
                num_logits: 1,
            }],
            &[],
        )?;
        let mut rows = Vec::new();
        for block in first.token_ids.chunks(chunk) {
            let o = model.forward(
                &mut cache,
                &[SeqInput {
                    seq,
                    tokens: block,
                    num_logits: block.len(),
                }],
                &[],
            )?;
            for j in 0..block.len() {
                rows.push(o.row(0, j).iter().map(|x| x.to_bits()).collect());
            }
        }
        Ok(rows)
    };
    let one = per_position(1)?;
    let chunked = per_position(a.chunk)?;
    let mismatches = one.iter().zip(&chunked).filter(|(x, y)| x != y).count();
    println!(
        "batch invariance: logits of {} positions fed 1 at a time vs {} at a time: {} bit-identical, {} differ",
        one.len(),
        a.chunk,
        one.len() - mismatches,
        mismatches
    );
    let argmax_ok = first.token_ids.windows(2).zip(&chunked).all(|(w, row)| {
        let logits: Vec<f32> = row.iter().map(|&b| f32::from_bits(b)).collect();
        specula_kernels::sampling::argmax(&logits).ok() == Some(w[1])
    });
    println!("greedy ids from the chunked pass equal the generated ids: {argmax_ok}");
    if !deterministic || mismatches > 0 || !argmax_ok {
        bail!("invariance check failed");
    }
    Ok(())
}

fn acceptance_config(a: &AcceptanceArgs) -> Result<AcceptanceConfig> {
    let mut c = match &a.config {
        Some(path) => AcceptanceConfig::from_file(path)?,
        None => AcceptanceConfig {
            target: None,
            drafters: vec!["embedded".into()],
            draft_lengths: vec![5],
            temperatures: vec![0.0],
            rules: vec!["greedy".into(), "standard".into()],
            prompt_sets: Vec::new(),
            num_prompts: 20,
            max_new_tokens: 128,
            chat: ChatMode::Auto,
            seed: 0,
            batch_size: 1,
            on_bad_line: BadLinePolicy::Fail,
            dtype: "auto".into(),
            synthetic_acceptance_rates_from: None,
        },
    };
    if a.target.is_some() {
        c.target = a.target.clone();
    }
    if !a.drafters.is_empty() {
        c.drafters = a.drafters.clone();
    }
    if !a.draft_lengths.is_empty() {
        c.draft_lengths = a.draft_lengths.clone();
    }
    if !a.temperatures.is_empty() {
        c.temperatures = a.temperatures.clone();
    }
    if !a.rules.is_empty() {
        c.rules = a.rules.clone();
    }
    if !a.prompt_sets.is_empty() {
        c.prompt_sets = a.prompt_sets.iter().map(PromptSetSpec::from_path).collect();
    }
    for s in &mut c.prompt_sets {
        s.group_by_category |= a.by_category;
        if !a.categories.is_empty() {
            s.categories = a.categories.clone();
        }
    }
    if c.prompt_sets.is_empty() {
        bail!("no prompt sets: give --prompts FILE or prompt_sets in --config");
    }
    c.num_prompts = a.num_prompts.unwrap_or(c.num_prompts);
    c.max_new_tokens = a.max_new_tokens.unwrap_or(c.max_new_tokens);
    c.seed = a.seed.unwrap_or(c.seed);
    c.batch_size = a.batch_size.unwrap_or(c.batch_size);
    if let Some(m) = &a.chat {
        c.chat = m.parse().map_err(anyhow::Error::msg)?;
    }
    if let Some(p) = &a.on_bad_line {
        c.on_bad_line = p.parse().map_err(anyhow::Error::msg)?;
    }
    if let Some(g) = &a.synthetic_acceptance_rates_from {
        c.synthetic_acceptance_rates_from = Some(g.clone());
        c.rules = vec!["synthetic".into()];
    }
    Ok(c)
}

fn cmd_experiment(e: ExperimentCommand) -> Result<()> {
    match e {
        ExperimentCommand::Acceptance(a) => {
            let config = acceptance_config(&a)?;
            let opts = RunOptions {
                out_dir: a.out.clone(),
                default_models_dir: default_models_dir(),
                show_progress: !a.no_progress,
            };
            let report = run_acceptance(&config, &opts)
                .with_context(|| format!("acceptance experiment into {}", a.out.display()))?;
            eprintln!(
                "{} results written ({} already present), {} settings left out, {} bad prompt lines skipped, {:.1} s; see {}",
                report.results_written,
                report.results_already_present,
                report.skipped_settings.len(),
                report.bad_lines.len(),
                report.wall_s,
                a.out.join("table.md").display()
            );
            Ok(())
        }
        ExperimentCommand::ExportGolden(a) => {
            let golden = export_golden(
                &a.from,
                &GoldenSelection {
                    drafter: a.drafter,
                    k: a.k,
                    temperature: a.temperature,
                    rule: a.rule,
                    dataset: a.dataset,
                },
            )
            .with_context(|| format!("exporting a golden file from {}", a.from.display()))?;
            std::fs::write(&a.out, serde_json::to_string_pretty(&golden)? + "\n")
                .with_context(|| format!("writing {}", a.out.display()))?;
            eprintln!(
                "golden file {}: natural AL {:.3} over {} verify steps, k = {}, unconditional rates {:?}",
                a.out.display(),
                golden.acceptance_length,
                golden.num_verify_steps,
                golden.num_speculative_tokens,
                golden.unconditional_rates
            );
            Ok(())
        }
    }
}

fn cmd_serve(a: ServeArgs) -> Result<()> {
    let server = specula_server::Server::start(specula_server::ServerOptions {
        model: a.model,
        draft: a.draft,
        speculative_config: a.speculative_config,
        additional_config: a.additional_config,
        dtype: a.dtype,
        device: a.device.device,
        gpu_max_context: a.device.gpu_max_context,
        max_running: a.max_running,
        max_queue: a.max_queue,
        prefill_chunk_tokens: a.prefill_chunk,
    })?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("binding {}:{}", a.host, a.port))?;
        eprintln!("{}", server.description);
        eprintln!("listening on http://{}", listener.local_addr()?);
        server
            .serve(listener, specula_server::shutdown_signal())
            .await?;
        anyhow::Ok(())
    })
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(n) = cli.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("setting --threads")?;
    }
    match cli.command {
        Command::Generate(a) => cmd_generate(a),
        Command::CheckInvariance(a) => cmd_check_invariance(a),
        Command::Experiment(e) => cmd_experiment(e),
        Command::Serve(a) => cmd_serve(a),
        Command::Bench(BenchCommand::Step(a)) => cmd_bench_step(a),
        Command::Bench(BenchCommand::E2e(a)) => cmd_bench_e2e(a),
    }
}

#[cfg(feature = "cuda")]
fn cmd_bench_step(a: StepBenchArgs) -> Result<()> {
    use specula_experiments::step_bench::{run_step_bench, StepBenchConfig};
    run_step_bench(StepBenchConfig {
        random_weights: a.random_weights,
        model: a.model,
        seed: a.seed,
        batches: a.batches,
        tokens_per_seq: a.tokens,
        context: a.context,
        steps: a.steps,
        runs: a.runs,
        prompts: a.prompts,
        acceptance_length: a.acceptance_length,
        replay_reps: a.replay_reps,
        tune: !a.no_tune,
        backends: a
            .backends
            .iter()
            .map(|b| b.parse().map_err(|e| anyhow::anyhow!("--backends: {e}")))
            .collect::<Result<_>>()?,
        dataflow_max_rows: a.fused_dataflow_max_rows,
        producer: a.fused_producer,
        out_dir: a.out,
    })?;
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn cmd_bench_step(_: StepBenchArgs) -> Result<()> {
    bail!(
        "`specula bench step` needs the GPU backend: rebuild with `cargo build --release --features cuda`; \
         CPU timings: `cargo run --release -p specula-experiments --bin cpu_bench`"
    )
}

/// The configuration of `specula bench e2e`, checked (no GPU needed for that).
fn e2e_bench_config(a: E2eBenchArgs) -> Result<specula_experiments::e2e_bench::E2eBenchConfig> {
    use specula_experiments::e2e_bench::{parse_backend, parse_specialized_shapes, E2eBenchConfig};
    let cfg = E2eBenchConfig {
        random_weights: a.random_weights,
        seed: a.seed,
        backends: a
            .backends
            .iter()
            .map(|b| parse_backend(b).map_err(|e| anyhow::anyhow!("--backends: {e}")))
            .collect::<Result<_>>()?,
        drafter: a
            .drafter
            .parse()
            .map_err(|e| anyhow::anyhow!("--drafter: {e}"))?,
        requests: a.requests,
        k: a.k,
        acceptance_length: a.acceptance_length,
        context: a.context,
        max_tokens: a.max_tokens,
        runs: a.runs,
        temperature: a.temperature,
        tune: !a.no_tune,
        specialized_shapes: parse_specialized_shapes(&a.specialized_shapes)
            .map_err(|e| anyhow::anyhow!("--specialized-shapes: {e}"))?,
        out_dir: a.out,
    };
    cfg.validate().map_err(anyhow::Error::msg)?;
    Ok(cfg)
}

#[cfg(feature = "cuda")]
fn cmd_bench_e2e(a: E2eBenchArgs) -> Result<()> {
    let cfg = e2e_bench_config(a)?;
    specula_experiments::e2e_bench::run_e2e_bench(cfg).context("specula bench e2e")?;
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn cmd_bench_e2e(a: E2eBenchArgs) -> Result<()> {
    e2e_bench_config(a)?;
    bail!(
        "`specula bench e2e` needs the GPU backend: rebuild with `cargo build --release --features cuda` \
         (and run it on a machine with an NVIDIA GPU)"
    )
}
