//! `specula bench e2e`: end-to-end tokens/s per user on the GPU, for each decode backend.
//!
//! Where `bench step` times the target step alone, this runs the whole engine loop: the scheduler
//! (`generate_batch_on`) drives the GPU target (`GpuTarget`, acceptance rules on the device) and a
//! drafter, so a number here contains the host loop, drafting, the target's verify forward and the
//! acceptance rule of every step.
//!
//! Workload: the target is a `--random-weights` preset built on the GPU (seeded bf16 weights). Each
//! run is `requests` requests of `context` seeded random prompt tokens, each generating exactly
//! `max_tokens` tokens (no stop tokens or strings; the KV cache has room for every position, so no
//! request ends early). Acceptance is synthetic (`SyntheticAcceptance::from_mean_length(L, k)`: at
//! L = 3.78, k = 7 every step accepts 2 or 3 drafts), so the drafter's tokens do not decide how many
//! are accepted; its cost is measured all the same, because drafting runs inside the loop.
//!
//! Drafters: `draft-random` (default), a random-weight draft model on the GPU sharing the target's
//! vocabulary, RoPE and architecture (hidden 512, 4 layers, 8 heads, 2 KV heads, head_dim 64,
//! intermediate 1536, tied embeddings: a small draft of a real 1B pair's relative cost), proposing k
//! tokens per step; `ngram` (prompt lookup on the CPU), which proposes only what it finds in the
//! sequence's history, so often fewer than k tokens (on random prompts usually none) and the measured
//! acceptance length falls below L.
//!
//! Per backend: one warm-up run at the configured settings plus one short run per smaller draft count,
//! then `runs` timed runs; the backends alternate run by run, and run i of every backend uses the same
//! prompts and seeds. The draft count is clipped near max tokens, so the timed runs' last steps verify
//! every smaller block; the short runs make each of those shapes run before timing. They end where the
//! timed runs end (`tail_context`), in the same context bucket: there each shape's CUDA graph is
//! captured, and `latency_specialized` with measured shapes times it against the standard step (a
//! one-time cost per shape and context bucket, 200-500 ms per run at a 4000-token prompt when it fell in
//! timed runs: NOTES v0.24).
//!
//! Per-user tokens/s is the engine's own measure (`GenerationStats::decode_tokens_per_s`, summarised
//! by `RunStats::per_user_tokens_per_s_*`): (generated tokens - 1) / (time of the last emitted token -
//! time of the first). The first token comes out of prefill, so prefill (TTFT) is excluded; every
//! later step's drafting, verify forward, acceptance rule and host work is included. Over runs, the
//! median and the P90 (the speed 90% of users reach or exceed: the 10th percentile of speed, as in
//! `RunStats`) are taken by nearest rank over every request of every timed run.

use serde::Serialize;
use specula_engine::{DecodeBackend, SpecializedShapes};
use specula_model::ModelConfig;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[cfg(feature = "cuda")]
pub use device::run_e2e_bench;

/// Which drafter proposes the tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum E2eDrafter {
    /// A random-weight draft model on the GPU (`draft_config` of the target's shape).
    DraftRandom,
    /// Prompt lookup on the CPU (proposes at most k tokens, often fewer).
    Ngram,
}

impl E2eDrafter {
    pub fn name(self) -> &'static str {
        match self {
            E2eDrafter::DraftRandom => "draft-random",
            E2eDrafter::Ngram => "ngram",
        }
    }
}

impl std::str::FromStr for E2eDrafter {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "draft-random" | "draft_random" => Ok(E2eDrafter::DraftRandom),
            "ngram" => Ok(E2eDrafter::Ngram),
            other => Err(format!("unknown drafter {other:?} (draft-random, ngram)")),
        }
    }
}

/// A decode backend by name: `standard`, `latency_specialized` (also `latency-specialized`, `fused`,
/// as `bench step --backends` takes them).
pub fn parse_backend(s: &str) -> Result<DecodeBackend, String> {
    match s {
        "standard" => Ok(DecodeBackend::Standard),
        "latency_specialized" | "latency-specialized" | "fused" => {
            Ok(DecodeBackend::LatencySpecialized)
        }
        other => Err(format!(
            "unknown decode backend {other:?} (standard, latency_specialized)"
        )),
    }
}

/// `--specialized-shapes`: `measured` or `all`.
pub fn parse_specialized_shapes(s: &str) -> Result<SpecializedShapes, String> {
    match s {
        "measured" => Ok(SpecializedShapes::Measured),
        "all" => Ok(SpecializedShapes::All),
        other => Err(format!(
            "unknown specialized shapes {other:?} (measured, all)"
        )),
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct E2eBenchConfig {
    /// The `--random-weights` preset of the target (e.g. `llama3.2-1b`).
    pub random_weights: String,
    /// Seed of the target's weights; the draft model's weights use `seed + 1`; prompts and request
    /// seeds are derived from it too.
    pub seed: u64,
    /// Decode backends measured side by side.
    pub backends: Vec<DecodeBackend>,
    pub drafter: E2eDrafter,
    /// Requests running together in each run.
    pub requests: usize,
    /// Draft tokens per verify step.
    pub k: usize,
    /// Synthetic mean acceptance length (bonus token included), in (1, k + 1].
    pub acceptance_length: f64,
    /// Prompt tokens per request (seeded random ids).
    pub context: usize,
    /// Tokens generated per request (exactly).
    pub max_tokens: usize,
    /// Timed runs per backend.
    pub runs: usize,
    /// Sampling temperature of every request (0 = greedy).
    pub temperature: f32,
    /// Time cuBLAS against the skinny kernel per linear shape of the target (as `bench step` does)
    /// and use the faster; the draft model is not tuned (it runs as the engine builds it).
    pub tune: bool,
    /// Which shapes `latency_specialized` runs fused (`--additional-config`'s `specialized_shapes`).
    pub specialized_shapes: SpecializedShapes,
    pub out_dir: PathBuf,
}

/// The most draft tokens per step (the scheduler's `MAX_DRAFT_TOKENS`).
pub const MAX_K: usize = 16;

impl E2eBenchConfig {
    /// Checks the settings that need no GPU: k in 1..=16, requests >= 1, acceptance length in
    /// (1, k + 1], at least 2 generated tokens (a per-user decode rate needs a gap), at least one run
    /// and one backend (no repeats), a known preset whose context holds prompt, output and one
    /// verify block.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_K).contains(&self.k) {
            return Err(format!("--k must be in 1..={MAX_K}, got {}", self.k));
        }
        if self.requests == 0 {
            return Err("--requests must be at least 1".into());
        }
        let max_len = (self.k + 1) as f64;
        if !(self.acceptance_length.is_finite()
            && self.acceptance_length > 1.0
            && self.acceptance_length <= max_len)
        {
            return Err(format!(
                "--acceptance-length must be in (1, k + 1] = (1, {max_len}], got {}",
                self.acceptance_length
            ));
        }
        if self.context == 0 {
            return Err("--context must be at least 1".into());
        }
        if self.max_tokens < 2 {
            return Err(format!(
                "--max-tokens must be at least 2 (the per-user decode rate is measured between the first and the last token), got {}",
                self.max_tokens
            ));
        }
        if self.runs == 0 {
            return Err("--runs must be at least 1".into());
        }
        if self.backends.is_empty() {
            return Err("--backends: give at least one (standard, latency_specialized)".into());
        }
        for (i, b) in self.backends.iter().enumerate() {
            if self.backends[..i].contains(b) {
                return Err(format!("--backends: {} given twice", b.name()));
            }
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!(
                "--temperature must be finite and >= 0, got {}",
                self.temperature
            ));
        }
        let config =
            specula_model::random::preset(&self.random_weights).map_err(|e| e.to_string())?;
        let need = self.max_positions();
        if need > config.max_position_embeddings {
            return Err(format!(
                "--context {} + --max-tokens {} + a verify block need {need} positions; {} has {}",
                self.context, self.max_tokens, self.random_weights, config.max_position_embeddings
            ));
        }
        Ok(())
    }

    /// Positions per sequence the KV caches hold: the prompt, every generated token and one verify
    /// block on top, so that no request is cut short by a full context.
    pub fn max_positions(&self) -> usize {
        (self.context + self.max_tokens + self.k + 2).next_multiple_of(16)
    }
}

