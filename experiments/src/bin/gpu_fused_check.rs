//! The fused verify step (issue 6: the `latency_specialized` backend, `kernels/cuda/fused_step.cu`)
//! against the standard GPU step and the CPU forward (the oracle), on identical state.
//!
//! Every step of every scenario runs three times: on the GPU with the fused backend, then — after the
//! sequences are truncated back to where the step started — on the GPU with the standard backend (so the
//! state carried forward is the standard path's, and the fused path is never trusted for later steps),
//! and on the CPU. Reported per scenario: max relative error (max |a - b| / max |b|) fused vs CPU,
//! standard vs CPU and fused vs standard (limit 1e-2 each), whether fused and standard logits are
//! bit-identical, and in how many rows the greedy ids differ. A step the fused backend should take and
//! did not (or the reverse) is a failure.
//!
//! Models: the embedded pair (`models/default/target`, `models/default/draft`) and tiny random llama
//! (llama3 RoPE scaling), llama with attention bias (qkv and o bias), qwen2 (qkv bias) and qwen3 (q/k
//! norm, untied). Scenarios: one sequence (an 18-token prompt with all logits: a fallback, 17+ tokens;
//! greedy 1-token graph steps; an 8-token verify block, also through `step_argmax`), then eight
//! sequences (prompts of 5..1400 tokens: prefill-chunk fallbacks), a mixed 1/3/8/16-token step (direct
//! launch), verify steps of 3 x 8 tokens (graph bucket 4, one padded sequence), 8 x 16 tokens (128
//! rows: two 64-row GEMM passes), 5 x 4 tokens (bucket 8) and 8 x 1 tokens, 3 x 8 tokens with tapped
//! layers [last, 0, last] (the tapped outputs compared too, as DSpark reads them) and 4 x 1 tokens
//! with 9 tapped layers (a fallback), each with a seeded rollback.
//! Variants per model (the fused kernel follows the standard step's attention choice per launch shape,
//! which the variant forces or leaves to the launch size): the default fused launch (one CTA per SM,
//! the default weight ring, cooperative) with the launch-size attention choice; a 5-CTA fused grid
//! with a 2-slot ring of 256-column chunks filled by cp.async instead of the TMA engine (many tiles per
//! CTA, the ring wrapping constantly) with split-key
//! attention; the two-CTAs-per-SM kernel with row copies (16 per chunk) and whole-row attention; the embedded target also runs a
//! non-cooperative launch. The fused GEMM (v1, weights through the shared-memory ring) sums in another
//! order than the standard step's kernels, so fused and standard agree to rounding ("not
//! bit-identical" is expected; v0 was bit-identical).
//!
//! `--bench`: llama3.2-1b with seeded random weights; device time per graph replay (CUDA events, the
//! mean of 10 back-to-back replays per sample) of the standard step (GEMMs tuned as in `specula bench
//! step`) and of the fused step and its variants (1024-column ring chunks, row copies, cp.async copies, barriers only, no
//! attention) at
//! 1/2/4/8 requests x 1/8 tokens, at `--context` cached positions; medians and P90 in a table, plus the
//! fused-vs-standard logits difference of each setting.
//!
//! cargo build --release -p specula-experiments --features cuda --bin gpu_fused_check
//! Usage: gpu_fused_check [--quick] [--no-cooperative]
//!        gpu_fused_check --bench [--context N] [--samples N] [--no-tune] [--seed N] [--no-cooperative] [--short [--v2-profile [--v2-profile-cta]]]
//!                        [--v2-producer IN[:L2[:PACE[:LEAD[:ROWS]]]],...] [--v2-kernels A.cu,B.cu,...]
//! (`--short`: only the standard, the v1 and the v2 step, no profile (`--v2-profile`: v2's
//! profile at 1 x 1 and 1 x 8 all the same; `--v2-profile-cta`: also every CTA's raw slots, for
//! the timeline kernel's per-CTA events, `experiments/fused/timeline_table.py --per-cta`); with
//! SPECULA_FUSED_STEP_CU set to another fused_step.cu, an A/B of kernel versions in one device call,
//! NOTES v0.12. `--v2-producer 2,3,2:4:2000,2:::4:8`: v2 again with each of these producer settings
//! (FusedOptions::copies_in_flight, l2_copies_in_flight, l2_prefetch_interval, l2_prefetch_lead,
//! l2_prefetch_max_rows; an empty or absent field keeps the kernel's default), timed beside the default
//! v2 step at every shape in the same process without recompiling; their logits must equal the default
//! v2 step's bit for bit. `--v2-kernels a.cu,b.cu`: v2 again with each of these fused_step.cu versions
//! (GpuTransformer::set_fused_variant: each compiled once, then switched to at every shape in the same
//! process), each shape's line giving its time against the default v2 step's and its logits against the
//! standard step's; the A/B of `run_fused_h200.sh abx`, without one process and one tuning per kernel.)

#[path = "../../../verifier/tests/common/mod.rs"]
mod common;

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specula_experiments::max_relative_error as max_rel;
use specula_experiments::step_bench::{copy_bandwidth, percentile, skinny_times};
use specula_experiments::tiny_check_config;
use specula_kernels::sampling::{self, argmax, SamplingParams};
use specula_model::gpu::fused::{
    FusedMode, FusedOptions, ProducerSettings, StepBackend, DATAFLOW_MAX_ROWS,
};
use specula_model::gpu::{AttentionKernel, GpuOptions, GpuSeqInput, GpuTransformer, StepAblation};
use specula_model::loader::load;
use specula_model::random::{preset, random_transformer};
use specula_model::{Arch, PagedKvCache, SeqId, SeqInput, Transformer, WeightDtype};
use specula_verifier::{AcceptanceRule, DraftProbs, VerifyInput};

const LIMIT: f64 = 1e-2;

#[derive(Default)]
struct Tally {
    worst: f64,
    failures: Vec<String>,
}

impl Tally {
    fn fail(&mut self, what: String) {
        println!("    FAIL: {what}");
        self.failures.push(what);
    }
}

/// Aggregate over the steps of one scenario.
#[derive(Default)]
struct Agg {
    fused_cpu: f64,
    standard_cpu: f64,
    fused_standard: f64,
    bit_identical: bool,
    rows: usize,
    ids_fused_standard: usize,
    ids_fused_cpu: usize,
    steps: usize,
    fused_steps: usize,
    expected_fused: usize,
    /// Tapped layers' outputs (when the scenario taps): max relative errors and bit-identity.
    tapped: bool,
    hidden_fused_cpu: f64,
    hidden_fused_standard: f64,
    hidden_bit_identical: bool,
}

