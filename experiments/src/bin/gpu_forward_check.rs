//! The GPU forward against the CPU forward (the oracle):
//!
//! 1. the skinny tensor-core linear kernel against an f64 CPU reference on fresh random inputs, for
//!    the model shapes and 1..=64 activation rows, with and without accumulation;
//! 2. the embedded pair (`models/default/target`, `models/default/draft`) and tiny random models
//!    (llama with llama3 RoPE scaling, qwen2 with qkv bias, qwen3 with q/k norms; weights generated
//!    on the device by the seeded fill kernel and on the CPU by `random::random_transformer`):
//!    - one sequence: prompt logits, 48 greedy steps (1-token graph steps), an 8-token verify block;
//!    - a batch: four sequences with different prompt lengths prefilled in one call, a mixed step
//!      (1, 3, 8 and 16 new tokens in one direct launch), then verify steps of 8 tokens on three
//!      sequences (a graph of batch bucket 4, so one padded row), rolled back by a seeded accepted
//!      count after each step on both sides.
//!
//! Prints the maximum relative error (max |gpu - cpu| / max |cpu|) of each; the limit is 1e-2.
//! cargo build --release -p specula-experiments --features cuda --bin gpu_forward_check
//! Usage: gpu_forward_check [--quick]

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specula_experiments::max_relative_error as max_rel;
use specula_experiments::tiny_check_config;
use specula_kernels::cuda::{Gemm, GpuDevice, LinearBackend};
use specula_kernels::sampling::argmax;
use specula_model::gpu::{AttentionKernel, GpuOptions, GpuSeqInput, GpuTransformer, StepAblation};
use specula_model::loader::load;
use specula_model::random::random_transformer;
use specula_model::{Arch, SeqInput, Transformer, WeightDtype};

const LIMIT: f64 = 1e-2;

struct Tally {
    worst: f64,
    failures: Vec<String>,
}

impl Tally {
    fn check(&mut self, what: &str, err: f64) {
        let ok = err.is_finite() && err <= LIMIT;
        println!("  {what:<58} {err:.3e} {}", if ok { "ok" } else { "FAIL" });
        self.worst = self
            .worst
            .max(if err.is_finite() { err } else { f64::INFINITY });
        if !ok {
            self.failures.push(what.to_string());
        }
    }
}

fn bf16_round(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect()
}

/// The skinny kernel against an f64 reference over the same bf16 inputs.
fn check_skinny(tally: &mut Tally, rng: &mut ChaCha8Rng) -> Result<()> {
    println!("skinny linear kernel vs f64 CPU reference (bf16 inputs):");
    let dev = GpuDevice::new(0)?;
    let gemm = Gemm::new(&dev)?;
    let s = dev.stream.clone();
    for &(rows, cols) in &[
        (3072usize, 2048usize),
        (2048, 8192),
        (200, 160),
        (4864, 1536),
    ] {
        let w: Vec<f32> = bf16_round(
            &(0..rows * cols)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect::<Vec<_>>(),
        );
        let wbits: Vec<u16> = w
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        let dw = s.clone_htod(&wbits)?;
        for &n in &[1usize, 5, 8, 16, 31, 64] {
            let x = bf16_round(
                &(0..n * cols)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect::<Vec<_>>(),
            );
            let xbits: Vec<u16> = x
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            let dx = s.clone_htod(&xbits)?;
            let init: Vec<f32> = (0..n * rows)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let mut reference = vec![0f32; n * rows];
            for t in 0..n {
                for r in 0..rows {
                    let mut acc = 0f64;
                    for c in 0..cols {
                        acc += w[r * cols + c] as f64 * x[t * cols + c] as f64;
                    }
                    reference[t * rows + r] = acc as f32;
                }
            }
            for (splits, accumulate) in [(1u32, false), (1, true), (4, false), (4, true)] {
                // Poison (or the accumulate base) so unwritten outputs show.
                let base: Vec<f32> = if accumulate {
                    init.clone()
                } else {
                    vec![f32::NAN; n * rows]
                };
                let mut dy = s.clone_htod(&base)?;
                gemm.linear_with(
                    LinearBackend::Skinny { splits },
                    &dw,
                    &dx,
                    &mut dy,
                    rows,
                    cols,
                    n,
                    accumulate,
                )?;
                let got = s.clone_dtoh(&dy)?;
                let want: Vec<f32> = if accumulate {
                    reference.iter().zip(&init).map(|(a, b)| a + b).collect()
                } else {
                    reference.clone()
                };
                tally.check(
                    &format!(
                        "{rows}x{cols}, {n} rows, split-K {splits}{}",
                        if accumulate { ", accumulate" } else { "" }
                    ),
                    max_rel(&got, &want),
                );
            }
        }
    }
    Ok(())
}