/// The draft model's config for a target: the target's vocabulary, RoPE, norm and architecture
/// switches, with hidden 512, 4 layers, 8 heads, 2 KV heads, head_dim 64, intermediate 1536 and tied
/// embeddings.
pub fn draft_config(target: &ModelConfig) -> ModelConfig {
    let mut c = target.clone();
    c.hidden_size = 512;
    c.num_layers = 4;
    c.num_heads = 8;
    c.num_kv_heads = 2;
    c.head_dim = 64;
    c.intermediate_size = 1536;
    c.tie_word_embeddings = true;
    c
}

/// The value at quantile `q` by nearest rank (`sorted` ascending): the `ceil(q n)`-th smallest, as
/// `RunStats` and `LatencySummary` pick theirs. NaN for no samples.
pub fn nearest_rank(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let n = sorted.len();
    sorted[((q * n as f64).ceil() as usize).clamp(1, n) - 1]
}

/// Median, P90 (the speed 90% of samples reach or exceed: the 10th percentile) and mean of speeds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SpeedSummary {
    pub samples: usize,
    pub median: f64,
    pub p90: f64,
    pub mean: f64,
    pub min: f64,
    pub max: f64,
}

impl SpeedSummary {
    pub fn of(values: &[f64]) -> SpeedSummary {
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        SpeedSummary {
            samples: v.len(),
            median: nearest_rank(&v, 0.5),
            p90: nearest_rank(&v, 0.1),
            mean: if v.is_empty() {
                f64::NAN
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            },
            min: v.first().copied().unwrap_or(f64::NAN),
            max: v.last().copied().unwrap_or(f64::NAN),
        }
    }
}

/// One run of `requests` requests.
#[derive(Debug, Clone, Serialize)]
pub struct E2eRun {
    pub run: usize,
    /// Each request's decode tokens/s (`GenerationStats::decode_tokens_per_s`), in request order.
    pub per_user_tokens_per_s: Vec<f64>,
    /// `RunStats::per_user_tokens_per_s_median` / `_p90` of this run.
    pub per_user_tokens_per_s_median: f64,
    pub per_user_tokens_per_s_p90: f64,
    /// The whole `generate_batch_on` call (prefill included).
    pub wall_ms: f64,
    /// Mean over requests of time to first token (prefill; excluded from the per-user rate).
    pub ttft_ms_mean: f64,
    /// Time spent drafting and in the verify part of the scheduler's decode steps (`RunStats`).
    pub draft_ms: f64,
    pub verify_ms: f64,
    /// Scheduler steps that verified drafts: the most verify steps of any request (exact when
    /// every prompt is prefilled in the first step; `E2eBackendSummary::decode_steps_exact`).
    pub decode_steps: u64,
    /// Verify steps summed over requests (`RunStats::num_verify_steps`).
    pub verify_steps: u64,
    pub drafted_tokens: u64,
    pub accepted_tokens: u64,
    /// `RunStats::acceptance_length`: 1 + accepted / verify steps.
    pub acceptance_length: Option<f64>,
    /// Mean over requests of decode time / the request's verify steps (one step's wall time).
    pub step_ms_mean: f64,
    pub generated_tokens: usize,
    /// Steps that ran the standard path although `latency_specialized` was asked for, by reason.
    pub fallbacks: BTreeMap<String, u64>,
    /// Steps that ran `latency_specialized`.
    pub specialized_steps: u64,
}

/// One backend over its timed runs.
#[derive(Debug, Clone, Serialize)]
pub struct E2eBackendSummary {
    pub decode_backend: &'static str,
    /// Per-user decode tokens/s over every request of every timed run.
    pub per_user_tokens_per_s: SpeedSummary,
    /// Total draft / verify time over total decode steps.
    pub draft_ms_per_step: f64,
    pub verify_ms_per_step: f64,
    /// Mean wall time of one decode step as a user sees it (decode time / verify steps), and what
    /// is neither drafting nor verify in it (host loop: emitting, bookkeeping).
    pub step_ms: f64,
    pub other_ms_per_step: f64,
    /// 1 + accepted / verify steps over every timed run.
    pub acceptance_length: f64,
    /// Drafted tokens per verify step (k unless the drafter proposes fewer).
    pub drafted_per_step: f64,
    pub decode_steps: u64,
    pub decode_steps_exact: bool,
    pub verify_steps: u64,
    pub specialized_steps: u64,
    pub fallbacks: BTreeMap<String, u64>,
    pub wall_ms_median: f64,
    pub ttft_ms_mean: f64,
    /// The warm-up runs (graph capture, fused kernel build; not in the numbers above).
    pub warmup_wall_ms: f64,
    pub runs: Vec<E2eRun>,
}

