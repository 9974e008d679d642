//! The GPU forward against the CPU forward (the oracle) on a real checkpoint (default: the embedded
//! target): logits of a prompt, of an 8-token verify block, and greedy decoding token by token.
//! cargo build --release -p specula-experiments --features cuda --bin gpu_forward_check
//! Usage: gpu_forward_check [MODEL_DIR_OR_GGUF]

use anyhow::{Context, Result};
use specula_experiments::max_relative_error as max_rel;
use specula_kernels::sampling::argmax;
use specula_model::gpu::GpuTransformer;
use specula_model::loader::load;
use specula_model::{SeqInput, WeightDtype};
use std::time::Instant;

fn main() -> Result<()> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "models/default/target".into());
    let loaded =
        load(path.as_ref(), WeightDtype::Bf16).with_context(|| format!("loading {path}"))?;
    let cpu = &loaded.model;
    let vocab = cpu.config.vocab_size;
    let prompt = loaded.tokenizer()?.encode(
        "def read_config(path):\n    \"\"\"Read the configuration file at path.\"\"\"\n",
        true,
    )?;
    let mut gpu = GpuTransformer::upload(cpu, 1024).context("uploading to the GPU")?;
    println!(
        "model {path}, GPU {} ({}), prompt {} tokens",
        gpu.device.name,
        gpu.device.arch,
        prompt.len()
    );

    // Prompt logits.
    let mut cache = cpu.new_cache(1024);
    let seq = cache.add_sequence();
    let c_out = cpu.forward(
        &mut cache,
        &[SeqInput {
            seq,
            tokens: &prompt,
            num_logits: prompt.len(),
        }],
        &[],
    )?;
    let g_out = gpu.forward(&prompt)?;
    println!(
        "prompt logits ({} x {vocab}): max relative error {:.3e}",
        prompt.len(),
        max_rel(&g_out, &c_out.logits)
    );

    // Greedy decoding, one token per step on both; record divergence.
    let mut c_last = c_out.row(0, prompt.len() - 1).to_vec();
    let mut g_last = g_out[(prompt.len() - 1) * vocab..].to_vec();
    let (mut c_ids, mut g_ids) = (Vec::new(), Vec::new());
    let mut worst = 0f64;
    let mut step_ms = Vec::new();
    for _ in 0..64 {
        let (ct, gt) = (argmax(&c_last)?, argmax(&g_last)?);
        c_ids.push(ct);
        g_ids.push(gt);
        let o = cpu.forward(
            &mut cache,
            &[SeqInput {
                seq,
                tokens: &[ct],
                num_logits: 1,
            }],
            &[],
        )?;
        c_last = o.row(0, 0).to_vec();
        // Feed the GPU the CPU's token so both see the same context even after a near-tie.
        let t = Instant::now();
        g_last = gpu.forward(&[ct])?;
        step_ms.push(t.elapsed().as_secs_f64() * 1e3);
        worst = worst.max(max_rel(&g_last, &c_last));
    }
    let first_diff = c_ids.iter().zip(&g_ids).position(|(a, b)| a != b);
    println!(
        "greedy 64 tokens: max relative logits error {worst:.3e}; ids {} (first divergence at {:?})",
        if first_diff.is_none() { "identical" } else { "differ" },
        first_diff
    );

    // An 8-token verify block on top of that context, then rolled back.
    let block: Vec<u32> = c_ids[..8].to_vec();
    let len = gpu.len();
    let g_blk = gpu.forward(&block)?;
    gpu.truncate(len);
    let c_blk = cpu.forward(
        &mut cache,
        &[SeqInput {
            seq,
            tokens: &block,
            num_logits: 8,
        }],
        &[],
    )?;
    println!(
        "8-token verify block: max relative error {:.3e}",
        max_rel(&g_blk, &c_blk.logits)
    );
    step_ms.sort_by(f64::total_cmp);
    println!(
        "host-timed GPU decode step incl. logits copy (no graphs, not a benchmark): median {:.2} ms",
        step_ms[step_ms.len() / 2]
    );
    Ok(())
}