impl Agg {
    fn new() -> Agg {
        Agg {
            bit_identical: true,
            hidden_bit_identical: true,
            ..Default::default()
        }
    }

    fn add_hidden(&mut self, f: &[Vec<f32>], s: &[Vec<f32>], c: &[Vec<f32>]) {
        if c.is_empty() {
            return;
        }
        self.tapped = true;
        if f.len() != c.len() || s.len() != c.len() {
            self.hidden_fused_cpu = f64::INFINITY;
            return;
        }
        for ((f, s), c) in f.iter().zip(s).zip(c) {
            self.hidden_fused_cpu = self.hidden_fused_cpu.max(max_rel(f, c));
            self.hidden_fused_standard = self.hidden_fused_standard.max(max_rel(f, s));
            self.hidden_bit_identical &=
                f.len() == s.len() && f.iter().zip(s).all(|(a, b)| a.to_bits() == b.to_bits());
        }
    }

    fn add(&mut self, f: &[f32], s: &[f32], c: &[f32], vocab: usize) {
        self.fused_cpu = self.fused_cpu.max(max_rel(f, c));
        self.standard_cpu = self.standard_cpu.max(max_rel(s, c));
        self.fused_standard = self.fused_standard.max(max_rel(f, s));
        self.bit_identical &=
            f.len() == s.len() && f.iter().zip(s).all(|(a, b)| a.to_bits() == b.to_bits());
        for ((fr, sr), cr) in f.chunks(vocab).zip(s.chunks(vocab)).zip(c.chunks(vocab)) {
            let (fi, si, ci) = (
                argmax(fr).unwrap_or(u32::MAX),
                argmax(sr).unwrap_or(u32::MAX),
                argmax(cr).unwrap_or(u32::MAX),
            );
            self.ids_fused_standard += usize::from(fi != si);
            self.ids_fused_cpu += usize::from(fi != ci);
            self.rows += 1;
        }
    }

    fn report(&self, tally: &mut Tally, what: &str) {
        let mut errs = vec![self.fused_cpu, self.standard_cpu, self.fused_standard];
        if self.tapped {
            errs.extend([self.hidden_fused_cpu, self.hidden_fused_standard]);
            println!(
                "  {what:<52} tapped layers: fused~cpu {:.2e} fused~std {:.2e} {}",
                self.hidden_fused_cpu,
                self.hidden_fused_standard,
                if self.hidden_bit_identical {
                    "bit-identical"
                } else {
                    "not bit-identical"
                }
            );
        }
        let ok = errs.iter().all(|e| e.is_finite() && *e <= LIMIT);
        println!(
            "  {what:<52} fused~cpu {:.2e} std~cpu {:.2e} fused~std {:.2e} {} | ids fused/std differ {}/{} rows, fused/cpu {} | fused {}/{} steps (expected {}) {}",
            self.fused_cpu,
            self.standard_cpu,
            self.fused_standard,
            if self.bit_identical { "bit-identical" } else { "not bit-identical" },
            self.ids_fused_standard,
            self.rows,
            self.ids_fused_cpu,
            self.fused_steps,
            self.steps,
            self.expected_fused,
            if ok && self.fused_steps == self.expected_fused { "ok" } else { "FAIL" },
        );
        for e in errs {
            tally.worst = tally
                .worst
                .max(if e.is_finite() { e } else { f64::INFINITY });
        }
        if !ok {
            tally
                .failures
                .push(format!("{what}: logits over the limit"));
        }
        if self.fused_steps != self.expected_fused {
            tally.failures.push(format!(
                "{what}: the fused kernel ran {} of {} steps, expected {}",
                self.fused_steps, self.steps, self.expected_fused
            ));
        }
    }
}

/// One step's logits (and tapped layers' outputs) on each path.
struct StepLogits {
    fused: Vec<f32>,
    standard: Vec<f32>,
    cpu: Vec<f32>,
    fused_hidden: Vec<Vec<f32>>,
    standard_hidden: Vec<Vec<f32>>,
    cpu_hidden: Vec<Vec<f32>>,
    /// Whether the fused backend's run actually took the fused kernel.
    fused_ran: bool,
}

/// The CPU model and cache and the GPU model, stepped together.
struct Pair<'a> {
    cpu: &'a Transformer,
    cache: PagedKvCache,
    gpu: &'a mut GpuTransformer,
    /// Layers every step taps (the outputs are compared too), as a DSpark drafter asks.
    taps: Vec<usize>,
}

impl Pair<'_> {
    /// One step of `blocks[i]` new tokens for sequence i (logits for the last `nl[i]`), fused then
    /// standard on the same GPU state, then on the CPU.
    fn step(
        &mut self,
        cseqs: &[SeqId],
        gseqs: &[usize],
        blocks: &[&[u32]],
        nl: &[usize],
    ) -> Result<StepLogits> {
        let inputs: Vec<GpuSeqInput> = gseqs
            .iter()
            .zip(blocks)
            .zip(nl)
            .map(|((&seq, &tokens), &num_logits)| GpuSeqInput {
                seq,
                tokens,
                num_logits,
            })
            .collect();
        let starts: Vec<usize> = gseqs
            .iter()
            .map(|&s| self.gpu.seq_len(s))
            .collect::<Result<_, _>>()?;
        self.gpu.set_step_backend(StepBackend::LatencySpecialized)?;
        let f = self.gpu.forward_tapped(&inputs, &self.taps)?;
        let fused = self.gpu.last_step_fused();
        for (&s, &start) in gseqs.iter().zip(&starts) {
            self.gpu.truncate(s, start)?;
        }
        self.gpu.set_step_backend(StepBackend::Standard)?;
        let s = self.gpu.forward_tapped(&inputs, &self.taps)?;
        let cin: Vec<SeqInput> = cseqs
            .iter()
            .zip(blocks)
            .zip(nl)
            .map(|((&seq, &tokens), &num_logits)| SeqInput {
                seq,
                tokens,
                num_logits,
            })
            .collect();
        let c = self.cpu.forward(&mut self.cache, &cin, &self.taps)?;
        Ok(StepLogits {
            fused: f.logits,
            standard: s.logits,
            cpu: c.logits,
            fused_hidden: f.hidden,
            standard_hidden: s.hidden,
            cpu_hidden: c.hidden,
            fused_ran: fused,
        })
    }

    /// `step` and its aggregate, with the expectation of whether the fused kernel takes it.
    #[allow(clippy::too_many_arguments)]
    fn step_into(
        &mut self,
        agg: &mut Agg,
        cseqs: &[SeqId],
        gseqs: &[usize],
        blocks: &[&[u32]],
        nl: &[usize],
        expect_fused: bool,
    ) -> Result<Vec<f32>> {
        let r = self.step(cseqs, gseqs, blocks, nl)?;
        agg.add(&r.fused, &r.standard, &r.cpu, self.cpu.config.vocab_size);
        agg.add_hidden(&r.fused_hidden, &r.standard_hidden, &r.cpu_hidden);
        agg.steps += 1;
        agg.fused_steps += usize::from(r.fused_ran);
        agg.expected_fused += usize::from(expect_fused);
        Ok(r.cpu)
    }

    /// Rolls sequence i back to `start_i + 1 + r` positions, r seeded in 0..t (a verify step's
    /// accepted prefix), on both sides.
    fn rollback(
        &mut self,
        cseqs: &[SeqId],
        gseqs: &[usize],
        starts: &[usize],
        t: usize,
        rng: &mut ChaCha8Rng,
    ) -> Result<()> {
        for ((&c, &g), &start) in cseqs.iter().zip(gseqs).zip(starts) {
            let keep = start + 1 + rng.random_range(0..t);
            self.cache.truncate(c, keep)?;
            self.gpu.truncate(g, keep)?;
        }
        Ok(())
    }
}

