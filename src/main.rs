//! `specula`: the command-line interface.

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use serde_json::json;
use specula_engine::{generate, GenerationRequest};
use specula_kernels::sampling::SamplingParams;
use specula_model::loader::{load, LoadedModel};
use specula_model::tokenizer::ChatMessage;
use specula_model::{SeqInput, WeightDtype};
use std::io::Write;
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

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt.
    Generate(GenerateArgs),
    /// Check that greedy generation is deterministic and that feeding the generated tokens
    /// k at a time gives bit-identical logits to feeding them one at a time.
    CheckInvariance(InvarianceArgs),
}

#[derive(Args)]
struct ModelArgs {
    /// A GGUF file, an HF model directory (config.json + *.safetensors + tokenizer.json), or a
    /// .safetensors file with config.json beside it.
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

fn load_model(args: &ModelArgs) -> Result<LoadedModel> {
    let Some(path) = &args.model else {
        bail!("no --model given (the embedded default model does not exist yet): pass a GGUF file or an HF model directory");
    };
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
    let loaded = load_model(&a.model)?;
    let tok = loaded.tokenizer()?;
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
    };
    let mut stream = tok.decode_stream();
    let mut stdout = std::io::stdout();
    if !a.json {
        print!("{}", a.prompt.prompt);
        stdout.flush().ok();
    }
    let mut stream_err = None;
    let out = generate(&loaded.model, &req, |t| {
        if a.json || stream_err.is_some() {
            return;
        }
        match stream.push(t) {
            Ok(Some(s)) => {
                print!("{s}");
                stdout.flush().ok();
            }
            Ok(None) => {}
            Err(e) => stream_err = Some(e),
        }
    })?;
    if let Some(e) = stream_err {
        return Err(e).context("detokenizing");
    }
    let text = tok.decode(&out.token_ids, true)?;
    if a.json {
        let v = json!({
            "text": text,
            "token_ids": out.token_ids,
            "prompt_token_ids": prompt_token_ids,
            "finish_reason": out.finish_reason,
            "stats": out.stats,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!();
        let s = &out.stats;
        eprintln!(
            "[{} prompt tokens, {} generated ({:?}); TTFT {:.0} ms; inter-token median {:.1} ms, P90 {:.1} ms; {:.2} tok/s decode]",
            s.prompt_tokens,
            s.generated_tokens,
            out.finish_reason,
            s.ttft_ms,
            s.inter_token_latency.median_ms,
            s.inter_token_latency.p90_ms,
            s.decode_tokens_per_s
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
    }
}