impl E2eBackendSummary {
    pub fn from_runs(
        decode_backend: DecodeBackend,
        runs: Vec<E2eRun>,
        decode_steps_exact: bool,
        warmup_wall_ms: f64,
    ) -> E2eBackendSummary {
        let speeds: Vec<f64> = runs
            .iter()
            .flat_map(|r| r.per_user_tokens_per_s.iter().copied())
            .collect();
        let sum_u = |f: fn(&E2eRun) -> u64| runs.iter().map(f).sum::<u64>();
        let sum_f = |f: fn(&E2eRun) -> f64| runs.iter().map(f).sum::<f64>();
        let decode_steps = sum_u(|r| r.decode_steps);
        let verify_steps = sum_u(|r| r.verify_steps);
        let per = |total: f64, n: u64| if n == 0 { f64::NAN } else { total / n as f64 };
        let mut fallbacks = BTreeMap::new();
        for r in &runs {
            for (k, v) in &r.fallbacks {
                *fallbacks.entry(k.clone()).or_insert(0) += v;
            }
        }
        let draft_ms_per_step = per(sum_f(|r| r.draft_ms), decode_steps);
        let verify_ms_per_step = per(sum_f(|r| r.verify_ms), decode_steps);
        let step_ms = if runs.is_empty() {
            f64::NAN
        } else {
            sum_f(|r| r.step_ms_mean) / runs.len() as f64
        };
        let mut walls: Vec<f64> = runs.iter().map(|r| r.wall_ms).collect();
        walls.sort_by(f64::total_cmp);
        E2eBackendSummary {
            decode_backend: decode_backend.name(),
            per_user_tokens_per_s: SpeedSummary::of(&speeds),
            draft_ms_per_step,
            verify_ms_per_step,
            step_ms,
            other_ms_per_step: step_ms - draft_ms_per_step - verify_ms_per_step,
            acceptance_length: 1.0 + per(sum_u(|r| r.accepted_tokens) as f64, verify_steps),
            drafted_per_step: per(sum_u(|r| r.drafted_tokens) as f64, verify_steps),
            decode_steps,
            decode_steps_exact,
            verify_steps,
            specialized_steps: sum_u(|r| r.specialized_steps),
            fallbacks,
            wall_ms_median: nearest_rank(&walls, 0.5),
            ttft_ms_mean: if runs.is_empty() {
                f64::NAN
            } else {
                sum_f(|r| r.ttft_ms_mean) / runs.len() as f64
            },
            warmup_wall_ms,
            runs,
        }
    }
}

/// latency_specialized against standard (ratios of per-user tokens/s; > 1: specialized is faster).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct E2eSpeedup {
    pub median: f64,
    pub p90: f64,
    pub mean: f64,
}

pub fn speedup(backends: &[E2eBackendSummary]) -> Option<E2eSpeedup> {
    let find = |b: DecodeBackend| backends.iter().find(|s| s.decode_backend == b.name());
    let (x, y) = (
        find(DecodeBackend::LatencySpecialized)?,
        find(DecodeBackend::Standard)?,
    );
    let (a, b) = (&x.per_user_tokens_per_s, &y.per_user_tokens_per_s);
    Some(E2eSpeedup {
        median: a.median / b.median,
        p90: a.p90 / b.p90,
        mean: a.mean / b.mean,
    })
}

/// The draft model's shape, as reported.
#[derive(Debug, Clone, Serialize)]
pub struct DraftShape {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    pub parameters: usize,
    pub weights_seed: u64,
}

