//! `specula bench step` (feature `cuda`): decode/verify step time of the GPU forward.
//!
//! Metric (reference.md section 3): decode step time = median inter-token latency of the target step,
//! prefill excluded, the number of running requests held fixed. A step here is what the engine's
//! target step costs on the host: copy the packed inputs, replay the CUDA graph of the shape (batch
//! bucket, tokens per sequence), copy the greedy ids of every logits row back, synchronise.
//!
//! Workload per setting (running requests B x tokens per sequence T): `runs` runs of `prompts` prompt
//! groups; each group prefills B sequences with seeded random token ids (`context` positions, not
//! timed), then times `steps` steps. T = 1 commits one token per step. T > 1 is a verify block
//! `[pending, k = T - 1 drafts]` with synthetic acceptance: the accepted draft count of each sequence
//! is drawn from `SyntheticAcceptance::from_mean_length(L, k)` (L = 3.78 at k = 7: conditional rates
//! [1, 1, 0.78, 0, ...], i.e. 2 or 3 drafts), the cache is truncated to `start + 1 + accepted` (the
//! rejected positions are rolled back) and the target's token at the first rejected slot becomes
//! the next pending token; so the KV length grows by L per step on average, as in a real run.
//!
//! Cross-checks in the same run: the captured graph's replay time (CUDA events, no host copies), the
//! device-to-device copy bandwidth, and the floor = (weight bytes + KV bytes read per step) / copy
//! bandwidth.

use anyhow::{Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use specula_model::gpu::fused::{ProducerSettings, StepBackend, DATAFLOW_MAX_ROWS};
use specula_model::gpu::{AttentionKernel, GpuOptions, GpuSeqInput, GpuTransformer, StepAblation};
use specula_model::loader::load;
use specula_model::random::preset;
use specula_model::WeightDtype;
use specula_verifier::SyntheticAcceptance;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Clone, Serialize)]
pub struct StepBenchConfig {
    /// A `--random-weights` preset name, or None with `model`.
    pub random_weights: Option<String>,
    pub model: Option<PathBuf>,
    pub seed: u64,
    pub batches: Vec<usize>,
    pub tokens_per_seq: Vec<usize>,
    pub context: usize,
    pub steps: usize,
    pub runs: usize,
    pub prompts: usize,
    pub acceptance_length: f64,
    pub replay_reps: usize,
    /// Time cuBLAS against the skinny kernel per linear shape and use the faster.
    pub tune: bool,
    /// Step backends timed side by side at every setting (`standard`, `latency_specialized`).
    #[serde(serialize_with = "backend_names")]
    pub backends: Vec<StepBackend>,
    /// `latency_specialized`: most rows of a step the dataflow kernel (v2) takes
    /// (`FusedOptions::dataflow_max_rows`, 1..=`DATAFLOW_MAX_ROWS`); None keeps the engine's default.
    /// Larger steps run v1. For comparing the two kernels at one shape in the same harness.
    pub dataflow_max_rows: Option<usize>,
    /// `latency_specialized`: v2's producer settings, a `ProducerSettings` spec
    /// (`IN[:L2[:PACE[:LEAD[:ROWS]]]]`, e.g. `2` for two weight copies in flight per CTA); None keeps
    /// the kernel's defaults (chosen on H100s).
    pub producer: Option<String>,
    pub out_dir: PathBuf,
}

fn backend_names<S: serde::Serializer>(b: &[StepBackend], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(b.iter().map(|k| k.name()))
}

#[derive(Debug, Clone, Serialize)]
pub struct LinearChoiceRow {
    pub rows: usize,
    pub cols: usize,
    pub tokens: usize,
    pub cublas_us: f64,
    /// (K splits, median us) of the skinny kernel.
    pub skinny_us: Vec<(u32, f64)>,
    pub backend: String,
}