fn random_tokens(rng: &mut ChaCha8Rng, vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

/// Every scenario on one model; leaves the GPU model without sequences.
fn check_model(
    tally: &mut Tally,
    cpu: &Transformer,
    gpu: &mut GpuTransformer,
    quick: bool,
) -> Result<()> {
    let vocab = cpu.config.vocab_size;
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let mut p = Pair {
        cpu,
        cache: cpu.new_cache(16384),
        gpu,
        taps: Vec::new(),
    };

    // One sequence.
    let seq = p.cache.add_sequence();
    let gseq = p.gpu.add_sequence()?;
    let prompt = random_tokens(&mut rng, vocab, 18);
    let mut agg = Agg::new();
    let c = p.step_into(&mut agg, &[seq], &[gseq], &[&prompt], &[18], false)?;
    agg.report(tally, "prompt of 18 tokens, all logits (fallback)");
    let mut last = c[17 * vocab..].to_vec();
    let mut agg = Agg::new();
    let steps = if quick { 12 } else { 32 };
    for _ in 0..steps {
        let t = argmax(&last)?;
        last = p.step_into(&mut agg, &[seq], &[gseq], &[&[t]], &[1], true)?;
    }
    agg.report(tally, &format!("{steps} greedy 1-token steps (graph)"));
    let block = random_tokens(&mut rng, vocab, 8);
    let len = p.cache.len(seq)?;
    let mut agg = Agg::new();
    let _ = p.step_into(&mut agg, &[seq], &[gseq], &[&block], &[8], true)?;
    agg.report(tally, "8-token verify block (graph)");
    // The greedy ids of the fused step as the engine reads them (argmax_rows after fused_forward).
    p.cache.truncate(seq, len)?;
    p.gpu.truncate(gseq, len)?;
    p.gpu.set_step_backend(StepBackend::LatencySpecialized)?;
    let inputs = [GpuSeqInput {
        seq: gseq,
        tokens: &block,
        num_logits: 8,
    }];
    let ids = p.gpu.step_argmax(&inputs)?;
    p.gpu.truncate(gseq, len)?;
    let logits = p.gpu.forward(&inputs)?.logits;
    let host: Vec<u32> = logits.chunks(vocab).map(argmax).collect::<Result<_, _>>()?;
    println!(
        "  {:<52} {}",
        "fused step_argmax ids = host argmax of fused logits",
        if ids == host { "ok" } else { "FAIL" }
    );
    if ids != host {
        tally.fail(format!("fused step_argmax {ids:?} vs host argmax {host:?}"));
    }
    p.gpu.set_step_backend(StepBackend::Standard)?;
    p.gpu.truncate(gseq, len)?;
    p.gpu.remove_sequence(gseq)?;
    p.cache.remove_sequence(seq)?;

    // Eight sequences of different lengths (one to four attention key slices; long rows with several
    // 256-key tiles where the context allows).
    // The scenarios below grow each sequence by up to ~160 positions (kept drafts after rollback).
    let room = cpu.config.max_position_embeddings.min(2048) - 200;
    let lens = [5usize, 33, 300, 1400, 9, 17, 64, 130].map(|n| n.min(room));
    let cseqs: Vec<SeqId> = lens.iter().map(|_| p.cache.add_sequence()).collect();
    let gseqs: Vec<usize> = lens
        .iter()
        .map(|_| p.gpu.add_sequence())
        .collect::<Result<_, _>>()?;
    let prompts: Vec<Vec<u32>> = lens
        .iter()
        .map(|&n| random_tokens(&mut rng, vocab, n))
        .collect();
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let nl = [2usize, 1, 3, 1, 1, 1, 1, 1];
    let mut agg = Agg::new();
    let _ = p.step_into(&mut agg, &cseqs, &gseqs, &refs, &nl, false)?;
    agg.report(tally, "8 prompts of 5..1400 tokens (prefill fallback)");

    let four = [0usize, 1, 2, 3];
    let blocks: Vec<Vec<u32>> = [1usize, 3, 8, 16]
        .iter()
        .map(|&n| random_tokens(&mut rng, vocab, n))
        .collect();
    let refs: Vec<&[u32]> = blocks.iter().map(Vec::as_slice).collect();
    let nl: Vec<usize> = blocks.iter().map(Vec::len).collect();
    let cs: Vec<SeqId> = four.iter().map(|&i| cseqs[i]).collect();
    let gs: Vec<usize> = four.iter().map(|&i| gseqs[i]).collect();
    let mut agg = Agg::new();
    let _ = p.step_into(&mut agg, &cs, &gs, &refs, &nl, true)?;
    agg.report(tally, "mixed step: 1, 3, 8, 16 tokens, all logits (direct)");

    let rounds = if quick { 2 } else { 4 };
    let last = cpu.config.num_layers - 1;
    let nine: Vec<usize> = (0..9).map(|i| i % cpu.config.num_layers).collect();
    let none: Vec<usize> = Vec::new();
    for (label, which, t, taps, expect_fused) in [
        (
            "verify 3 seqs x 8 tokens (bucket 4, padded)",
            vec![0usize, 2, 3],
            8usize,
            none.clone(),
            true,
        ),
        (
            "verify 8 seqs x 16 tokens (128 rows)",
            (0..8).collect(),
            16,
            none.clone(),
            true,
        ),
        (
            "verify 5 seqs x 4 tokens (bucket 8, padded)",
            vec![1, 3, 4, 6, 7],
            4,
            none.clone(),
            true,
        ),
        (
            "decode 8 seqs x 1 token",
            (0..8).collect(),
            1,
            none.clone(),
            true,
        ),
        // As a DSpark drafter asks: tapped layers in any order, repeated.
        (
            "verify 3 x 8 tokens, tapped layers [last, 0, last]",
            vec![0, 2, 3],
            8,
            vec![last, 0, last],
            true,
        ),
        (
            "decode 4 x 1 token, 9 tapped layers (fallback)",
            vec![0, 1, 2, 3],
            1,
            nine.clone(),
            false,
        ),
    ] {
        p.gpu.reserve_tapped_layers(taps.len())?;
        p.taps = taps;
        let cs: Vec<SeqId> = which.iter().map(|&i| cseqs[i]).collect();
        let gs: Vec<usize> = which.iter().map(|&i| gseqs[i]).collect();
        let mut agg = Agg::new();
        for _ in 0..rounds {
            let blocks: Vec<Vec<u32>> = which
                .iter()
                .map(|_| random_tokens(&mut rng, vocab, t))
                .collect();
            let refs: Vec<&[u32]> = blocks.iter().map(Vec::as_slice).collect();
            let starts: Vec<usize> = cs
                .iter()
                .map(|&s| p.cache.len(s))
                .collect::<Result<_, _>>()?;
            let nl = vec![t; which.len()];
            let _ = p.step_into(&mut agg, &cs, &gs, &refs, &nl, expect_fused)?;
            p.rollback(&cs, &gs, &starts, t, &mut rng)?;
        }
        agg.report(tally, &format!("{label}, {rounds} rounds, rollback"));
    }
    p.taps.clear();
    for (&c, &g) in cseqs.iter().zip(&gseqs) {
        if p.cache.len(c)? != p.gpu.seq_len(g)? {
            bail!("cache lengths differ after rollback");
        }
        p.gpu.remove_sequence(g)?;
    }
    Ok(())
}

/// Every variant of the check on one model.
fn check_variants(
    tally: &mut Tally,
    name: &str,
    cpu: &Transformer,
    gpu: &mut GpuTransformer,
    quick: bool,
    non_cooperative: bool,
    cooperative: bool,
) -> Result<()> {
    gpu.set_step_backend(StepBackend::LatencySpecialized)?;
    if let Some(i) = gpu.fused_info() {
        println!(
            "{name}: {} grid {} x {} threads, {} B dynamic shared memory, {} CTA(s) per SM fit, {} SMs, whole-row attention {}, weight ring {} x {}-column chunks",
            i.kernel, i.grid, i.threads, i.smem_bytes, i.blocks_per_sm, i.num_sms, i.whole_row_attention, i.ring_stages, i.chunk_k
        );
    }
    gpu.set_step_backend(StepBackend::Standard)?;
    let mut variants = vec![
        (
            "fused default (v2 for <= 8 rows of <= 32 queries per attention item, else v1) / standard Auto attention",
            FusedOptions::default(),
            AttentionKernel::Auto,
        ),
        (
            "fused v1 only / standard Auto attention",
            FusedOptions {
                dataflow: false,
                ..Default::default()
            },
            AttentionKernel::Auto,
        ),
        (
            "fused v1, 5 CTAs, 2 ring slots of 256 columns by cp.async / standard Split attention",
            FusedOptions {
                grid: Some(5),
                ring_stages: 2,
                chunk_k: 256,
                ldgsts: true,
                dataflow: false,
                ..Default::default()
            },
            AttentionKernel::Split,
        ),
        (
            "fused v1, 2 CTAs per SM, row copies / standard WholeRow attention (both)",
            FusedOptions {
                ctas_per_sm: 2,
                whole_tile_copies: false,
                dataflow: false,
                ..Default::default()
            },
            AttentionKernel::WholeRow,
        ),
        (
            "fused v2 (dataflow) for <= 16 rows / standard Auto attention",
            FusedOptions {
                dataflow_max_rows: DATAFLOW_MAX_ROWS,
                dataflow_max_queries: usize::MAX,
                ..Default::default()
            },
            AttentionKernel::Auto,
        ),
        (
            "fused v2 (dataflow) for <= 16 rows, 5 CTAs / standard Split attention",
            FusedOptions {
                dataflow_max_rows: DATAFLOW_MAX_ROWS,
                dataflow_max_queries: usize::MAX,
                grid: Some(5),
                ..Default::default()
            },
            AttentionKernel::Split,
        ),
    ];
    if non_cooperative {
        variants.push((
            "fused non-cooperative launch / standard Auto attention",
            FusedOptions {
                cooperative: false,
                ..Default::default()
            },
            AttentionKernel::Auto,
        ));
    }
    for (label, opts, attention) in variants {
        println!("{name}, {label}:");
        // --no-cooperative: every fused launch without the attribute.
        let opts = FusedOptions {
            cooperative: opts.cooperative && cooperative,
            ..opts
        };
        gpu.set_fused_options(opts)?;
        gpu.set_ablation(StepAblation {
            attention,
            ..Default::default()
        });
        if let Some(i) = gpu.fused_info() {
            println!(
                "  ({}, grid {}, {} B shared; 1 row runs {}, 16 rows {}, 17 rows {}; v2 shared {} B, grid {} in clusters of {})",
                i.kernel,
                i.grid,
                i.smem_bytes,
                gpu.fused_kernel_for(1, 1).unwrap_or("-"),
                gpu.fused_kernel_for(16, 16).unwrap_or("-"),
                gpu.fused_kernel_for(17, 17).unwrap_or("-"),
                i.dataflow_smem_bytes,
                i.dataflow_grid,
                i.dataflow_cluster
            );
        }
        check_model(tally, cpu, gpu, quick)?;
    }
    println!(
        "  fused steps {}, fallbacks {:?}, graph error {:?}",
        gpu.fused_steps(),
        gpu.fused_fallbacks(),
        gpu.graph_error()
    );
    if let Some(e) = gpu.graph_error() {
        tally.fail(format!("{name}: CUDA graph capture failed: {e}"));
    }
    Ok(())
}

fn check(quick: bool, cooperative: bool) -> Result<()> {
    let mut tally = Tally::default();
    let opts = GpuOptions {
        max_sequences: 8,
        max_positions: 2048,
        max_rows: 128,
        ..Default::default()
    };
    for (i, path) in ["models/default/target", "models/default/draft"]
        .into_iter()
        .enumerate()
    {
        let loaded =
            load(path.as_ref(), WeightDtype::Bf16).with_context(|| format!("loading {path}"))?;
        let mut gpu = GpuTransformer::upload(&loaded.model, opts.clone())?;
        println!("GPU {} ({})", gpu.device.name, gpu.device.arch);
        check_variants(
            &mut tally,
            path,
            &loaded.model,
            &mut gpu,
            quick,
            i == 0,
            cooperative,
        )?;
    }
    for (name, arch, bias, seed) in [
        (
            "random tiny llama (llama3 rope scaling, tied)",
            Arch::Llama,
            false,
            11u64,
        ),
        (
            "random tiny llama with attention bias (qkv + o bias)",
            Arch::Llama,
            true,
            14,
        ),
        ("random tiny qwen2 (qkv bias, tied)", Arch::Qwen2, false, 12),
        (
            "random tiny qwen3 (q/k norm, untied)",
            Arch::Qwen3,
            false,
            13,
        ),
    ] {
        let config = tiny_check_config(arch, bias)?;
        let cpu = random_transformer(config.clone(), seed)?;
        let mut gpu = GpuTransformer::random(config, seed, opts.clone())?;
        check_variants(&mut tally, name, &cpu, &mut gpu, quick, false, cooperative)?;
    }
    println!("speculative sampling through each step backend (standard rule, T = 1, k = 2):");
    distribution_check(&mut tally, quick)?;
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

// ---------------------------------------------------------------------------------------------------
// Distribution: speculative sampling through each step backend is lossless

/// The standard path's end-to-end distribution test, on both backends: the embedded default target
/// (vocab 4096; a trained model, so p1 is peaked enough for the test to have power: entropy 4.25 nats),
/// a fixed text prefix, and per trial two drafts drawn from fixed draft distributions (q1 = 0.7 p1 + 0.3
/// uniform, q2 = a random row), verified in one GPU step (fused or standard) whose logits give the
/// target rows (T = 1), then the standard rule (the verifier, seeded uniforms), and the step rolled
/// back. The first emitted token must be distributed as p1, the target's distribution after the prefix
/// from the CPU reference forward: chi-square p-value above 1e-3 (cells of expected count < 5 pooled).
/// The same counts against p1 at temperature 1.1 (total variation 0.074 from p1) must be rejected
/// (p < 1e-3), which shows the test can fail.
fn distribution_check(tally: &mut Tally, quick: bool) -> Result<()> {
    let trials = if quick { 20_000 } else { 60_000 };
    let path = "models/default/target";
    let loaded =
        load(path.as_ref(), WeightDtype::Bf16).with_context(|| format!("loading {path}"))?;
    let cpu = &loaded.model;
    let vocab = cpu.config.vocab_size;
    let opts = GpuOptions {
        max_sequences: 2,
        max_positions: 256,
        max_rows: 16,
        ..Default::default()
    };
    let mut gpu = GpuTransformer::upload(cpu, opts)?;
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let prompt = loaded
        .tokenizer()?
        .encode("def fibonacci(n):\n    if n < 2:\n        return", false)?;
    let t1 = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
    };
    // p1 on the CPU: the prompt's last row.
    let mut cache = cpu.new_cache(256);
    let cseq = cache.add_sequence();
    let out = cpu.forward(
        &mut cache,
        &[SeqInput {
            seq: cseq,
            tokens: &prompt,
            num_logits: 1,
        }],
        &[],
    )?;
    let p1 = sampling::probabilities(&out.logits, &t1)?;
    let q1: Vec<f32> = p1.iter().map(|&p| 0.7 * p + 0.3 / vocab as f32).collect();
    let q2_logits: Vec<f32> = (0..vocab).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    let q2 = sampling::probabilities(&q2_logits, &t1)?;
    let hot = sampling::probabilities(
        &out.logits,
        &SamplingParams {
            temperature: 1.1,
            ..t1
        },
    )?;
    let expected: Vec<f64> = p1.iter().map(|&p| p as f64).collect();
    let wrong: Vec<f64> = hot.iter().map(|&p| p as f64).collect();
    // The GPU prefix: all of the prompt but its last token, which each trial's block starts with
    // (the pending token of a verify step).
    let gseq = gpu.add_sequence()?;
    let head = &prompt[..prompt.len() - 1];
    gpu.forward(&[GpuSeqInput {
        seq: gseq,
        tokens: head,
        num_logits: 1,
    }])?;
    let start = gpu.seq_len(gseq)?;
    for backend in [StepBackend::Standard, StepBackend::LatencySpecialized] {
        gpu.set_step_backend(backend)?;
        let mut counts = vec![0u64; vocab];
        let mut accepted = 0usize;
        let mut fused_steps = 0usize;
        let mut trial_rng = ChaCha8Rng::seed_from_u64(29);
        for _ in 0..trials {
            let d1 = sampling::sample_from(&q1, trial_rng.random::<f64>());
            let d2 = sampling::sample_from(&q2, trial_rng.random::<f64>());
            let block = [prompt[prompt.len() - 1], d1, d2];
            let f = gpu.forward(&[GpuSeqInput {
                seq: gseq,
                tokens: &block,
                num_logits: 3,
            }])?;
            fused_steps += usize::from(gpu.last_step_fused());
            gpu.truncate(gseq, start)?;
            let target: Vec<Vec<f32>> = f
                .logits
                .chunks(vocab)
                .map(|row| sampling::probabilities(row, &t1))
                .collect::<Result<_, _>>()?;
            let draft = [q1.clone(), q2.clone()];
            let outcome = AcceptanceRule::Standard.verify(
                &VerifyInput {
                    draft_tokens: &[d1, d2],
                    draft_probs: DraftProbs::Full(&draft),
                    target_probs: &target,
                },
                &mut trial_rng,
            )?;
            counts[outcome.emitted[0] as usize] += 1;
            accepted += outcome.num_accepted;
        }
        let p = common::pooled_p_value(&counts, &expected);
        let p_wrong = common::pooled_p_value(&counts, &wrong);
        let name = backend.name();
        let ok = p > 1e-3 && p_wrong < 1e-3;
        let expect_fused = backend == StepBackend::LatencySpecialized;
        let ran_as_expected = fused_steps == if expect_fused { trials } else { 0 };
        println!(
            "  {name:<20} {trials} trials, {fused_steps} fused steps, mean accepted drafts {:.3}: first emitted token vs p1 p = {p:.3}, vs p1 at T=1.1 p = {p_wrong:.1e} -> {}",
            accepted as f64 / trials as f64,
            if ok && ran_as_expected { "ok" } else { "FAIL" }
        );
        if !ok {
            tally.fail(format!(
                "{name}: distribution test p = {p:.3e} (must be > 1e-3), control p = {p_wrong:.3e} (must be < 1e-3)"
            ));
        }
        if !ran_as_expected {
            tally.fail(format!(
                "{name}: {fused_steps} of {trials} distribution-test steps ran fused"
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------
// --bench

struct BenchArgs {
    cooperative: bool,
    context: usize,
    samples: usize,
    tune: bool,
    seed: u64,
    /// Only the standard and the default fused step, no profile: A/B runs of kernel versions
    /// through SPECULA_FUSED_STEP_CU, one bench per version in one device call.
    short: bool,
    /// With `short`: v2's in-kernel profile at 1 x 1 and 1 x 8 all the same.
    v2_profile: bool,
    /// With `v2_profile`: also print every CTA's raw profile slots (the timeline kernel's event times
    /// and values, which the mean / max summary cannot show).
    v2_profile_cta: bool,
    /// v2's producer settings to time beside the default v2 step, in the same process and at every
    /// shape (`--v2-producer`): each is the v2 variant with these FusedOptions fields set.
    v2_producer: Vec<ProducerSettings>,
    /// Other fused_step.cu versions to time beside the default v2 step (`--v2-kernels`): (label, text),
    /// each its own variant, switched to at every shape in the same process.
    v2_kernels: Vec<(String, String)>,
}

struct Variant {
    name: String,
    backend: StepBackend,
    opts: FusedOptions,
    /// Index into BenchArgs::v2_kernels: the fused kernel version this variant runs (None: this build's).
    kernel: Option<usize>,
}

fn bench(args: BenchArgs) -> Result<()> {
    let config = preset("llama3.2-1b")?;
    let opts = GpuOptions {
        max_sequences: 8,
        max_positions: (args.context + 64).next_multiple_of(16),
        max_rows: 512,
        ..Default::default()
    };
    let mut gpu = GpuTransformer::random(config.clone(), args.seed, opts)?;
    println!("GPU {} ({})", gpu.device.name, gpu.device.arch);
    if args.tune {
        // As `specula bench step`: the standard step's GEMM backend per shape, measured. The choices
        // are timing-based, so they are printed: two runs of session 13 gave the standard step 4%
        // faster and 6e-3 different logits without any other change (NOTES v0.16).
        let choices = gpu.tune_linear_layers(&[8, 16, 32, 64], 20)?;
        println!("standard step GEMMs (rows x cols @ activation rows: chosen, cuBLAS us, skinny us by K splits):");
        for c in &choices {
            println!(
                "  {} x {} @ {}: {}, cuBLAS {:.1}, skinny {}",
                c.rows,
                c.cols,
                c.tokens,
                c.backend.name(),
                c.cublas_us,
                skinny_times(&c.skinny_us)
            );
        }
    }
    gpu.set_step_backend(StepBackend::LatencySpecialized)?;
    let info = gpu
        .fused_info()
        .context("the fused kernel was not built for llama3.2-1b")?;
    let bw = copy_bandwidth(&gpu)?;
    let floor_ms = gpu.weight_bytes() as f64 / (bw * 1e12) * 1e3;
    println!(
        "fused kernel: grid {} x {} threads, {} B dynamic shared memory, {} CTA(s)/SM fit, weight ring {} x {}-column chunks; v2 grid {} in clusters of {}, {} B dynamic shared memory; weights {:.1} MB, copy bandwidth {:.2} TB/s, weight floor {:.3} ms",
        info.grid,
        info.threads,
        info.smem_bytes,
        info.blocks_per_sm,
        info.ring_stages,
        info.chunk_k,
        info.dataflow_grid,
        info.dataflow_cluster,
        info.dataflow_smem_bytes,
        gpu.weight_bytes() as f64 / 1e6,
        bw,
        floor_ms
    );
    // v1 (the grid-barrier kernel) for every shape; the v2 variants run v2 wherever it fits (<= 16
    // rows). The engine's default mixes them (FusedOptions::dataflow_max_rows / _max_queries).
    let fused = FusedOptions {
        cooperative: args.cooperative,
        dataflow: false,
        ..Default::default()
    };
    let all_variants = [
        Variant {
            name: "standard".into(),
            backend: StepBackend::Standard,
            opts: fused,
            kernel: None,
        },
        Variant {
            name: "fused v1".into(),
            backend: StepBackend::LatencySpecialized,
            opts: fused,
            kernel: None,
        },
        Variant {
            name: "fused v2 (dataflow)".into(),
            backend: StepBackend::LatencySpecialized,
            opts: FusedOptions {
                dataflow: true,
                dataflow_max_rows: DATAFLOW_MAX_ROWS,
                dataflow_max_queries: usize::MAX,
                ..fused
            },
            kernel: None,
        },
        Variant {
            name: "fused v2, counters only".into(),
            backend: StepBackend::LatencySpecialized,
            opts: FusedOptions {
                dataflow: true,
                dataflow_max_rows: DATAFLOW_MAX_ROWS,
                dataflow_max_queries: usize::MAX,
                mode: FusedMode::BarriersOnly,
                ..fused
            },
            kernel: None,
        },
        Variant {
            name: "fused v2, no attention".into(),
            backend: StepBackend::LatencySpecialized,
            opts: FusedOptions {
                dataflow: true,
                dataflow_max_rows: DATAFLOW_MAX_ROWS,
                dataflow_max_queries: usize::MAX,
                mode: FusedMode::SkipAttention,
                ..fused
            },
            kernel: None,
        },
        Variant {
            name: "fused, 1024-column chunks".into(),
            backend: StepBackend::LatencySpecialized,
            opts: FusedOptions {
                chunk_k: 1024,
                ..fused
            },
            kernel: None,
        },
        Variant {
            name: "fused, row copies".into(),
            backend: StepBackend::LatencySpecialized,
            opts: FusedOptions {
                whole_tile_copies: false,
                ..fused
            },
            kernel: None,
        },
        Variant {
            name: "fused, cp.async copies".into(),
            backend: StepBackend::LatencySpecialized,
            opts: FusedOptions {
                ldgsts: true,
                ..fused
            },
            kernel: None,
        },
        Variant {
            name: "fused, barriers only".into(),
            backend: StepBackend::LatencySpecialized,
            opts: FusedOptions {
                mode: FusedMode::BarriersOnly,
                ..fused
            },
            kernel: None,
        },
        Variant {
            name: "fused, no attention".into(),
            backend: StepBackend::LatencySpecialized,
            opts: FusedOptions {
                mode: FusedMode::SkipAttention,
                ..fused
            },
            kernel: None,
        },
    ];
    let v2_default = all_variants[2].opts;
    let sweep: Vec<Variant> = args
        .v2_producer
        .iter()
        .map(|setting| Variant {
            name: format!("fused v2, {}", setting.describe()),
            backend: StepBackend::LatencySpecialized,
            opts: setting.apply(v2_default),
            kernel: None,
        })
        .collect();
    let candidates: Vec<Variant> = args
        .v2_kernels
        .iter()
        .enumerate()
        .map(|(i, (label, _))| Variant {
            name: format!("fused v2 [{label}]"),
            backend: StepBackend::LatencySpecialized,
            opts: v2_default,
            kernel: Some(i),
        })
        .collect();
    // The standard, v1 and v2 steps stay first (the table's speedup and logits columns use them).
    let variants: Vec<&Variant> = all_variants
        .iter()
        .filter(|v| {
            !args.short
                || ["standard", "fused v1", "fused v2 (dataflow)"].contains(&v.name.as_str())
        })
        .chain(&sweep)
        .chain(&candidates)
        .collect();
    let first_sweep = variants.len() - sweep.len() - candidates.len();
    let first_candidate = first_sweep + sweep.len();
    // Producer settings change when weight copies are issued, never what is computed: their logits
    // must be v2's bit for bit.
    let mut sweep_mismatch = Vec::new();
    if let Ok(path) = std::env::var(specula_kernels::cuda::FUSED_SOURCE_ENV) {
        println!(
            "fused kernel source: {path} ({} set)",
            specula_kernels::cuda::FUSED_SOURCE_ENV
        );
    }
    let vocab = config.vocab_size;
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    // (b, t, per variant (median, p90), fused vs standard logits)
    let mut table = Vec::new();
    let mut profiles = Vec::new();
    let mut per_cta = Vec::new();
    for &b in &[1usize, 2, 4, 8] {
        for &t in &[1usize, 8] {
            gpu.set_step_backend(StepBackend::Standard)?;
            let seqs: Vec<usize> = (0..b)
                .map(|_| gpu.add_sequence())
                .collect::<Result<_, _>>()?;
            for &s in &seqs {
                let prompt = random_tokens(&mut rng, vocab, args.context);
                gpu.forward(&[GpuSeqInput {
                    seq: s,
                    tokens: &prompt,
                    num_logits: 1,
                }])?;
            }
            let blocks: Vec<Vec<u32>> = seqs
                .iter()
                .map(|_| random_tokens(&mut rng, vocab, t))
                .collect();
            let inputs: Vec<GpuSeqInput> = seqs
                .iter()
                .zip(&blocks)
                .map(|(&seq, tokens)| GpuSeqInput {
                    seq,
                    tokens,
                    num_logits: t,
                })
                .collect();
            let mut times = Vec::new();
            let mut logits: Vec<Vec<f32>> = Vec::new();
            // The kernel the dataflow variants ran for this shape (v1 above 16 rows).
            let mut v2_kernel = "-";
            for v in &variants {
                gpu.set_step_backend(v.backend)?;
                if v.backend == StepBackend::LatencySpecialized {
                    let kernel = v.kernel.map(|i| {
                        let (label, text) = &args.v2_kernels[i];
                        (label.as_str(), text.as_str())
                    });
                    gpu.set_fused_variant(kernel)
                        .with_context(|| format!("{}: building its kernel", v.name))?;
                    gpu.set_fused_options(v.opts)?;
                    // A kernel version with thread-block clusters runs on another grid: say so once.
                    if let (Some(i), true) = (gpu.fused_info(), b == 1 && t == 1) {
                        if i.dataflow_cluster > 1 {
                            println!(
                                "{}: v2 grid {} in clusters of {}",
                                v.name, i.dataflow_grid, i.dataflow_cluster
                            );
                        }
                    }
                }
                // The step itself (captures the graph), then back-to-back replays of it.
                let out = gpu.forward(&inputs)?.logits;
                let fused_ran = gpu.last_step_fused();
                if v.opts.dataflow && v.backend == StepBackend::LatencySpecialized {
                    v2_kernel = gpu.fused_kernel_for(b * t, t).unwrap_or("-");
                }
                if fused_ran != (v.backend == StepBackend::LatencySpecialized) {
                    bail!("{}: the fused kernel ran: {fused_ran}", v.name);
                }
                let mut samples = gpu
                    .time_graph_replays(b, t, t, args.samples)?
                    .with_context(|| format!("{}: no graph for {b} x {t}", v.name))?;
                samples.sort_by(f64::total_cmp);
                times.push((percentile(&samples, 0.5), percentile(&samples, 0.9)));
                logits.push(out);
                for &s in &seqs {
                    gpu.truncate(s, args.context)?;
                }
            }
            let diff = max_rel(&logits[1], &logits[0]);
            let diff_v2 = max_rel(&logits[2], &logits[0]);
            for (i, v) in variants
                .iter()
                .enumerate()
                .skip(first_sweep)
                .take(sweep.len())
            {
                if logits[i] != logits[2] {
                    sweep_mismatch.push(format!(
                        "{b} x {t}: {} (max relative difference {:.2e} against the default v2 step)",
                        v.name,
                        max_rel(&logits[i], &logits[2])
                    ));
                }
            }
            println!(
                "{b} x {t}: standard {:.3} ms, fused {:.3} ms ({:.2}x), fused v2 {:.3} ms ({:.2}x, ran {v2_kernel}), logits vs standard: fused {diff:.2e}, v2 {diff_v2:.2e}",
                times[0].0,
                times[1].0,
                times[0].0 / times[1].0,
                times[2].0,
                times[0].0 / times[2].0
            );
            for (i, v) in variants.iter().enumerate().skip(first_candidate) {
                println!(
                    "{b} x {t}: {} {:.3} ms ({:.2}x the default v2 step's time), logits vs standard {:.2e}, vs the default v2 step {:.2e}",
                    v.name,
                    times[i].0,
                    times[i].0 / times[2].0,
                    max_rel(&logits[i], &logits[0]),
                    max_rel(&logits[i], &logits[2])
                );
            }
            // The profiles below run this build's kernel.
            gpu.set_fused_variant(None)?;
            table.push((b, t, times, diff));
            // Where the fused step's time goes: one profiled step (per-CTA cycle counters).
            // v1 at (1, 1), (1, 8), (8, 8); v2 where it runs (<= 16 rows).
            for dataflow in [false, true] {
                let shapes: &[(usize, usize)] = if dataflow {
                    &[(1, 1), (1, 8), (2, 8)]
                } else {
                    &[(1, 1), (1, 8), (8, 8)]
                };
                let profiled = if args.short {
                    dataflow && args.v2_profile && b == 1
                } else {
                    shapes.contains(&(b, t))
                };
                if !profiled {
                    continue;
                }
                gpu.set_step_backend(StepBackend::LatencySpecialized)?;
                gpu.set_fused_options(FusedOptions {
                    mode: FusedMode::Profile,
                    dataflow,
                    dataflow_max_rows: DATAFLOW_MAX_ROWS,
                    dataflow_max_queries: usize::MAX,
                    ..fused
                })?;
                gpu.forward(&inputs)?;
                if let Some(prof) = gpu.fused_profile(b * t, t)? {
                    if prof.dataflow == dataflow {
                        profiles.push((prof.dataflow, b, t, prof.summary()));
                        if dataflow && args.v2_profile_cta {
                            per_cta.push((b, t, prof.clock_khz, prof.per_cta.clone()));
                        }
                    }
                }
                for &s in &seqs {
                    gpu.truncate(s, args.context)?;
                }
            }
            for s in seqs {
                gpu.remove_sequence(s)?;
            }
        }
    }
    gpu.set_step_backend(StepBackend::Standard)?;
    gpu.set_fused_options(FusedOptions::default())?;
    println!(
        "\nllama3.2-1b, {} cached positions per sequence, device time per graph replay, median (P90) ms over {} samples of 10 replays; standard GEMMs {}",
        args.context,
        args.samples,
        if args.tune { "tuned" } else { "untuned (skinny)" }
    );
    print!("| requests | tokens |");
    for v in &variants {
        print!(" {} |", v.name);
    }
    println!(" standard / fused | fused~standard logits |");
    print!("|---:|---:|");
    for _ in &variants {
        print!("---:|");
    }
    println!("---:|---:|");
    for (b, t, times, diff) in &table {
        print!("| {b} | {t} |");
        for (m, p90) in times {
            print!(" {m:.3} ({p90:.3}) |");
        }
        println!(" {:.2}x | {diff:.1e} |", times[0].0 / times[1].0);
    }
    println!(
        "targets (issue 6): fused >= 1.8x the standard step at 1-8 requests; <= 0.80 ms at 1 request. Weight floor {floor_ms:.3} ms. Fused barrier cost ~ the 'barriers only' column ({} barriers per step).",
        8 * config.num_layers + 1
    );
    for dataflow in [false, true] {
        let group: Vec<_> = profiles.iter().filter(|p| p.0 == dataflow).collect();
        if group.is_empty() {
            continue;
        }
        println!(
            "\nfused step profile, {} (one profiled step, not a graph replay; per-CTA clock64 cycles at the nominal SM clock, summed over layers; mean / max over CTAs, us):",
            if dataflow { "v2 (dataflow)" } else { "v1" }
        );
        print!("| category |");
        for (_, b, t, _) in &group {
            print!(" {b} x {t} mean | max |");
        }
        println!();
        print!("|---|");
        for _ in &group {
            print!("---:|---:|");
        }
        println!();
        for (i, (name, _, _)) in group[0].3.iter().enumerate() {
            print!("| {name} |");
            for (_, _, _, rows) in &group {
                print!(" {:.1} | {:.1} |", rows[i].1, rows[i].2);
            }
            println!();
        }
    }
    if !sweep.is_empty() {
        println!(
            "\n--v2-producer: {} setting(s) timed beside the default v2 step, same process, same shapes, interleaved per shape; their logits {} the default v2 step's bit for bit",
            sweep.len(),
            if sweep_mismatch.is_empty() { "equal" } else { "do NOT all equal" }
        );
    }
    for (b, t, clock_khz, ctas) in &per_cta {
        println!(
            "\nfused step profile per CTA, v2 (dataflow), {b} x {t}: raw slot values (clock64 cycles at {clock_khz:.0} kHz, or the values the kernel stored)"
        );
        print!("| cta |");
        for slot in 0..specula_model::gpu::fused::PROF_SLOTS {
            print!(" {slot} |");
        }
        println!();
        print!("|---:|");
        for _ in 0..specula_model::gpu::fused::PROF_SLOTS {
            print!("---:|");
        }
        println!();
        for (cta, slots) in ctas.iter().enumerate() {
            print!("| {cta} |");
            for v in slots {
                print!(" {v} |");
            }
            println!();
        }
    }
    if !sweep_mismatch.is_empty() {
        bail!(
            "producer settings changed the logits (they must not):\n{}",
            sweep_mismatch.join("\n")
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |name: &str| -> Result<Option<u64>> {
        match args.iter().position(|a| a == name) {
            Some(i) => Ok(Some(
                args.get(i + 1)
                    .with_context(|| format!("{name} needs a value"))?
                    .parse()
                    .with_context(|| format!("{name} needs a number"))?,
            )),
            None => Ok(None),
        }
    };
    // Fused launches without CU_LAUNCH_ATTRIBUTE_COOPERATIVE (should graph capture refuse it).
    let cooperative = !args.iter().any(|a| a == "--no-cooperative");
    if args.iter().any(|a| a == "--bench") {
        return bench(BenchArgs {
            context: value("--context")?.unwrap_or(256) as usize,
            samples: value("--samples")?.unwrap_or(30) as usize,
            tune: !args.iter().any(|a| a == "--no-tune"),
            seed: value("--seed")?.unwrap_or(7),
            cooperative,
            short: args.iter().any(|a| a == "--short"),
            v2_profile: args
                .iter()
                .any(|a| a == "--v2-profile" || a == "--v2-profile-cta"),
            v2_profile_cta: args.iter().any(|a| a == "--v2-profile-cta"),
            v2_kernels: match args.iter().position(|a| a == "--v2-kernels") {
                Some(i) => args
                    .get(i + 1)
                    .context("--v2-kernels needs a list of fused_step.cu files, e.g. a.cu,b.cu")?
                    .split(',')
                    .map(|path| {
                        let text = std::fs::read_to_string(path)
                            .with_context(|| format!("--v2-kernels: reading {path}"))?;
                        let label = std::path::Path::new(path)
                            .file_stem()
                            .map(|s| s.to_string_lossy().into_owned())
                            .unwrap_or_else(|| path.to_string());
                        Ok((label, text))
                    })
                    .collect::<Result<_>>()?,
                None => Vec::new(),
            },
            v2_producer: match args.iter().position(|a| a == "--v2-producer") {
                Some(i) => args
                    .get(i + 1)
                    .context("--v2-producer needs a list, e.g. 2,3,2:4:2000,2:::4:8")?
                    .split(',')
                    .map(|spec| {
                        ProducerSettings::parse(spec)
                            .map_err(|e| anyhow::anyhow!("--v2-producer: {e}"))
                    })
                    .collect::<Result<_>>()?,
                None => Vec::new(),
            },
        });
    }
    check(args.iter().any(|a| a == "--quick"), cooperative)
}