fn cpu_logits(
    cpu: &Transformer,
    cache: &mut specula_model::PagedKvCache,
    seqs: &[specula_model::SeqId],
    blocks: &[&[u32]],
    num_logits: &[usize],
) -> Result<Vec<f32>> {
    let inputs: Vec<SeqInput> = seqs
        .iter()
        .zip(blocks)
        .zip(num_logits)
        .map(|((&seq, &tokens), &num_logits)| SeqInput {
            seq,
            tokens,
            num_logits,
        })
        .collect();
    Ok(cpu.forward(cache, &inputs, &[])?.logits)
}

fn gpu_logits(
    gpu: &mut GpuTransformer,
    seqs: &[usize],
    blocks: &[&[u32]],
    num_logits: &[usize],
) -> Result<Vec<f32>> {
    let inputs: Vec<GpuSeqInput> = seqs
        .iter()
        .zip(blocks)
        .zip(num_logits)
        .map(|((&seq, &tokens), &num_logits)| GpuSeqInput {
            seq,
            tokens,
            num_logits,
        })
        .collect();
    Ok(gpu.forward(&inputs)?.logits)
}

/// Both scenarios on one model pair.
fn check_model(
    tally: &mut Tally,
    name: &str,
    cpu: &Transformer,
    mut gpu: GpuTransformer,
    quick: bool,
) -> Result<()> {
    let vocab = cpu.config.vocab_size;
    println!("{name}:");
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let random_tokens = |rng: &mut ChaCha8Rng, n: usize| -> Vec<u32> {
        (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
    };

    // One sequence.
    let mut cache = cpu.new_cache(4096);
    let seq = cache.add_sequence();
    let gseq = gpu.add_sequence()?;
    let prompt = random_tokens(&mut rng, 18);
    let c = cpu_logits(cpu, &mut cache, &[seq], &[&prompt], &[prompt.len()])?;
    let g = gpu_logits(&mut gpu, &[gseq], &[&prompt], &[prompt.len()])?;
    tally.check(
        &format!("prompt logits ({} x {vocab})", prompt.len()),
        max_rel(&g, &c),
    );
    let mut last = c[(prompt.len() - 1) * vocab..].to_vec();
    let mut worst = 0f64;
    let mut diverged = None;
    let steps = if quick { 16 } else { 48 };
    for i in 0..steps {
        let t = argmax(&last)? as u32;
        let c = cpu_logits(cpu, &mut cache, &[seq], &[&[t]], &[1])?;
        let g = gpu
            .forward(&[GpuSeqInput {
                seq: gseq,
                tokens: &[t],
                num_logits: 1,
            }])?
            .logits;
        if diverged.is_none() && argmax(&g)? != argmax(&c)? {
            diverged = Some(i);
        }
        worst = worst.max(max_rel(&g, &c));
        last = c;
    }
    tally.check(
        &format!("{steps} greedy 1-token steps (graph), worst; ids differ at {diverged:?}"),
        worst,
    );
    let block = random_tokens(&mut rng, 8);
    let len = cache.len(seq)?;
    let c = cpu_logits(cpu, &mut cache, &[seq], &[&block], &[8])?;
    let g = gpu_logits(&mut gpu, &[gseq], &[&block], &[8])?;
    cache.truncate(seq, len)?;
    gpu.truncate(gseq, len)?;
    tally.check("8-token verify block", max_rel(&g, &c));
    gpu.remove_sequence(gseq)?;
    cache.remove_sequence(seq)?;

    // A batch of four sequences of different lengths: one to four key slices in attention_split
    // (128+ keys per slice), and slices of more than one 256-key tile where the context allows.
    let room = cpu.config.max_position_embeddings.min(2048) - 40;
    let lens = [5usize, 33, 300.min(room), 1400.min(room)];
    let seqs: Vec<_> = lens.iter().map(|_| cache.add_sequence()).collect();
    let gseqs: Vec<usize> = lens
        .iter()
        .map(|_| gpu.add_sequence())
        .collect::<Result<_, _>>()?;
    let prompts: Vec<Vec<u32>> = lens.iter().map(|&n| random_tokens(&mut rng, n)).collect();
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let nl = [2usize, 1, 3, 1];
    let c = cpu_logits(cpu, &mut cache, &seqs, &refs, &nl)?;
    let g = gpu_logits(&mut gpu, &gseqs, &refs, &nl)?;
    tally.check(
        &format!(
            "batched prefill, prompts of {}/{}/{}/{} tokens",
            lens[0], lens[1], lens[2], lens[3]
        ),
        max_rel(&g, &c),
    );
    let blocks: Vec<Vec<u32>> = [1usize, 3, 8, 16]
        .iter()
        .map(|&n| random_tokens(&mut rng, n))
        .collect();
    let refs: Vec<&[u32]> = blocks.iter().map(Vec::as_slice).collect();
    let nl: Vec<usize> = blocks.iter().map(Vec::len).collect();
    let c = cpu_logits(cpu, &mut cache, &seqs, &refs, &nl)?;
    let g = gpu_logits(&mut gpu, &gseqs, &refs, &nl)?;
    tally.check(
        "mixed step: 1, 3, 8, 16 new tokens, all logits",
        max_rel(&g, &c),
    );
    // Verify steps of 8 tokens on three sequences (graph, bucket 4), with rollback.
    let three = [0usize, 2, 3];
    let mut worst = 0f64;
    let rounds = if quick { 3 } else { 6 };
    for _ in 0..rounds {
        let blocks: Vec<Vec<u32>> = three.iter().map(|_| random_tokens(&mut rng, 8)).collect();
        let refs: Vec<&[u32]> = blocks.iter().map(Vec::as_slice).collect();
        let cs: Vec<_> = three.iter().map(|&i| seqs[i]).collect();
        let gs: Vec<_> = three.iter().map(|&i| gseqs[i]).collect();
        let starts: Vec<usize> = cs.iter().map(|&s| cache.len(s)).collect::<Result<_, _>>()?;
        let c = cpu_logits(cpu, &mut cache, &cs, &refs, &[8, 8, 8])?;
        let g = gpu_logits(&mut gpu, &gs, &refs, &[8, 8, 8])?;
        worst = worst.max(max_rel(&g, &c));
        for ((&cseq, &gseq), &start) in cs.iter().zip(&gs).zip(&starts) {
            let keep = start + 1 + rng.random_range(0..8usize);
            cache.truncate(cseq, keep)?;
            gpu.truncate(gseq, keep)?;
        }
    }
    tally.check(
        &format!("{rounds} verify steps, 3 seqs x 8 tokens (graph), rollback"),
        worst,
    );
    for (&s, &gs) in seqs.iter().zip(&gseqs) {
        if cache.len(s)? != gpu.seq_len(gs)? {
            bail!("cache lengths differ after rollback");
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let mut tally = Tally {
        worst: 0.0,
        failures: Vec::new(),
    };
    let mut rng = ChaCha8Rng::seed_from_u64(2026);
    check_skinny(&mut tally, &mut rng)?;
    let opts = GpuOptions {
        max_sequences: 4,
        max_positions: 2048,
        max_rows: 64,
        ..GpuOptions::default()
    };
    // Every scenario under each attention kernel: the launch-size choice (Auto) runs split-key
    // attention for small launches and whole-row attention for large ones, so forcing each covers
    // both kernels on short and long rows.
    let kernels = [
        AttentionKernel::Auto,
        AttentionKernel::Split,
        AttentionKernel::WholeRow,
    ];
    for path in ["models/default/target", "models/default/draft"] {
        let loaded =
            load(path.as_ref(), WeightDtype::Bf16).with_context(|| format!("loading {path}"))?;
        for attention in kernels {
            let mut gpu = GpuTransformer::upload(&loaded.model, opts.clone())?;
            println!("GPU {} ({})", gpu.device.name, gpu.device.arch);
            gpu.set_ablation(StepAblation {
                attention,
                ..Default::default()
            });
            let label = format!("{path}, attention {attention:?}");
            check_model(&mut tally, &label, &loaded.model, gpu, quick)?;
        }
    }
    for (name, arch, seed) in [
        (
            "random tiny llama (llama3 rope scaling, tied)",
            Arch::Llama,
            11u64,
        ),
        ("random tiny qwen2 (qkv bias, tied)", Arch::Qwen2, 12),
        ("random tiny qwen3 (q/k norm, untied)", Arch::Qwen3, 13),
    ] {
        let config = tiny_check_config(arch, false)?;
        let cpu = random_transformer(config.clone(), seed)?;
        for attention in kernels {
            let mut gpu = GpuTransformer::random(config.clone(), seed, opts.clone())?;
            gpu.set_ablation(StepAblation {
                attention,
                ..Default::default()
            });
            let label = format!("{name}, attention {attention:?}");
            check_model(&mut tally, &label, &cpu, gpu, quick)?;
        }
    }
    println!(
        "worst relative error {:.3e} (limit {LIMIT:.0e}); {} failures",
        tally.worst,
        tally.failures.len()
    );
    if !tally.failures.is_empty() {
        bail!("failed: {}", tally.failures.join("; "));
    }
    Ok(())
}
