//! CPU speed of the reference backend on real checkpoints: plain decode tokens/s and the time of one
//! 8-token verify forward, with memory use. Decode-only numbers (prefill excluded) for a single
//! request; nothing here is speculative, so there is no acceptance to state.
//!
//! cargo run --release -p specula-experiments --bin cpu_bench -- --model A.gguf --model B.gguf --out experiments/results/cpu_bench

use anyhow::{Context, Result};
use clap::Parser;
use serde::Serialize;
use specula_engine::stats::LatencySummary;
use specula_engine::{generate, GenerationRequest};
use specula_experiments::{memory_mib, sha256_file, Provenance};
use specula_kernels::sampling::SamplingParams;
use specula_model::loader::load;
use specula_model::{SeqInput, WeightDtype};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    #[arg(long, required = true)]
    model: Vec<PathBuf>,
    /// Prompt (token ids come from the model's tokenizer).
    #[arg(
        long,
        default_value = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    )]
    prompt: String,
    /// Tokens generated for the decode measurement.
    #[arg(long, default_value_t = 32)]
    decode_tokens: usize,
    /// Tokens per verify forward (k + 1).
    #[arg(long, default_value_t = 8)]
    verify_tokens: usize,
    #[arg(long, default_value_t = 7)]
    verify_repeats: usize,
    /// Output path prefix: writes PREFIX.json and PREFIX.md.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Serialize)]
struct ModelResult {
    path: String,
    sha256: String,
    arch: String,
    parameters: usize,
    weight_dtype: String,
    weight_gb: f64,
    load_s: f64,
    rss_after_load_mib: f64,
    prompt_tokens: usize,
    decode_tokens: usize,
    /// Decode-only: generated tokens after the first / their wall time.
    decode_tokens_per_s: f64,
    decode_inter_token: LatencySummary,
    verify_tokens: usize,
    /// One forward of `verify_tokens` new tokens at context prompt + decode_tokens.
    verify_forward: LatencySummary,
    peak_rss_mib: f64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let provenance = Provenance::collect();
    let mut results = Vec::new();
    for path in &args.model {
        let sha256 = sha256_file(path).with_context(|| format!("hashing {}", path.display()))?;
        let t = Instant::now();
        let loaded =
            load(path, WeightDtype::Auto).with_context(|| format!("loading {}", path.display()))?;
        let load_s = t.elapsed().as_secs_f64();
        let (rss_after_load_mib, _) = memory_mib();
        let model = &loaded.model;
        let prompt = loaded.tokenizer()?.encode(&args.prompt, true)?;
        let req = GenerationRequest {
            prompt_ids: prompt.clone(),
            max_new_tokens: args.decode_tokens,
            sampling: SamplingParams::greedy(),
            seed: 0,
            stop_token_ids: Vec::new(),
            vocab_limit: None,
            stop_strings: Vec::new(),
            num_draft_tokens: 0,
        };
        let out = generate(model, &req, |_| {})?;

        // Verify forward: k+1 tokens on top of the prompt and the generated text, rolled back after
        // each repetition so every repeat sees the same context.
        let mut cache = model.new_cache(prompt.len() + out.token_ids.len() + args.verify_tokens);
        let seq = cache.add_sequence();
        let context: Vec<u32> = prompt.iter().chain(&out.token_ids).copied().collect();
        model.forward(
            &mut cache,
            &[SeqInput {
                seq,
                tokens: &context,
                num_logits: 1,
            }],
            &[],
        )?;
        let block: Vec<u32> = out
            .token_ids
            .iter()
            .cycle()
            .take(args.verify_tokens)
            .copied()
            .collect();
        let mut times = Vec::new();
        for rep in 0..=args.verify_repeats {
            let t = Instant::now();
            model.forward(
                &mut cache,
                &[SeqInput {
                    seq,
                    tokens: &block,
                    num_logits: block.len(),
                }],
                &[],
            )?;
            let dt: Duration = t.elapsed();
            cache.truncate(seq, context.len())?;
            if rep > 0 {
                times.push(dt); // the first repeat warms caches and the allocator
            }
        }
        let (_, peak) = memory_mib();
        let r = ModelResult {
            path: path.display().to_string(),
            sha256,
            arch: model.config.arch.name().into(),
            parameters: model.config.num_parameters(),
            weight_dtype: model.weight_dtype_name().into(),
            weight_gb: model.weight_bytes() as f64 / 1e9,
            load_s,
            rss_after_load_mib,
            prompt_tokens: prompt.len(),
            decode_tokens: out.token_ids.len(),
            decode_tokens_per_s: out.stats.decode_tokens_per_s,
            decode_inter_token: out.stats.inter_token_latency.clone(),
            verify_tokens: args.verify_tokens,
            verify_forward: LatencySummary::from_durations(&times),
            peak_rss_mib: peak,
        };
        eprintln!(
            "{}: decode {:.2} tok/s, {}-token verify forward median {:.0} ms (P90 {:.0} ms), RSS {:.0} MiB",
            r.path, r.decode_tokens_per_s, r.verify_tokens, r.verify_forward.median_ms, r.verify_forward.p90_ms, r.rss_after_load_mib
        );
        results.push(r);
        drop(loaded);
    }
    let mut md = String::new();
    md.push_str(&format!(
        "# CPU reference backend speed\n\n{} on {} ({} cores, CPU kernel {}), git {}{}. Single request, greedy, decode-only \
         (prefill excluded); no speculation. Peak RSS is of the whole process up to that model.\n\n",
        provenance.date_utc, provenance.cpu, provenance.cores, provenance.cpu_kernel, &provenance.git_revision[..12.min(provenance.git_revision.len())],
        if provenance.git_dirty { " (dirty)" } else { "" }
    ));
    md.push_str("| model | params | weights | decode tok/s | inter-token median / P90 ms | verify fwd (tokens) median / P90 ms | RSS after load MiB | peak RSS MiB |\n|---|---|---|---|---|---|---|---|\n");
    for r in &results {
        md.push_str(&format!(
            "| {} | {:.2} B | {} {:.2} GB | {:.2} | {:.0} / {:.0} | ({}) {:.0} / {:.0} | {:.0} | {:.0} |\n",
            std::path::Path::new(&r.path).file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default(),
            r.parameters as f64 / 1e9,
            r.weight_dtype,
            r.weight_gb,
            r.decode_tokens_per_s,
            r.decode_inter_token.median_ms,
            r.decode_inter_token.p90_ms,
            r.verify_tokens,
            r.verify_forward.median_ms,
            r.verify_forward.p90_ms,
            r.rss_after_load_mib,
            r.peak_rss_mib
        ));
    }
    println!("{md}");
    if let Some(prefix) = &args.out {
        let json = serde_json::json!({ "provenance": provenance, "prompt": args.prompt, "results": results });
        std::fs::write(
            prefix.with_extension("json"),
            serde_json::to_string_pretty(&json)?,
        )?;
        std::fs::write(prefix.with_extension("md"), md)?;
    }
    Ok(())
}