/// The skinny kernel's tuning times as "splits: us" pairs ("1: 13.6, 2: 17.2").
pub fn skinny_times(times: &[(u32, f64)]) -> String {
    times
        .iter()
        .map(|(splits, us)| format!("{splits}: {us:.1}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[derive(Debug, Clone, Serialize)]
pub struct StepRow {
    /// The step backend asked for (`standard` | `latency_specialized`).
    pub decode_backend: &'static str,
    /// Timed steps the fused kernel actually ran; the rest fell back to the standard step (reasons
    /// in `fused_fallbacks`).
    pub fused_steps: u64,
    pub fused_fallbacks: std::collections::BTreeMap<&'static str, u64>,
    /// `latency_specialized` rows: which fused kernel this shape launches ("v1" or "v2").
    pub fused_kernel: Option<&'static str>,
    pub running_requests: usize,
    pub tokens_per_seq: usize,
    pub steps_timed: usize,
    pub step_ms_median: f64,
    pub step_ms_p90: f64,
    /// Median of each run (spread between runs).
    pub step_ms_run_medians: Vec<f64>,
    pub graph_replay_ms_median: Option<f64>,
    pub graph_replay_ms_p90: Option<f64>,
    /// The same step launched kernel by kernel (no graph), host-timed, median of 20.
    pub direct_step_ms_median: f64,
    pub mean_context: f64,
    pub mean_committed_per_step: f64,
    pub kv_bytes_per_step: f64,
    pub floor_ms: f64,
    pub percent_of_floor: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepBenchReport {
    pub metric: &'static str,
    pub acceptance_mode: &'static str,
    pub gpu: String,
    pub arch: String,
    pub date_utc: String,
    pub git_revision: String,
    pub shape: String,
    pub config: StepBenchConfig,
    pub model_build_s: f64,
    pub weight_bytes: usize,
    pub copy_bandwidth_tb_s: f64,
    pub weight_floor_ms: f64,
    pub linear_choices: Vec<LinearChoiceRow>,
    /// Why CUDA graphs were switched off, if a capture failed (then steps ran directly).
    pub graph_error: Option<String>,
    /// Whether the gate/up projection ran with SwiGLU fused (its tuning rows then include SwiGLU).
    pub fused_swiglu: bool,
    /// `FusedOptions::dataflow_max_rows` in effect (the row limit of the dataflow kernel, v2).
    pub dataflow_max_rows: usize,
    /// `FusedOptions::dataflow_max_queries` in effect (query vectors per KV head in one sequence).
    pub dataflow_max_queries: usize,
    /// v2's producer settings in effect, in words (`ProducerSettings::describe`).
    pub producer: String,
    /// Kernel sources replaced through a development knob (empty: this revision's kernels ran).
    pub kernel_overrides: Vec<crate::KernelOverride>,
    pub rows: Vec<StepRow>,
    /// Where the step's device time goes: graph replays of step variants with one part left out.
    pub profile: Vec<ProfileRow>,
}

/// One step variant of the profile (outputs meaningless when a part is skipped; timing only).
#[derive(Debug, Clone, Serialize)]
pub struct ProfileRow {
    pub running_requests: usize,
    pub tokens_per_seq: usize,
    pub context: usize,
    pub variant: &'static str,
    pub graph_replay_ms_median: f64,
    /// Full step minus this variant: the cost of the part left out (negative: the variant is slower).
    pub part_ms: f64,
}

/// Device time per graph replay of each step variant at a fixed context (`context` cached positions
/// per sequence, the step's T tokens on top, rolled back after every step).
fn step_profile(
    gpu: &mut GpuTransformer,
    b: usize,
    t: usize,
    context: usize,
    reps: usize,
) -> Result<Vec<ProfileRow>> {
    let variants: [(&'static str, StepAblation); 10] = [
        ("full step", StepAblation::default()),
        (
            "with PDL",
            StepAblation {
                force_pdl: true,
                ..Default::default()
            },
        ),
        (
            "without attention",
            StepAblation {
                skip_attention: true,
                ..Default::default()
            },
        ),
        (
            "without RoPE + KV append",
            StepAblation {
                skip_rope_kv: true,
                ..Default::default()
            },
        ),
        (
            "without the layers' RMSNorms",
            StepAblation {
                skip_norms: true,
                ..Default::default()
            },
        ),
        (
            "without the layers' linears + SwiGLU",
            StepAblation {
                skip_layer_linears: true,
                ..Default::default()
            },
        ),
        (
            "without final norm + LM head + argmax",
            StepAblation {
                skip_head: true,
                ..Default::default()
            },
        ),
        (
            "attention launched twice",
            StepAblation {
                double_attention: true,
                ..Default::default()
            },
        ),
        (
            "attention always split-key (attention_split)",
            StepAblation {
                attention: AttentionKernel::Split,
                ..Default::default()
            },
        ),
        (
            "attention always one block per row over every key (attention_gqa)",
            StepAblation {
                attention: AttentionKernel::WholeRow,
                ..Default::default()
            },
        ),
    ];
    let vocab = gpu.config().vocab_size as u32;
    let mut rows = Vec::new();
    let mut full = f64::NAN;
    for (name, ab) in variants {
        if ab.attention == AttentionKernel::WholeRow && !gpu.whole_row_attention_available() {
            continue;
        }
        gpu.set_ablation(StepAblation::default());
        let seqs: Vec<usize> = (0..b)
            .map(|_| gpu.add_sequence())
            .collect::<Result<_, _>>()?;
        let prompt: Vec<u32> = (0..context as u32)
            .map(|i| (i * 7919 + 13) % vocab)
            .collect();
        let inputs: Vec<GpuSeqInput> = seqs
            .iter()
            .map(|&seq| GpuSeqInput {
                seq,
                tokens: &prompt,
                num_logits: 1,
            })
            .collect();
        gpu.forward(&inputs)?;
        gpu.set_ablation(ab);
        let block: Vec<u32> = (0..t as u32).map(|i| (i * 31 + 5) % vocab).collect();
        let inputs: Vec<GpuSeqInput> = seqs
            .iter()
            .map(|&seq| GpuSeqInput {
                seq,
                tokens: &block,
                num_logits: t,
            })
            .collect();
        for _ in 0..3 {
            gpu.step_argmax(&inputs)?;
            for &seq in &seqs {
                gpu.truncate(seq, context)?;
            }
        }
        let replays = gpu
            .time_graph_replays(b, t, t, reps)?
            .map(sorted)
            .context("the profile's step shape has no graph")?;
        let ms = percentile(&replays, 0.5);
        if ab == StepAblation::default() {
            full = ms;
        }
        for s in seqs {
            gpu.remove_sequence(s)?;
        }
        eprintln!("profile B={b} T={t} {name}: {ms:.3} ms");
        rows.push(ProfileRow {
            running_requests: b,
            tokens_per_seq: t,
            context,
            variant: name,
            graph_replay_ms_median: ms,
            part_ms: full - ms,
        });
    }
    gpu.set_ablation(StepAblation::default());
    Ok(rows)
}

pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// Device-to-device copy bandwidth (bytes read + written per second), CUDA events, median of 20.
pub fn copy_bandwidth(gpu: &GpuTransformer) -> Result<f64> {
    let s = gpu.device.stream.clone();
    let bytes = 1usize << 30;
    let src = s.alloc_zeros::<u8>(bytes)?;
    let mut dst = s.alloc_zeros::<u8>(bytes)?;
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let (a, b) = (
        gpu.device.ctx.new_event(flags)?,
        gpu.device.ctx.new_event(flags)?,
    );
    for _ in 0..3 {
        s.memcpy_dtod(&src, &mut dst)?;
    }
    let mut ms = Vec::new();
    for _ in 0..20 {
        a.record(&s)?;
        s.memcpy_dtod(&src, &mut dst)?;
        b.record(&s)?;
        ms.push(a.elapsed_ms(&b)? as f64);
    }
    let median = percentile(&sorted(ms), 0.5);
    Ok(2.0 * bytes as f64 / (median * 1e-3) / 1e12)
}

pub fn run_step_bench(cfg: StepBenchConfig) -> Result<StepBenchReport> {
    let max_b = cfg.batches.iter().copied().max().unwrap_or(1);
    let max_t = cfg.tokens_per_seq.iter().copied().max().unwrap_or(1);
    anyhow::ensure!(
        cfg.batches.iter().all(|&b| b >= 1)
            && cfg.tokens_per_seq.iter().all(|&t| (1..=16).contains(&t)),
        "batches must be >= 1 and tokens per sequence in 1..=16"
    );
    if let Some(n) = cfg.dataflow_max_rows {
        anyhow::ensure!(
            (1..=DATAFLOW_MAX_ROWS).contains(&n),
            "the dataflow kernel's row limit must be in 1..={DATAFLOW_MAX_ROWS}, got {n}"
        );
    }
    let producer = cfg
        .producer
        .as_deref()
        .map(ProducerSettings::parse)
        .transpose()
        .map_err(|e| anyhow::anyhow!("the dataflow kernel's {e}"))?;
    // Positions: the prompt, the committed tokens (at most T per step) and one verify block on top.
    let max_positions = (cfg.context + cfg.steps * max_t + 2 * max_t + 16).next_multiple_of(16);
    let opts = GpuOptions {
        max_sequences: max_b,
        max_positions,
        max_rows: (max_b * cfg.context).clamp(256, 2048),
        ..GpuOptions::default()
    };
    let t0 = Instant::now();
    let (mut gpu, shape) = match (&cfg.random_weights, &cfg.model) {
        (Some(name), _) => {
            let config = preset(name)?;
            (
                GpuTransformer::random(config, cfg.seed, opts)
                    .with_context(|| format!("building the random {name} model on the GPU"))?,
                format!("{name} (random bf16 weights, seed {})", cfg.seed),
            )
        }
        (None, Some(path)) => {
            let loaded = load(path, WeightDtype::Bf16)
                .with_context(|| format!("loading {}", path.display()))?;
            (
                GpuTransformer::upload(&loaded.model, opts).context("uploading to the GPU")?,
                path.display().to_string(),
            )
        }
        (None, None) => anyhow::bail!("give --random-weights SHAPE or --model PATH"),
    };
    gpu.device.stream.synchronize()?;
    let model_build_s = t0.elapsed().as_secs_f64();
    if let Some(n) = cfg.dataflow_max_rows {
        let mut fused = gpu.fused_options();
        fused.dataflow_max_rows = n;
        gpu.set_fused_options(fused)
            .context("setting the dataflow kernel's row limit")?;
    }
    if let Some(settings) = producer {
        gpu.set_fused_options(settings.apply(gpu.fused_options()))
            .context("setting the dataflow kernel's producer")?;
    }
    let vocab = gpu.config().vocab_size as u32;
    eprintln!(
        "{shape} on {} ({}): built in {model_build_s:.2} s, {:.3} GB of weights per step",
        gpu.device.name,
        gpu.device.arch,
        gpu.weight_bytes() as f64 / 1e9
    );
    let bandwidth = copy_bandwidth(&gpu)?;
    let weight_floor_ms = gpu.weight_bytes() as f64 / (bandwidth * 1e12) * 1e3;
    eprintln!("copy bandwidth {bandwidth:.3} TB/s, weight floor {weight_floor_ms:.3} ms");
    let mut linear_choices = Vec::new();
    if cfg.tune {
        for c in gpu.tune_linear_layers(&[8, 16, 32, 64], 20)? {
            linear_choices.push(LinearChoiceRow {
                rows: c.rows,
                cols: c.cols,
                tokens: c.tokens,
                cublas_us: c.cublas_us,
                skinny_us: c.skinny_us.clone(),
                backend: c.backend.name(),
            });
        }
    }

    let mut rows = Vec::new();
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x5EED);
    for &t in &cfg.tokens_per_seq {
        let rule = if t > 1 {
            let k = t - 1;
            Some(SyntheticAcceptance::from_mean_length(
                cfg.acceptance_length.min((k + 1) as f64),
                k,
            )?)
        } else {
            None
        };
        for (&b, &backend) in cfg
            .batches
            .iter()
            .flat_map(|b| cfg.backends.iter().map(move |k| (b, k)))
        {
            gpu.set_step_backend(backend)
                .with_context(|| format!("selecting the {} step backend", backend.name()))?;
            let mut fused_steps = 0u64;
            let mut fallbacks = std::collections::BTreeMap::<&'static str, u64>::new();
            let mut samples = Vec::new();
            let mut run_medians = Vec::new();
            let (mut ctx_sum, mut kv_sum, mut committed_sum, mut n_steps) =
                (0f64, 0f64, 0f64, 0usize);
            let mut replay = None;
            let mut direct_ms = f64::NAN;
            // One untimed group first: captures the graph of this shape.
            for run in 0..=cfg.runs {
                let mut run_samples = Vec::new();
                let groups = if run == 0 { 1 } else { cfg.prompts };
                for group in 0..groups {
                    let timed = run > 0;
                    let steps = if timed { cfg.steps } else { 4 };
                    let seqs: Vec<usize> = (0..b)
                        .map(|_| gpu.add_sequence())
                        .collect::<Result<_, _>>()?;
                    let prompts: Vec<Vec<u32>> = (0..b)
                        .map(|_| {
                            (0..cfg.context)
                                .map(|_| rng.random_range(0..vocab))
                                .collect()
                        })
                        .collect();
                    let inputs: Vec<GpuSeqInput> = seqs
                        .iter()
                        .zip(&prompts)
                        .map(|(&seq, p)| GpuSeqInput {
                            seq,
                            tokens: p,
                            num_logits: 1,
                        })
                        .collect();
                    let out = gpu.forward(&inputs)?;
                    let mut pending: Vec<u32> = (0..b)
                        .map(|i| specula_kernels::sampling::argmax(out.row(i, 0)))
                        .collect::<Result<_, _>>()?;
                    for _ in 0..steps {
                        let blocks: Vec<Vec<u32>> = pending
                            .iter()
                            .map(|&p| {
                                std::iter::once(p)
                                    .chain((1..t).map(|_| rng.random_range(0..vocab)))
                                    .collect()
                            })
                            .collect();
                        let starts: Vec<usize> = seqs
                            .iter()
                            .map(|&s| gpu.seq_len(s))
                            .collect::<Result<_, _>>()?;
                        let inputs: Vec<GpuSeqInput> = seqs
                            .iter()
                            .zip(&blocks)
                            .map(|(&seq, blk)| GpuSeqInput {
                                seq,
                                tokens: blk,
                                num_logits: t,
                            })
                            .collect();
                        let fused_before = gpu.fused_fallbacks().clone();
                        let t_step = Instant::now();
                        let ids = gpu.step_argmax(&inputs)?;
                        let ms = t_step.elapsed().as_secs_f64() * 1e3;
                        if timed {
                            if gpu.last_step_fused() {
                                fused_steps += 1;
                            }
                            for (reason, n) in gpu.fused_fallbacks() {
                                let new = n - fused_before.get(reason).copied().unwrap_or(0);
                                if new > 0 {
                                    *fallbacks.entry(reason).or_default() += new;
                                }
                            }
                            run_samples.push(ms);
                            let keys: usize = starts.iter().map(|&s| s + t).sum();
                            ctx_sum += starts.iter().sum::<usize>() as f64 / b as f64;
                            kv_sum += gpu.kv_bytes(keys) as f64;
                            n_steps += 1;
                        }
                        // Commit: 1 token, or 1 + the synthetic accepted draft count.
                        for (i, &seq) in seqs.iter().enumerate() {
                            let accepted = match &rule {
                                None => 0,
                                Some(r) => {
                                    let mut a = 0;
                                    while a < t - 1
                                        && rng.random::<f64>() < r.conditional_rates()[a]
                                    {
                                        a += 1;
                                    }
                                    a
                                }
                            };
                            gpu.truncate(seq, starts[i] + 1 + accepted)?;
                            pending[i] = ids[i * t + accepted];
                            if timed {
                                committed_sum += (1 + accepted) as f64 / b as f64;
                            }
                        }
                    }
                    let last_group = run == cfg.runs && group + 1 == groups;
                    if last_group {
                        replay = gpu
                            .time_graph_replays(b, t, t, cfg.replay_reps)?
                            .map(sorted);
                        // The same step without the graph, repeated and rolled back each time.
                        let starts: Vec<usize> = seqs
                            .iter()
                            .map(|&s| gpu.seq_len(s))
                            .collect::<Result<_, _>>()?;
                        let blocks: Vec<Vec<u32>> = pending
                            .iter()
                            .map(|&p| {
                                std::iter::once(p)
                                    .chain((1..t).map(|_| rng.random_range(0..vocab)))
                                    .collect()
                            })
                            .collect();
                        let inputs: Vec<GpuSeqInput> = seqs
                            .iter()
                            .zip(&blocks)
                            .map(|(&seq, blk)| GpuSeqInput {
                                seq,
                                tokens: blk,
                                num_logits: t,
                            })
                            .collect();
                        let mut direct = Vec::new();
                        for _ in 0..20 {
                            let t_step = Instant::now();
                            gpu.step_argmax_direct(&inputs)?;
                            direct.push(t_step.elapsed().as_secs_f64() * 1e3);
                            for (&seq, &st) in seqs.iter().zip(&starts) {
                                gpu.truncate(seq, st)?;
                            }
                        }
                        direct_ms = percentile(&sorted(direct), 0.5);
                    }
                    for s in seqs {
                        gpu.remove_sequence(s)?;
                    }
                }
                if run > 0 {
                    run_medians.push(percentile(&sorted(run_samples.clone()), 0.5));
                    samples.extend(run_samples);
                }
            }
            let samples = sorted(samples);
            let median = percentile(&samples, 0.5);
            let kv_bytes = kv_sum / n_steps.max(1) as f64;
            let floor_ms = (gpu.weight_bytes() as f64 + kv_bytes) / (bandwidth * 1e12) * 1e3;
            let fused_kernel = if backend == StepBackend::LatencySpecialized {
                gpu.fused_kernel_for(b * t, t)
            } else {
                None
            };
            let row = StepRow {
                decode_backend: backend.name(),
                fused_steps,
                fused_fallbacks: fallbacks,
                fused_kernel,
                running_requests: b,
                tokens_per_seq: t,
                steps_timed: samples.len(),
                step_ms_median: median,
                step_ms_p90: percentile(&samples, 0.9),
                step_ms_run_medians: run_medians,
                graph_replay_ms_median: replay.as_ref().map(|r| percentile(r, 0.5)),
                graph_replay_ms_p90: replay.as_ref().map(|r| percentile(r, 0.9)),
                direct_step_ms_median: direct_ms,
                mean_context: ctx_sum / n_steps.max(1) as f64,
                mean_committed_per_step: committed_sum / n_steps.max(1) as f64,
                kv_bytes_per_step: kv_bytes,
                floor_ms,
                percent_of_floor: 100.0 * floor_ms / median,
            };
            eprintln!(
                "{} B={b} T={t}: step median {:.3} ms, P90 {:.3}, replay {:?} ms, floor {:.3} ms ({:.0}%)",
                row.decode_backend,
                row.step_ms_median,
                row.step_ms_p90,
                row.graph_replay_ms_median,
                row.floor_ms,
                row.percent_of_floor
            );
            rows.push(row);
        }
    }
    // The profile times the standard step's parts.
    gpu.set_step_backend(StepBackend::Standard)?;
    let mut profile = Vec::new();
    for &t in cfg.tokens_per_seq.iter().filter(|&&t| t > 1) {
        for &b in cfg.batches.iter().filter(|&&b| b == 1 || b == 8) {
            profile.extend(step_profile(&mut gpu, b, t, 256, cfg.replay_reps)?);
        }
    }
    let prov = crate::Provenance::collect();
    let git_revision = std::env::var("SPECULA_GIT_REVISION").unwrap_or(prov.git_revision);
    let report = StepBenchReport {
        metric: "decode step time: median inter-token latency of the target step (host: inputs copy + CUDA-graph replay + greedy ids copy + sync), prefill excluded, running requests fixed",
        acceptance_mode: "synthetic",
        gpu: gpu.device.name.clone(),
        arch: gpu.device.arch.clone(),
        date_utc: prov.date_utc,
        git_revision,
        shape,
        config: cfg.clone(),
        model_build_s,
        weight_bytes: gpu.weight_bytes(),
        copy_bandwidth_tb_s: bandwidth,
        weight_floor_ms,
        linear_choices,
        graph_error: gpu.graph_error().map(str::to_string),
        fused_swiglu: gpu.fused_swiglu(),
        dataflow_max_rows: gpu.fused_options().dataflow_max_rows,
        dataflow_max_queries: gpu.fused_options().dataflow_max_queries,
        producer: ProducerSettings::of(&gpu.fused_options()).describe(),
        kernel_overrides: crate::kernel_overrides(),
        rows,
        profile,
    };
    write_report(&report)?;
    Ok(report)
}

fn write_report(r: &StepBenchReport) -> Result<()> {
    std::fs::create_dir_all(&r.config.out_dir)
        .with_context(|| format!("creating {}", r.config.out_dir.display()))?;
    let stem = r
        .config
        .random_weights
        .clone()
        .unwrap_or_else(|| "model".into());
    let json_path = r.config.out_dir.join(format!("step_bench_{stem}.json"));
    std::fs::write(&json_path, serde_json::to_string_pretty(r)?)
        .with_context(|| format!("writing {}", json_path.display()))?;
    let mut md = String::new();
    md.push_str(&format!(
        "# specula bench step: {}\n\n{} ({}), {}, git {}. Copy bandwidth {:.3} TB/s; {:.3} GB of bf16 weights per step (weight floor {:.3} ms). \
Prompts: seeded random token ids, {} positions of context (prefill not timed); {} runs x {} prompt groups x {} steps per setting. \
Tokens/seq 1: plain decode. Tokens/seq T > 1: verify of k = T - 1 drafts with synthetic acceptance, mean length {} (bonus included): \
each step commits 1 + accepted tokens and rolls the rest back. Step = host inter-token latency (inputs copy, graph replay, ids copy, sync); \
graph replay = device time per replay, CUDA events around 10 replays queued back to back (no host gaps), median of the replay-reps samples; floor = (weight bytes + KV bytes read) / copy bandwidth.\n\n",
        r.shape,
        r.gpu,
        r.arch,
        r.date_utc,
        r.git_revision,
        r.copy_bandwidth_tb_s,
        r.weight_bytes as f64 / 1e9,
        r.weight_floor_ms,
        r.config.context,
        r.config.runs,
        r.config.prompts,
        r.config.steps,
        r.config.acceptance_length,
    ));
    if let Some(e) = &r.graph_error {
        md.push_str(&format!("**CUDA graphs were off in this run** (capture failed: {e}); steps ran kernel by kernel.\n\n"));
    }
    md.push_str(&crate::kernel_overrides_markdown(&r.kernel_overrides));
    md.push_str(&format!(
        "latency_specialized runs the dataflow kernel (v2) at steps of <= {} rows whose longest sequence has at most {} query vectors per KV head (where the model's shape allows it), and v1 otherwise; its rows name the kernel they ran. v2's producer: {}.\n\n",
        r.dataflow_max_rows,
        r.dataflow_max_queries,
        r.producer
    ));
    md.push_str("| running requests | tokens/seq | backend | fused steps | step ms median | P90 | graph-replay ms | floor ms | % of floor | no-graph step ms | committed/step | mean context |\n|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for row in &r.rows {
        let fused = if row.decode_backend == StepBackend::Standard.name() {
            "-".to_string()
        } else {
            let falls: Vec<String> = row
                .fused_fallbacks
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            format!(
                "{}/{}{}{}",
                row.fused_steps,
                row.steps_timed,
                row.fused_kernel
                    .map_or(String::new(), |k| format!(" ({k})")),
                if falls.is_empty() {
                    String::new()
                } else {
                    format!(" (fallbacks: {})", falls.join(", "))
                }
            )
        };
        md.push_str(&format!(
            "| {} | {} | {} | {} | {:.3} | {:.3} | {} | {:.3} | {:.0}% | {:.3} | {:.2} | {:.0} |\n",
            row.running_requests,
            row.tokens_per_seq,
            row.decode_backend,
            fused,
            row.step_ms_median,
            row.step_ms_p90,
            row.graph_replay_ms_median
                .map_or("-".into(), |v| format!("{v:.3}")),
            row.floor_ms,
            row.percent_of_floor,
            row.direct_step_ms_median,
            row.mean_committed_per_step,
            row.mean_context,
        ));
    }
    // The seed's table: both backends at the same setting, side by side.
    let specialized = StepBackend::LatencySpecialized.name();
    let standard = StepBackend::Standard.name();
    let pairs: Vec<(&StepRow, &StepRow)> = r
        .rows
        .iter()
        .filter(|x| x.decode_backend == specialized)
        .filter_map(|x| {
            r.rows
                .iter()
                .find(|y| {
                    y.decode_backend == standard
                        && y.running_requests == x.running_requests
                        && y.tokens_per_seq == x.tokens_per_seq
                })
                .map(|y| (x, y))
        })
        .collect();
    if !pairs.is_empty() {
        md.push_str("\nBackends side by side (same run, same prompts; step = median inter-token latency of the target step):\n\n| running requests | tokens/seq | specialized ms (P90) | standard ms (P90) | speedup | floor ms | specialized % of floor |\n|---:|---:|---:|---:|---:|---:|---:|\n");
        for (x, y) in pairs {
            md.push_str(&format!(
                "| {} | {} | {:.3} ({:.3}) | {:.3} ({:.3}) | {:.2}x | {:.3} | {:.0}% |\n",
                x.running_requests,
                x.tokens_per_seq,
                x.step_ms_median,
                x.step_ms_p90,
                y.step_ms_median,
                y.step_ms_p90,
                y.step_ms_median / x.step_ms_median,
                x.floor_ms,
                x.percent_of_floor
            ));
        }
    }
    if !r.linear_choices.is_empty() {
        md.push_str("\nLinear layers (CUDA events, median of 20 launches, each on the next layer's matrix of the shape, so weights come mostly from memory as in a step): backend chosen per shape\n\n| rows x cols | activation rows | cuBLAS us | skinny us by K splits | chosen |\n|---|---:|---:|---|---|\n");
        for c in &r.linear_choices {
            md.push_str(&format!(
                "| {} x {} | {} | {:.1} | {} | {} |\n",
                c.rows,
                c.cols,
                c.tokens,
                c.cublas_us,
                skinny_times(&c.skinny_us),
                c.backend
            ));
        }
    }
    if r.fused_swiglu {
        md.push_str("\nThe gate/up rows (2 x intermediate size) compare the fused gate/up + SwiGLU kernel (listed as skinny split 1) with cuBLAS followed by the SwiGLU kernel: both times include SwiGLU.\n");
    }
    if !r.profile.is_empty() {
        md.push_str("\nWhere the step's device time goes (timing only): graph replays of the same step with one part left out, at 256 cached positions per sequence; part ms = full step - variant (the cost of that part, including its launch gaps).\n\n| running requests | tokens/seq | variant | graph-replay ms | part ms |\n|---:|---:|---|---:|---:|\n");
        for p in &r.profile {
            md.push_str(&format!(
                "| {} | {} | {} | {:.3} | {:+.3} |\n",
                p.running_requests,
                p.tokens_per_seq,
                p.variant,
                p.graph_replay_ms_median,
                p.part_ms
            ));
        }
    }
    let md_path = r.config.out_dir.join(format!("step_bench_{stem}.md"));
    std::fs::write(&md_path, md).with_context(|| format!("writing {}", md_path.display()))?;
    eprintln!("wrote {} and {}", json_path.display(), md_path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(dataflow_max_rows: Option<usize>) -> StepBenchConfig {
        StepBenchConfig {
            random_weights: Some("llama3.2-1b".into()),
            model: None,
            seed: 0,
            batches: vec![1],
            tokens_per_seq: vec![1],
            context: 16,
            steps: 1,
            runs: 1,
            prompts: 1,
            acceptance_length: 3.78,
            replay_reps: 1,
            tune: false,
            backends: vec![StepBackend::LatencySpecialized],
            dataflow_max_rows,
            producer: None,
            out_dir: std::env::temp_dir(),
        }
    }

    #[test]
    fn producer_settings_the_flags_cannot_hold_are_refused_before_any_gpu_work() {
        for spec in ["0", "16", "x", "1:1:700"] {
            let e = run_step_bench(StepBenchConfig {
                producer: Some(spec.into()),
                ..config(None)
            })
            .unwrap_err()
            .to_string();
            assert!(
                e.contains("producer settings") && e.contains(&format!("{spec:?}")),
                "{e}"
            );
        }
    }

    #[test]
    fn a_dataflow_row_limit_out_of_range_is_refused_before_any_gpu_work() {
        for n in [0, DATAFLOW_MAX_ROWS + 1] {
            let e = run_step_bench(config(Some(n))).unwrap_err().to_string();
            assert!(
                e.contains("row limit") && e.contains(&format!("got {n}")),
                "{e}"
            );
        }
    }
}