impl DraftShape {
    pub fn of(c: &ModelConfig, weights_seed: u64) -> DraftShape {
        DraftShape {
            hidden_size: c.hidden_size,
            num_layers: c.num_layers,
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            intermediate_size: c.intermediate_size,
            vocab_size: c.vocab_size,
            tie_word_embeddings: c.tie_word_embeddings,
            parameters: c.num_parameters(),
            weights_seed,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct E2eBenchReport {
    pub metric: &'static str,
    pub note: &'static str,
    pub acceptance_mode: &'static str,
    /// e.g. "synthetic (mean length 3.78, k=7)".
    pub acceptance: String,
    pub acceptance_conditional_rates: Vec<f64>,
    pub gpu: String,
    pub arch: String,
    pub date_utc: String,
    pub git_revision: String,
    pub shape: String,
    /// The target: shape, random bf16 weights and their seed.
    pub model: String,
    pub target_parameters: usize,
    pub target_weight_bytes: usize,
    pub drafter: String,
    pub draft_model: Option<DraftShape>,
    /// Where the target runs and where the acceptance rules run (`RunStats`).
    pub device: String,
    pub verifier: String,
    pub model_build_s: f64,
    pub copy_bandwidth_tb_s: f64,
    /// Target weight bytes / copy bandwidth: the floor of one target step (no KV, no draft).
    pub target_weight_floor_ms: f64,
    /// Linear-layer shapes tuned (0 with --no-tune).
    pub tuned_linear_shapes: usize,
    /// The fused kernel's launch shape, once built (latency_specialized).
    pub fused_kernel: Option<String>,
    /// Kernel sources replaced through a development knob (empty: this revision's kernels ran).
    pub kernel_overrides: Vec<crate::KernelOverride>,
    /// Why CUDA graphs were switched off, if a capture failed.
    pub graph_error: Option<String>,
    /// With `specialized_shapes` measured: each step shape's timing of both paths (taken at its
    /// first step, in the warm-up) and whether it runs fused.
    pub shape_timings: Vec<E2eShapeTiming>,
    pub config: E2eBenchConfig,
    pub backends: Vec<E2eBackendSummary>,
    pub speedup_latency_specialized_vs_standard: Option<E2eSpeedup>,
}

/// One step shape as `specialized_shapes` measured timed it: decode-only device time per step of
/// each path (medians of interleaved samples; graph replays where the shape has a graph).
#[derive(Debug, Clone, Serialize)]
pub struct E2eShapeTiming {
    /// Sequences launched (a graph bucket's padded ones included).
    pub sequences: usize,
    /// Most new tokens (rows) of one sequence, and most logits rows.
    pub tokens: usize,
    pub logits: usize,
    pub tapped_layers: usize,
    /// The longest sequence's keys rounded up (`specula_model::gpu::fused::context_bucket`): each
    /// bucket is timed at its first step.
    pub context_bucket: usize,
    pub fused_ms: f64,
    pub standard_ms: f64,
    pub runs_fused: bool,
}

pub const METRIC: &str = "per-user decode tokens/s (GenerationStats::decode_tokens_per_s: (generated tokens - 1) / (last token time - first token time); prefill excluded), median and P90 (10th percentile of speed) by nearest rank over every request of every timed run";

pub const NOTE: &str = "End-to-end per-user numbers: the engine's scheduler loop on the host, drafting, the target's verify forward and the acceptance rule on the device, every step; not decode-only step times (see `specula bench step` for those).";

/// The report as Markdown.
pub fn render_markdown(r: &E2eBenchReport) -> String {
    let c = &r.config;
    let mut md = format!(
        "# specula bench e2e: {}\n\n{} ({}), {}, git {}.\n\n{}\n\n\
- Target: {}; {:.3} B parameters, {:.3} GB of bf16 weights (weight floor {:.3} ms per step at {:.3} TB/s copy bandwidth); {}.\n\
- Drafter: {}.\n\
- Acceptance: {} (conditional rates {}); target on {}, acceptance rules on the {}.\n\
- Workload per run: {} request(s) x {} seeded random prompt tokens, exactly {} generated tokens each (no stop tokens), temperature {}; \
per backend one warm-up run plus one short run per smaller draft count ending where the timed runs end (each verify-block shape's graph capture and, under measured shapes, its one-time timing happen there), then {} timed runs, the backends alternating run by run on the same prompts and seeds.\n\
- Metric: {}.\n\n",
        r.shape,
        r.gpu,
        r.arch,
        r.date_utc,
        r.git_revision,
        r.note,
        r.model,
        r.target_parameters as f64 / 1e9,
        r.target_weight_bytes as f64 / 1e9,
        r.target_weight_floor_ms,
        r.copy_bandwidth_tb_s,
        if c.tune {
            format!(
                "linear layers tuned (cuBLAS vs skinny, {} shapes)",
                r.tuned_linear_shapes
            )
        } else {
            "linear layers not tuned".to_string()
        },
        r.drafter,
        r.acceptance,
        rates_text(&r.acceptance_conditional_rates),
        r.device,
        r.verifier,
        c.requests,
        c.context,
        c.max_tokens,
        c.temperature,
        c.runs,
        r.metric,
    );
    if let Some(e) = &r.graph_error {
        md.push_str(&format!(
            "**CUDA graphs were off in this run** (capture failed: {e}).\n\n"
        ));
    }
    if let Some(f) = &r.fused_kernel {
        md.push_str(&format!("Fused kernel: {f}.\n\n"));
    }
    md.push_str(&crate::kernel_overrides_markdown(&r.kernel_overrides));
    md.push_str(&format!(
        "latency_specialized shapes: {}.\n\n",
        match c.specialized_shapes {
            SpecializedShapes::Measured => "measured (a step shape runs the fused kernel only where its first step in each context bucket timed it faster than the standard step; the shapes that lost count as `measured_slower` fallbacks)",
            SpecializedShapes::All => "all (every step shape the fused kernel takes runs it)",
        }
    ));
    if !r.shape_timings.is_empty() {
        md.push_str("Step shapes as timed at their first step in each context bucket (decode-only device time per step, not end to end):\n\n| sequences | tokens each | logits each | keys up to | fused ms | standard ms | fused / standard | runs |\n|---:|---:|---:|---:|---:|---:|---:|---|\n");
        for t in &r.shape_timings {
            md.push_str(&format!(
                "| {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {} |\n",
                t.sequences,
                t.tokens,
                t.logits,
                t.context_bucket,
                t.fused_ms,
                t.standard_ms,
                t.fused_ms / t.standard_ms,
                if t.runs_fused { "fused" } else { "standard" }
            ));
        }
        md.push('\n');
    }
    md.push_str("| backend | tok/s per user median | P90 | mean | min | step ms | draft ms/step | verify ms/step | other ms/step | AL measured | drafted/step | decode steps | specialized steps | fallbacks |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    for b in &r.backends {
        let s = &b.per_user_tokens_per_s;
        md.push_str(&format!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {}{} | {} | {} |\n",
            b.decode_backend,
            s.median,
            s.p90,
            s.mean,
            s.min,
            b.step_ms,
            b.draft_ms_per_step,
            b.verify_ms_per_step,
            b.other_ms_per_step,
            b.acceptance_length,
            b.drafted_per_step,
            b.decode_steps,
            if b.decode_steps_exact { "" } else { " (lower bound)" },
            b.specialized_steps,
            fallbacks_text(&b.fallbacks),
        ));
    }
    if let Some(x) = &r.speedup_latency_specialized_vs_standard {
        md.push_str(&format!(
            "\nlatency_specialized vs standard, per-user tokens/s: {:.3}x at the median, {:.3}x at P90, {:.3}x on the mean.\n",
            x.median, x.p90, x.mean
        ));
    }
    md.push_str("\nstep ms = a request's decode time / its verify steps (mean over runs); draft and verify ms per step = the scheduler's draft and verify time / decode steps; other = step - draft - verify (host loop). drafted/step and the measured AL sit a little below k and the synthetic length because the scheduler clips the draft count to the tokens left near max tokens. verify covers the target forward, the acceptance rule on the device, its readback and the cache rollback. Prefill steps count as fallbacks (`prefill_chunk`) under latency_specialized.\n\nPer run (tokens/s per user, in request order):\n\n| backend | run | tok/s per user | wall ms | TTFT ms | draft ms | verify ms | decode steps | AL |\n|---|---:|---|---:|---:|---:|---:|---:|---:|\n");
    for b in &r.backends {
        for run in &b.runs {
            let users: Vec<String> = run
                .per_user_tokens_per_s
                .iter()
                .map(|v| format!("{v:.1}"))
                .collect();
            md.push_str(&format!(
                "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} |\n",
                b.decode_backend,
                run.run,
                users.join(", "),
                run.wall_ms,
                run.ttft_ms_mean,
                run.draft_ms,
                run.verify_ms,
                run.decode_steps,
                run.acceptance_length
                    .map_or("-".to_string(), |v| format!("{v:.3}")),
            ));
        }
    }
    md
}

fn rates_text(rates: &[f64]) -> String {
    let v: Vec<String> = rates.iter().map(|r| format!("{r:.3}")).collect();
    format!("[{}]", v.join(", "))
}

fn fallbacks_text(f: &BTreeMap<String, u64>) -> String {
    if f.is_empty() {
        "-".into()
    } else {
        f.iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The short table printed at the end.
pub fn render_stdout_table(r: &E2eBenchReport) -> String {
    let mut s = format!(
        "{} | drafter {} | {} | {} request(s), context {}, {} tokens, {} runs\n{:<20} {:>10} {:>10} {:>9} {:>9} {:>9} {:>7} {:>11}\n",
        r.shape,
        r.config.drafter.name(),
        r.acceptance,
        r.config.requests,
        r.config.context,
        r.config.max_tokens,
        r.config.runs,
        "backend",
        "tok/s med",
        "tok/s P90",
        "step ms",
        "draft ms",
        "verify ms",
        "AL",
        "specialized"
    );
    for b in &r.backends {
        s.push_str(&format!(
            "{:<20} {:>10.1} {:>10.1} {:>9.3} {:>9.3} {:>9.3} {:>7.3} {:>11}\n",
            b.decode_backend,
            b.per_user_tokens_per_s.median,
            b.per_user_tokens_per_s.p90,
            b.step_ms,
            b.draft_ms_per_step,
            b.verify_ms_per_step,
            b.acceptance_length,
            format!("{}/{}", b.specialized_steps, b.decode_steps),
        ));
    }
    if let Some(x) = &r.speedup_latency_specialized_vs_standard {
        s.push_str(&format!(
            "latency_specialized vs standard: {:.3}x (median), {:.3}x (P90)\n",
            x.median, x.p90
        ));
    }
    s
}

/// Prompt length of a short warm-up run of `short_tokens` tokens that ends where the timed runs end
/// (`cfg.context + cfg.max_tokens` positions), so that the blocks it verifies fall in the context
/// bucket of the timed runs' last steps, where their clipped draft counts run.
pub fn tail_context(cfg: &E2eBenchConfig, short_tokens: usize) -> usize {
    cfg.context + cfg.max_tokens.saturating_sub(short_tokens)
}

/// The requests of one run: `cfg.requests` prompts of `context` ids below `vocab` drawn from a
/// stream seeded by (`cfg.seed`, `slot`), each request with its own seed from the same stream, no
/// stop tokens or strings, `num_draft_tokens` drafts and `max_tokens` tokens. The same slot gives
/// the same requests for every backend.
pub fn make_requests(
    cfg: &E2eBenchConfig,
    vocab: usize,
    slot: u64,
    context: usize,
    num_draft_tokens: usize,
    max_tokens: usize,
) -> Vec<specula_engine::GenerationRequest> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(
        cfg.seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(slot.wrapping_mul(0xD1B5_4A32_D192_ED03))
            ^ 0xE2E0_BE4C,
    );
    (0..cfg.requests)
        .map(|_| specula_engine::GenerationRequest {
            prompt_ids: (0..context)
                .map(|_| rng.random_range(0..vocab as u32))
                .collect(),
            max_new_tokens: max_tokens,
            sampling: specula_kernels::sampling::SamplingParams {
                temperature: cfg.temperature,
                top_k: 0,
                top_p: 1.0,
            },
            seed: rng.random(),
            stop_token_ids: Vec::new(),
            vocab_limit: None,
            stop_strings: Vec::new(),
            num_draft_tokens,
        })
        .collect()
}

#[cfg(feature = "cuda")]
mod device {
    use super::*;
    use anyhow::{bail, Context, Result};
    use specula_drafters::{Drafter, ModelDrafter, NgramDrafter};
    use specula_engine::gpu_target::GpuTarget;
    use specula_engine::{
        generate_batch_on, BatchOutput, FinishReason, GenerationRequest, TargetBackend,
        TargetOptions,
    };
    use specula_model::gpu::{GpuOptions, GpuTransformer};
    use specula_verifier::{AcceptanceRule, SyntheticAcceptance};
    use std::time::Instant;

    /// The GPU, the driver and NVRTC are there (checked before cudarc is touched, which would
    /// panic without a driver).
    fn check_gpu() -> Result<()> {
        use specula_kernels::cuda::{driver_available, nvrtc_available, CudaError};
        let fail = |e: String| {
            anyhow::anyhow!(
                "`specula bench e2e` runs on an NVIDIA GPU: {e}; CPU timings: `cargo run --release -p specula-experiments --bin cpu_bench`"
            )
        };
        if !driver_available() {
            return Err(fail(CudaError::NoDriver.to_string()));
        }
        match cudarc::driver::CudaContext::device_count() {
            Ok(n) if n > 0 => {}
            Ok(_) => return Err(fail(CudaError::NoDevice.to_string())),
            Err(e) => return Err(fail(CudaError::Driver(e).to_string())),
        }
        if !nvrtc_available() {
            return Err(fail(CudaError::NoNvrtc.to_string()));
        }
        Ok(())
    }

    /// One `generate_batch_on` call on the borrowed target, checked to have generated exactly
    /// `max_tokens` per request.
    fn run_once(
        target: &mut GpuTarget,
        backend: DecodeBackend,
        drafter: &mut dyn Drafter,
        rule: &AcceptanceRule,
        requests: &[GenerationRequest],
    ) -> Result<BatchOutput> {
        let out = generate_batch_on(
            Box::new(&mut *target),
            backend,
            Some(drafter),
            rule,
            requests,
            None,
        )
        .with_context(|| format!("running the engine with decode backend {}", backend.name()))?;
        for (i, (o, req)) in out.outputs.iter().zip(requests).enumerate() {
            if o.token_ids.len() != req.max_new_tokens || o.finish_reason != FinishReason::Length {
                bail!(
                    "request {i} generated {} tokens ({:?}), expected exactly {}",
                    o.token_ids.len(),
                    o.finish_reason,
                    req.max_new_tokens
                );
            }
        }
        Ok(out)
    }

    fn record(run: usize, out: &BatchOutput) -> E2eRun {
        let n = out.outputs.len().max(1) as f64;
        let spec = |f: fn(&specula_engine::SpeculativeStats) -> u64| -> Vec<u64> {
            out.outputs
                .iter()
                .map(|o| o.stats.speculative.as_ref().map_or(0, f))
                .collect()
        };
        let steps = spec(|s| s.num_verify_steps);
        let step_ms_mean = out
            .outputs
            .iter()
            .zip(&steps)
            .map(|(o, &st)| (o.stats.total_ms - o.stats.ttft_ms) / st.max(1) as f64)
            .sum::<f64>()
            / n;
        E2eRun {
            run,
            per_user_tokens_per_s: out
                .outputs
                .iter()
                .map(|o| o.stats.decode_tokens_per_s)
                .collect(),
            per_user_tokens_per_s_median: out.run.per_user_tokens_per_s_median,
            per_user_tokens_per_s_p90: out.run.per_user_tokens_per_s_p90,
            wall_ms: out.run.wall_ms,
            ttft_ms_mean: out.outputs.iter().map(|o| o.stats.ttft_ms).sum::<f64>() / n,
            draft_ms: out.run.draft_ms,
            verify_ms: out.run.verify_ms,
            decode_steps: steps.iter().copied().max().unwrap_or(0),
            verify_steps: out.run.num_verify_steps,
            drafted_tokens: spec(|s| s.drafted_tokens).iter().sum(),
            accepted_tokens: spec(|s| s.accepted_tokens).iter().sum(),
            acceptance_length: out.run.acceptance_length,
            step_ms_mean,
            generated_tokens: out.run.generated_tokens,
            fallbacks: out.run.decode_backend_fallbacks.clone(),
            specialized_steps: out.run.decode_backend_specialized_steps,
        }
    }

    pub fn run_e2e_bench(cfg: E2eBenchConfig) -> Result<E2eBenchReport> {
        cfg.validate().map_err(anyhow::Error::msg)?;
        check_gpu()?;
        let config = specula_model::random::preset(&cfg.random_weights)?;
        let vocab = config.vocab_size;
        let max_positions = cfg.max_positions();
        let target_opts = TargetOptions {
            max_running: cfg.requests,
            // Every prompt in the first step when it fits the step's rows (then every request starts
            // decoding in the same step).
            prefill_chunk_tokens: cfg.requests * cfg.context,
            tapped_layers: 0,
            max_positions,
            verify_on_device: true,
            specialized_shapes: cfg.specialized_shapes,
        };
        let decode_steps_exact = cfg.requests * cfg.context <= 512;

        // The target, built on the device.
        let t0 = Instant::now();
        let mut gpu = GpuTransformer::random(
            config.clone(),
            cfg.seed,
            GpuTarget::gpu_options(&config, &target_opts),
        )
        .with_context(|| {
            format!(
                "building the random {} model on the GPU",
                cfg.random_weights
            )
        })?;
        gpu.device.stream.synchronize()?;
        let model_build_s = t0.elapsed().as_secs_f64();
        let (gpu_name, arch) = (gpu.device.name.clone(), gpu.device.arch.clone());
        let weight_bytes = gpu.weight_bytes();
        eprintln!(
            "{} (random bf16 weights, seed {}) on {gpu_name} ({arch}): built in {model_build_s:.2} s, {:.3} GB of weights per step",
            cfg.random_weights,
            cfg.seed,
            weight_bytes as f64 / 1e9
        );
        let bandwidth = crate::step_bench::copy_bandwidth(&gpu)?;
        let weight_floor_ms = weight_bytes as f64 / (bandwidth * 1e12) * 1e3;
        eprintln!(
            "copy bandwidth {bandwidth:.3} TB/s, target weight floor {weight_floor_ms:.3} ms"
        );
        let tuned_linear_shapes = if cfg.tune {
            gpu.tune_linear_layers(&[8, 16, 32, 64], 20)
                .context("tuning the target's linear layers")?
                .len()
        } else {
            0
        };
        let mut target =
            GpuTarget::from_model(gpu, &target_opts).context("building the GPU target")?;

        // The drafter.
        let draft_seed = cfg.seed.wrapping_add(1);
        let (mut drafter, drafter_text, draft_model): (Box<dyn Drafter>, String, _) =
            match cfg.drafter {
                E2eDrafter::DraftRandom => {
                    let dc = draft_config(&config);
                    let shape = DraftShape::of(&dc, draft_seed);
                    let host = specula_model::random::random_transformer(dc.clone(), draft_seed)
                        .context("building the random draft model")?;
                    let d = ModelDrafter::new(host)
                        .to_gpu(GpuOptions {
                            max_sequences: cfg.requests,
                            max_positions,
                            ..GpuOptions::default()
                        })
                        .context("moving the draft model to the GPU")?;
                    let text = format!(
                        "draft-random: a random-weight draft model (bf16, weights seed {draft_seed}) on the GPU (ModelDrafter::to_gpu: standard step, linear layers not tuned), \
                         the target's vocabulary ({}), RoPE and architecture with hidden {}, {} layers, {} heads, {} KV heads, head_dim {}, intermediate {}, tied embeddings: \
                         {:.1} M parameters ({:.1} M of them the embedding / LM head), {:.1}% of the target's; it drafts k tokens autoregressively, one GPU forward per \
                         draft position; with greedy requests (this benchmark's) each draft is the device argmax of its row (only the id comes back, no distributions: \
                         a greedy q is one-hot), otherwise the logits row is read back and sampled on the host and the distributions are uploaded for the device verify",
                        dc.vocab_size,
                        dc.hidden_size,
                        dc.num_layers,
                        dc.num_heads,
                        dc.num_kv_heads,
                        dc.head_dim,
                        dc.intermediate_size,
                        shape.parameters as f64 / 1e6,
                        (dc.vocab_size * dc.hidden_size) as f64 / 1e6,
                        100.0 * shape.parameters as f64 / config.num_parameters() as f64,
                    );
                    (Box::new(d), text, Some(shape))
                }
                E2eDrafter::Ngram => (
                    Box::new(NgramDrafter::new(1, 4)),
                    "ngram: prompt lookup on the CPU (n = 4 down to 1), no model; it proposes only tokens that followed an earlier match in the sequence, \
                     so often fewer than k (on random prompts usually none): its steps verify fewer drafts and the measured AL falls below the synthetic target"
                        .to_string(),
                    None,
                ),
            };
        eprintln!("drafter: {drafter_text}");
        let synthetic = SyntheticAcceptance::from_mean_length(cfg.acceptance_length, cfg.k)?;
        let rule = AcceptanceRule::Synthetic(synthetic.clone());

        // Warm-up per backend: the configured run, then one short run per smaller draft count.
        let mut warmup_ms = vec![0f64; cfg.backends.len()];
        for (bi, &backend) in cfg.backends.iter().enumerate() {
            target
                .set_decode_backend(backend)
                .with_context(|| format!("setting up the {} decode backend", backend.name()))?;
            if let Some(reason) = target.decode_backend_unavailable(backend) {
                eprintln!(
                    "note: no step can run {} here ({reason}); its steps fall back to standard and are counted",
                    backend.name()
                );
            }
            let t = Instant::now();
            let reqs = make_requests(&cfg, vocab, 0, cfg.context, cfg.k, cfg.max_tokens);
            run_once(&mut target, backend, &mut *drafter, &rule, &reqs).context("warm-up run")?;
            let short = cfg.max_tokens.min(32);
            for kk in 0..cfg.k {
                let reqs = make_requests(
                    &cfg,
                    vocab,
                    1_000_000 + kk as u64,
                    tail_context(&cfg, short),
                    kk,
                    short,
                );
                run_once(&mut target, backend, &mut *drafter, &rule, &reqs)
                    .with_context(|| format!("warm-up run with {kk} drafts"))?;
            }
            warmup_ms[bi] = t.elapsed().as_secs_f64() * 1e3;
            eprintln!("{}: warm-up {:.0} ms", backend.name(), warmup_ms[bi]);
        }

        // Timed runs, the backends alternating.
        let mut runs: Vec<Vec<E2eRun>> = vec![Vec::new(); cfg.backends.len()];
        let mut device = String::new();
        let mut verifier = String::new();
        for run in 0..cfg.runs {
            let reqs = make_requests(
                &cfg,
                vocab,
                1 + run as u64,
                cfg.context,
                cfg.k,
                cfg.max_tokens,
            );
            for (bi, &backend) in cfg.backends.iter().enumerate() {
                let out = run_once(&mut target, backend, &mut *drafter, &rule, &reqs)
                    .with_context(|| format!("timed run {run}"))?;
                device.clone_from(&out.run.device);
                verifier.clone_from(&out.run.verifier);
                let r = record(run, &out);
                eprintln!(
                    "{} run {run}: {:.1} tok/s per user (median), wall {:.1} ms, AL {:.3}, draft {:.1} ms, verify {:.1} ms, {} decode steps, {} specialized",
                    backend.name(),
                    r.per_user_tokens_per_s_median,
                    r.wall_ms,
                    r.acceptance_length.unwrap_or(f64::NAN),
                    r.draft_ms,
                    r.verify_ms,
                    r.decode_steps,
                    r.specialized_steps
                );
                runs[bi].push(r);
            }
        }
        let backends: Vec<E2eBackendSummary> = cfg
            .backends
            .iter()
            .zip(runs)
            .zip(&warmup_ms)
            .map(|((&b, r), &w)| E2eBackendSummary::from_runs(b, r, decode_steps_exact, w))
            .collect();

        let prov = crate::Provenance::collect();
        let git_revision = std::env::var("SPECULA_GIT_REVISION").unwrap_or(prov.git_revision);
        let fused_kernel = target.model().fused_info().map(|f| format!("{f:?}"));
        let report = E2eBenchReport {
            metric: METRIC,
            note: NOTE,
            acceptance_mode: "synthetic",
            acceptance: format!(
                "synthetic (mean length {}, k={})",
                cfg.acceptance_length, cfg.k
            ),
            acceptance_conditional_rates: synthetic.conditional_rates().to_vec(),
            gpu: gpu_name,
            arch,
            date_utc: prov.date_utc,
            git_revision,
            shape: cfg.random_weights.clone(),
            model: format!(
                "{} shape, random bf16 weights, seed {}",
                cfg.random_weights, cfg.seed
            ),
            target_parameters: config.num_parameters(),
            target_weight_bytes: weight_bytes,
            drafter: drafter_text,
            draft_model,
            device,
            verifier,
            model_build_s,
            copy_bandwidth_tb_s: bandwidth,
            target_weight_floor_ms: weight_floor_ms,
            tuned_linear_shapes,
            fused_kernel,
            kernel_overrides: crate::kernel_overrides(),
            graph_error: target.model().graph_error().map(str::to_string),
            shape_timings: target
                .model()
                .fused_shape_timings()
                .iter()
                .map(|(k, t)| E2eShapeTiming {
                    sequences: k.sequences,
                    tokens: k.tokens,
                    logits: k.logits,
                    tapped_layers: k.tapped_layers,
                    context_bucket: k.context_bucket,
                    fused_ms: t.fused_ms,
                    standard_ms: t.standard_ms,
                    runs_fused: t.fused_wins(),
                })
                .collect(),
            speedup_latency_specialized_vs_standard: speedup(&backends),
            backends,
            config: cfg,
        };
        write_report(&report)?;
        print!("{}", render_stdout_table(&report));
        Ok(report)
    }

    fn write_report(r: &E2eBenchReport) -> Result<()> {
        let dir = &r.config.out_dir;
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let json_path = dir.join(format!("e2e_bench_{}.json", r.shape));
        std::fs::write(&json_path, serde_json::to_string_pretty(r)? + "\n")
            .with_context(|| format!("writing {}", json_path.display()))?;
        let md_path = dir.join(format!("e2e_bench_{}.md", r.shape));
        std::fs::write(&md_path, render_markdown(r))
            .with_context(|| format!("writing {}", md_path.display()))?;
        eprintln!("wrote {} and {}", json_path.display(), md_path.display());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> E2eBenchConfig {
        E2eBenchConfig {
            random_weights: "llama3.2-1b".into(),
            seed: 0,
            backends: vec![DecodeBackend::Standard, DecodeBackend::LatencySpecialized],
            drafter: E2eDrafter::DraftRandom,
            requests: 1,
            k: 7,
            acceptance_length: 3.78,
            context: 128,
            max_tokens: 256,
            runs: 10,
            temperature: 0.0,
            tune: true,
            specialized_shapes: SpecializedShapes::Measured,
            out_dir: PathBuf::from("unused"),
        }
    }

    #[test]
    fn the_default_config_is_valid_and_bad_settings_are_refused() {
        cfg().validate().unwrap();
        let bad = |f: fn(&mut E2eBenchConfig)| {
            let mut c = cfg();
            f(&mut c);
            c.validate().unwrap_err()
        };
        assert!(bad(|c| c.k = 0).contains("1..=16"));
        assert!(bad(|c| c.k = 17).contains("1..=16"));
        assert!(bad(|c| c.requests = 0).contains("requests"));
        assert!(bad(|c| c.acceptance_length = 1.0).contains("(1, 8]"));
        assert!(bad(|c| c.acceptance_length = 8.01).contains("acceptance"));
        assert!(bad(|c| c.acceptance_length = f64::NAN).contains("acceptance"));
        assert!(bad(|c| c.max_tokens = 1).contains("max-tokens"));
        assert!(bad(|c| c.runs = 0).contains("runs"));
        assert!(bad(|c| c.context = 0).contains("context"));
        assert!(bad(|c| c.backends.clear()).contains("backends"));
        assert!(bad(|c| c.backends = vec![DecodeBackend::Standard; 2]).contains("twice"));
        assert!(bad(|c| c.temperature = -1.0).contains("temperature"));
        assert!(bad(|c| c.random_weights = "gpt-5".into()).contains("gpt-5"));
        assert!(bad(|c| c.max_tokens = 200_000).contains("positions"));
        // The edges of the ranges are accepted.
        let edges: [fn(&mut E2eBenchConfig); 4] = [
            |c| {
                c.k = 1;
                c.acceptance_length = 2.0;
            },
            |c| c.k = 16,
            |c| c.acceptance_length = 8.0,
            |c| c.acceptance_length = 1.001,
        ];
        for f in edges {
            let mut c = cfg();
            f(&mut c);
            c.validate().unwrap();
        }
    }

    #[test]
    fn positions_hold_prompt_output_and_a_verify_block() {
        let c = cfg();
        let p = c.max_positions();
        assert!(p > c.context + c.max_tokens + c.k);
        assert_eq!(p % 16, 0);
    }

    #[test]
    fn nearest_rank_matches_the_engines_definition() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(nearest_rank(&v, 0.5), 5.0);
        assert_eq!(nearest_rank(&v, 0.1), 1.0);
        assert_eq!(nearest_rank(&v, 0.9), 9.0);
        assert_eq!(nearest_rank(&v, 1.0), 10.0);
        assert_eq!(nearest_rank(&[3.0], 0.1), 3.0);
        assert!(nearest_rank(&[], 0.5).is_nan());
        // 20 samples: P90 of speed is the 2nd slowest.
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(nearest_rank(&v, 0.1), 2.0);
        let s = SpeedSummary::of(&[4.0, 1.0, 3.0, 2.0]);
        assert_eq!(
            (s.samples, s.median, s.p90, s.min, s.max),
            (4, 2.0, 1.0, 1.0, 4.0)
        );
        assert_eq!(s.mean, 2.5);
    }

    fn run(speeds: &[f64], steps: u64, accepted: u64) -> E2eRun {
        E2eRun {
            run: 0,
            per_user_tokens_per_s: speeds.to_vec(),
            per_user_tokens_per_s_median: 0.0,
            per_user_tokens_per_s_p90: 0.0,
            wall_ms: 100.0,
            ttft_ms_mean: 5.0,
            draft_ms: 2.0 * steps as f64,
            verify_ms: 1.0 * steps as f64,
            decode_steps: steps,
            verify_steps: steps,
            drafted_tokens: 7 * steps,
            accepted_tokens: accepted,
            acceptance_length: Some(1.0 + accepted as f64 / steps as f64),
            step_ms_mean: 3.5,
            generated_tokens: 256,
            fallbacks: BTreeMap::from([("prefill_chunk".to_string(), 1)]),
            specialized_steps: steps,
        }
    }

    #[test]
    fn summaries_pool_runs_and_the_speedup_compares_backends() {
        let standard = E2eBackendSummary::from_runs(
            DecodeBackend::Standard,
            vec![run(&[100.0], 70, 196), run(&[90.0], 66, 184)],
            true,
            1.0,
        );
        assert_eq!(standard.per_user_tokens_per_s.median, 90.0);
        assert_eq!(standard.per_user_tokens_per_s.p90, 90.0);
        assert_eq!(standard.decode_steps, 136);
        assert!((standard.draft_ms_per_step - 2.0).abs() < 1e-12);
        assert!((standard.verify_ms_per_step - 1.0).abs() < 1e-12);
        assert!((standard.other_ms_per_step - 0.5).abs() < 1e-12);
        assert!((standard.acceptance_length - (1.0 + 380.0 / 136.0)).abs() < 1e-12);
        assert!((standard.drafted_per_step - 7.0).abs() < 1e-12);
        assert_eq!(standard.fallbacks["prefill_chunk"], 2);
        let fused = E2eBackendSummary::from_runs(
            DecodeBackend::LatencySpecialized,
            vec![run(&[150.0], 70, 196), run(&[120.0], 66, 184)],
            true,
            1.0,
        );
        assert!(speedup(std::slice::from_ref(&standard)).is_none());
        let x = speedup(&[standard.clone(), fused.clone()]).unwrap();
        assert!((x.median - 120.0 / 90.0).abs() < 1e-12);
        assert!((x.mean - 135.0 / 95.0).abs() < 1e-12);
        // The report renders with both backends and the speedup.
        let report = E2eBenchReport {
            metric: METRIC,
            note: NOTE,
            acceptance_mode: "synthetic",
            acceptance: "synthetic (mean length 3.78, k=7)".into(),
            acceptance_conditional_rates: vec![1.0, 1.0, 0.78, 0.0, 0.0, 0.0, 0.0],
            gpu: "GPU".into(),
            arch: "sm_90".into(),
            date_utc: "2025-01-01T00:00:00Z".into(),
            git_revision: "abc".into(),
            shape: "llama3.2-1b".into(),
            model: "llama3.2-1b shape, random bf16 weights, seed 0".into(),
            target_parameters: 1_235_814_400,
            target_weight_bytes: 2_471_000_000,
            drafter: "draft-random".into(),
            draft_model: None,
            device: "cuda (GPU, sm_90)".into(),
            verifier: "device".into(),
            model_build_s: 1.0,
            copy_bandwidth_tb_s: 4.0,
            target_weight_floor_ms: 0.6,
            tuned_linear_shapes: 12,
            fused_kernel: None,
            kernel_overrides: vec![crate::KernelOverride {
                variable: "SPECULA_FUSED_STEP_CU".into(),
                path: "/tmp/candidate.cu".into(),
                sha256: "00ff".into(),
            }],
            graph_error: None,
            shape_timings: vec![E2eShapeTiming {
                sequences: 1,
                tokens: 8,
                logits: 8,
                tapped_layers: 0,
                context_bucket: 512,
                fused_ms: 2.2,
                standard_ms: 1.4,
                runs_fused: false,
            }],
            config: cfg(),
            backends: vec![standard, fused],
            speedup_latency_specialized_vs_standard: Some(x),
        };
        let md = render_markdown(&report);
        assert!(md.contains("| latency_specialized | 120.0 |"), "{md}");
        assert!(md.contains("synthetic (mean length 3.78, k=7)"));
        assert!(
            md.contains("conditional rates [1.000, 1.000, 0.780, 0.000"),
            "{md}"
        );
        assert!(md.contains("not decode-only step times"));
        assert!(md.contains("1.333x at the median"));
        assert!(md.contains("latency_specialized shapes: measured"), "{md}");
        assert!(
            md.contains("**Kernel sources replaced in this run**")
                && md.contains("`SPECULA_FUSED_STEP_CU` = `/tmp/candidate.cu` (sha256 00ff)"),
            "{md}"
        );
        assert!(
            md.contains("| 1 | 8 | 8 | 512 | 2.200 | 1.400 | 1.571 | standard |"),
            "{md}"
        );
        let table = render_stdout_table(&report);
        assert!(
            table.contains("standard") && table.contains("1.333x"),
            "{table}"
        );
        serde_json::to_string(&report).unwrap();
    }

    #[test]
    fn the_draft_model_shares_the_targets_vocabulary_and_is_small() {
        let t = specula_model::random::preset("llama3.2-1b").unwrap();
        let d = draft_config(&t);
        d.validate().unwrap();
        assert_eq!(d.vocab_size, t.vocab_size);
        assert_eq!(d.arch, t.arch);
        assert_eq!(d.rope_theta, t.rope_theta);
        assert_eq!(d.rope_scaling.is_some(), t.rope_scaling.is_some());
        assert_eq!(
            (
                d.hidden_size,
                d.num_layers,
                d.num_heads,
                d.num_kv_heads,
                d.head_dim,
                d.intermediate_size
            ),
            (512, 4, 8, 2, 64, 1536)
        );
        assert!(d.tie_word_embeddings);
        let p = d.num_parameters();
        assert!((70_000_000..90_000_000).contains(&p), "{p}");
        assert!(p * 10 < t.num_parameters());
    }

    #[test]
    fn short_warm_up_runs_end_where_the_timed_runs_end() {
        // A 4000-token prompt and 256 new tokens: the timed runs' clipped last blocks verify past
        // 4096 keys, so the short runs (32 tokens) must too; from the prompt's end they would not.
        let c = E2eBenchConfig {
            context: 4000,
            max_tokens: 256,
            ..cfg()
        };
        let ctx = tail_context(&c, 32);
        assert_eq!(ctx + 32, c.context + c.max_tokens);
        assert!(ctx > 4096 && c.context + 32 <= 4096);
        let reqs = make_requests(&c, 1000, 9, ctx, 3, 32);
        assert!(reqs
            .iter()
            .all(|r| r.prompt_ids.len() == ctx && r.max_new_tokens == 32));
        // Fewer new tokens than a short run: the short runs start at the prompt's end.
        let tiny = E2eBenchConfig {
            max_tokens: 16,
            ..cfg()
        };
        assert_eq!(tail_context(&tiny, 16), tiny.context);
        // Their positions never pass the caches' room.
        assert!(ctx + 32 + c.k < c.max_positions());
    }

    #[test]
    fn requests_are_seeded_per_slot_and_never_stop_early() {
        let c = cfg();
        let a = make_requests(&c, 1000, 3, c.context, 7, 256);
        let b = make_requests(&c, 1000, 3, c.context, 7, 256);
        let other = make_requests(&c, 1000, 4, c.context, 7, 256);
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].prompt_ids, b[0].prompt_ids);
        assert_eq!(a[0].seed, b[0].seed);
        assert_ne!(a[0].prompt_ids, other[0].prompt_ids);
        for r in &a {
            assert_eq!(r.prompt_ids.len(), 128);
            assert!(r.prompt_ids.iter().all(|&t| t < 1000));
            assert!(r.stop_token_ids.is_empty() && r.stop_strings.is_empty());
            assert_eq!((r.max_new_tokens, r.num_draft_tokens), (256, 7));
        }
        let many = make_requests(
            &E2eBenchConfig {
                requests: 4,
                ..cfg()
            },
            1000,
            3,
            40,
            2,
            16,
        );
        assert_eq!(many.len(), 4);
        assert!(many.iter().all(|r| r.prompt_ids.len() == 40));
        assert_ne!(many[0].prompt_ids, many[1].prompt_ids);
    }

    #[test]
    fn backends_and_drafters_parse_by_name() {
        assert_eq!(parse_backend("standard"), Ok(DecodeBackend::Standard));
        assert_eq!(
            parse_backend("latency_specialized"),
            Ok(DecodeBackend::LatencySpecialized)
        );
        assert!(parse_backend("turbo").is_err());
        assert_eq!(
            parse_specialized_shapes("measured"),
            Ok(SpecializedShapes::Measured)
        );
        assert_eq!(parse_specialized_shapes("all"), Ok(SpecializedShapes::All));
        assert!(parse_specialized_shapes("some")
            .unwrap_err()
            .contains("measured, all"));
        assert_eq!("draft-random".parse(), Ok(E2eDrafter::DraftRandom));
        assert_eq!("ngram".parse(), Ok(E2eDrafter::Ngram));
        assert!("dspark".parse::<E2eDrafter>().is_err());
    }
}
