//! The `latency_specialized` decode backend (issue 6), v0: a decode/verify step of the GPU forward as
//! ONE persistent kernel launch (`fused_forward`, `kernels/cuda/fused_step.cu`, whose top comment has
//! the phase plan and the synchronisation), instead of the standard step's ~10 launches per layer.
//!
//! It runs on the same weights, paged KV cache and step buffers as the standard step
//! (`GpuTransformer::encode`): `run` packs the step inputs exactly as before, then either launches the
//! standard kernels or `fused_forward` followed by `argmax_rows`, and writes the logits where the
//! standard step writes them. So the two can be run on identical state and compared
//! (`experiments` `gpu_fused_check`), and the CUDA-graph scheme is unchanged: the graph key carries
//! whether the fused kernel runs the shape, so each backend keeps its own graph per shape. Acceptance
//! stays in the existing `verify_drafts` kernel (`specula_kernels::cuda::sampling`), launched by the
//! caller right after the step on the same stream, as for the standard step.
//!
//! Selection: `set_step_backend(StepBackend::LatencySpecialized)` compiles the kernel (NVRTC, once) and
//! checks that every CTA fits on the device at once. From then on each step that `supports` takes runs
//! fused; the others (prompt chunks, more than 8 sequences or 16 tokens per sequence, more than 8
//! tapped layers, a model outside the kernel's limits) run the standard step and are counted by
//! `FallbackReason::kind` in `fused_fallbacks`, so the engine can report them. Tapped layers
//! (`forward_on_device` / `forward_tapped`, for DSpark) land in the same buffer slots as on the
//! standard step.
//!
//! Nothing here has run on a GPU yet (written without one); `experiments/fused/README.md` lists what is
//! untested and the device commands.

use super::{gpu, rows_cfg, GpuLayer, GpuSeqInput, GpuTransformer, MAX_GRAPH_TOKENS};
use crate::config::{Arch, ModelConfig};
use crate::ModelError;
use cudarc::driver::{
    sys, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
};
use specula_kernels::cuda::{
    co_resident_cluster_grid, co_resident_grid, launch, launch_with, required_cluster_width,
    KernelArg, LaunchOptions, FUSED_PROFILING_SOURCE,
};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Most sequences one fused step takes.
pub const FUSED_MAX_SEQUENCES: usize = 8;
/// Most new tokens per sequence one fused step takes (a verify block of 15 drafts).
pub const FUSED_MAX_TOKENS: usize = 16;
/// Most rows one fused step takes.
pub const FUSED_MAX_ROWS: usize = FUSED_MAX_SEQUENCES * FUSED_MAX_TOKENS;
/// Bytes of one weight-ring slot for chunks of `chunk_k` columns: fused_step.cu fused_stage_bytes (16
/// rows of 2 chunk_k bytes, 64 bytes of padding each) plus room for the padding of 4-tile groups (64
/// rows of chunk_k / 4 columns), so that candidate kernels with tile groups
/// (experiments/fused/candidates/) run with this host through SPECULA_FUSED_STEP_CU. The kernel uses
/// the first 16 rows' worth; measured on the H200 with the shipped kernel, the 6 KB less for staged
/// activations changed nothing (NOTES v0.12, `k_tile_groups/` runs 2 and 3: 1 x 1 1.944 and 1.939 ms).
fn stage_bytes(chunk_k: u32) -> usize {
    16 * (chunk_k as usize * 2 + 64 * 4)
}
/// Weight columns per ring chunk by default: 16 row copies of 4 KB per 66 KB chunk. Copies of 1 KB
/// (512 columns) measured ~1.9 us per chunk whatever the ring depth (NOTES v0.7): the copy count, not
/// the bytes in flight, bounded the rate.
pub const DEFAULT_CHUNK_K: u32 = 2048;
/// Ring bytes the default slot count aims at (the rest of shared memory holds activations).
const DEFAULT_RING_BYTES: usize = 136 << 10;
/// Most ring slots (fused_step.cu FUSED_MAX_RING) and fewest that make sense (double buffering).
pub const MAX_RING_STAGES: u32 = 16;
/// fused_step.cu FUSED_RED_BYTES: the GEMM reduction scratch (8 warps x 32 rows x 16 floats).
const RED_BYTES: usize = 8 * 32 * 16 * 4;
const MIN_RING_STAGES: u32 = 2;

const THREADS: u32 = 256;
/// Words (8 bytes) of fused_step.cu's `FusedLayer` and `FusedParams` (static_asserts there).
const LAYER_WORDS: usize = 12;
const PARAMS_WORDS: usize = 30;
/// fused_step.cu FUSED_PROF_SLOTS: profile counters per CTA.
pub const PROF_SLOTS: usize = 32;

const _: () = assert!(FUSED_MAX_TOKENS <= MAX_GRAPH_TOKENS);

/// Which kernels run a decode/verify step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum StepBackend {
    /// The standard step: one launch per operation (cuBLAS or skinny GEMMs, attention by launch size).
    #[default]
    Standard,
    /// One persistent kernel for the whole forward (fused_step.cu), where `supports` allows.
    LatencySpecialized,
}

impl StepBackend {
    pub fn name(self) -> &'static str {
        match self {
            StepBackend::Standard => "standard",
            StepBackend::LatencySpecialized => "latency_specialized",
        }
    }
}

impl std::str::FromStr for StepBackend {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "standard" => Ok(StepBackend::Standard),
            "latency_specialized" | "latency-specialized" | "fused" => {
                Ok(StepBackend::LatencySpecialized)
            }
            other => Err(format!(
                "unknown step backend {other:?} (standard, latency_specialized)"
            )),
        }
    }
}

/// Why a step (or a model) runs on the standard step although the fused backend is selected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FallbackReason {
    #[error("{what} = {value} is not a positive multiple of 32 (the fused GEMM tiles take K in 32-wide chunks)")]
    Alignment { what: &'static str, value: usize },
    #[error("head_dim {0}: the fused kernel needs a multiple of 32, at most 256")]
    HeadDim(usize),
    #[error("{0} query heads per KV head: the fused attention takes at most 8")]
    GroupSize(usize),
    #[error("a step without sequences")]
    Empty,
    #[error("{seqs} sequences in the step: the fused kernel takes at most {max}")]
    TooManySequences { seqs: usize, max: usize },
    #[error("{tokens} new tokens in one sequence: the fused kernel takes at most {max}")]
    TooManyTokens { tokens: usize, max: usize },
    #[error("a prompt chunk ({tokens} tokens, {num_logits} logits rows): prefill runs on the standard step")]
    PrefillChunk { tokens: usize, num_logits: usize },
    #[error("{taps} tapped layers (or a layer past 254): the fused kernel copies at most {max}")]
    TappedLayers { taps: usize, max: usize },
}

impl FallbackReason {
    /// A stable short name per variant (fallback counters, metrics labels).
    pub fn kind(&self) -> &'static str {
        match self {
            FallbackReason::Alignment { .. } => "alignment",
            FallbackReason::HeadDim(_) => "head_dim",
            FallbackReason::GroupSize(_) => "group_size",
            FallbackReason::Empty => "empty",
            FallbackReason::TooManySequences { .. } => "too_many_sequences",
            FallbackReason::TooManyTokens { .. } => "too_many_tokens",
            FallbackReason::PrefillChunk { .. } => "prefill_chunk",
            FallbackReason::TappedLayers { .. } => "tapped_layers",
        }
    }
}

/// The fallback kind of a step whose shape the fused kernel supports but whose kernel was not built:
/// the GPU is older than sm_90.
pub const DEVICE_UNSUPPORTED: &str = "device_unsupported";

/// The fallback kind of a step whose shape ran slower on the fused kernel than on the standard step
/// when both were timed (`FusedShapes::Measured`).
pub const MEASURED_SLOWER: &str = "measured_slower";

/// Which of the shapes `supports` takes run the fused kernel while the fused backend is selected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FusedShapes {
    /// Every one (parity checks, and `bench step`, which reports the kernel's own time).
    #[default]
    All,
    /// Those that measured faster fused: the first step of each shape (`FusedShapeKey`; its context
    /// bucket has a growing cache timed again each time it doubles) times both backends on its own
    /// inputs, by CUDA events over interleaved launches (graph replays where the shape has a graph),
    /// keeps the faster one for every later step of that shape and runs it once more for the step's
    /// result; a shape that lost counts its steps as `MEASURED_SLOWER` fallbacks. So selecting the
    /// backend never makes a shape slower than the standard step, as far as one measurement per
    /// context bucket can tell (NOTES v0.19, v0.20).
    Measured,
}

/// A step shape as `FusedShapes::Measured` tells them apart. Each is timed at its first step, and that
/// verdict stands for every later step of the same key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FusedShapeKey {
    /// Sequences launched, a graph bucket's padded ones included.
    pub sequences: usize,
    /// Most new tokens (rows) of one sequence.
    pub tokens: usize,
    /// Most logits rows of one sequence.
    pub logits: usize,
    pub tapped_layers: usize,
    /// `context_bucket` of the longest sequence's keys in the step. Attention's share of a step grows
    /// with the cache, and the two backends split it differently (the kernel: up to 32 key splits per
    /// (sequence, KV head), spread over every CTA; the standard step: up to 4 slices per row, or one
    /// block per (row, KV head)). So a verdict taken with a short cache holds only until the cache
    /// outgrows its bucket; each new bucket is timed again.
    pub context_bucket: usize,
}

/// The smallest `FusedShapeKey::context_bucket`: caches up to this many keys share one verdict.
pub const CONTEXT_BUCKET_MIN: usize = 512;

/// The context bucket of a step whose longest sequence has `keys` keys (cached positions plus the
/// step's new tokens): the next power of two, at least `CONTEXT_BUCKET_MIN`. A generation that grows
/// to 32K keys is timed again at most 7 times per shape.
pub fn context_bucket(keys: usize) -> usize {
    keys.max(CONTEXT_BUCKET_MIN).next_power_of_two()
}

/// Both backends' device time for one step of a shape (medians over interleaved samples).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShapeTiming {
    pub fused_ms: f64,
    pub standard_ms: f64,
}

impl ShapeTiming {
    /// Whether the fused kernel runs this shape: strictly faster, so a tie keeps the standard step.
    pub fn fused_wins(&self) -> bool {
        self.fused_ms < self.standard_ms
    }
}

/// How `FusedShapes::Measured` times a new shape (`GpuTransformer::time_both_backends`): `warmup`
/// untimed samples, then timed samples of `per_sample` back-to-back launches per backend, at least
/// `min_samples` and at most `max_samples`, stopping as soon as the medians differ by more than
/// `settle_margin` (relative). Every timing stalls the step that meets the shape: at a 4000-token
/// prompt the old fixed schedule (2 + 7 samples of 4 launches per backend) cost one request 200-500 ms
/// per new shape (NOTES v0.24), and most shapes differ by 10% or more (0.87x-2.04x there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShapeTimingPlan {
    pub warmup: usize,
    pub min_samples: usize,
    pub max_samples: usize,
    pub per_sample: usize,
    pub settle_margin: f64,
}

impl ShapeTimingPlan {
    pub const DEFAULT: ShapeTimingPlan = ShapeTimingPlan {
        warmup: 1,
        min_samples: 3,
        max_samples: 7,
        per_sample: 2,
        settle_margin: 0.10,
    };

    /// Whether the timed samples so far (one per backend per sample, in order) decide the shape: at
    /// least `min_samples` each and the medians more than `settle_margin` apart, or `max_samples`.
    pub fn settled(&self, standard_ms: &[f64], fused_ms: &[f64]) -> bool {
        let n = standard_ms.len().min(fused_ms.len());
        if n >= self.max_samples {
            return true;
        }
        if n < self.min_samples {
            return false;
        }
        let (s, f) = (median_ms(standard_ms), median_ms(fused_ms));
        (f - s).abs() > self.settle_margin * s.min(f)
    }
}

/// The median of a sample (the upper one of an even count), 0 for none.
pub fn median_ms(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// What `fused_decision` decided for the step being launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FusedDecision {
    Standard,
    Fused,
    /// `FusedShapes::Measured` and a shape not timed yet: `run` times both backends, then calls
    /// `record_shape_timing`.
    Measure(FusedShapeKey),
}

/// One sequence's part of a step, as far as backend selection cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqShape {
    pub tokens: usize,
    pub num_logits: usize,
}

/// Whether the fused kernel computes this model at all.
pub fn supports_model(c: &ModelConfig) -> Result<(), FallbackReason> {
    // Every architecture the runtime has differs only in switches the kernel implements (qkv bias, o
    // bias, q/k norm); a new variant must be looked at here.
    match c.arch {
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 => {}
    }
    for (what, value) in [
        ("hidden_size", c.hidden_size),
        ("q_dim", c.q_dim()),
        ("intermediate_size", c.intermediate_size),
    ] {
        if value == 0 || !value.is_multiple_of(32) {
            return Err(FallbackReason::Alignment { what, value });
        }
    }
    if !c.head_dim.is_multiple_of(32) || c.head_dim == 0 || c.head_dim > 256 {
        return Err(FallbackReason::HeadDim(c.head_dim));
    }
    let group = c.num_heads / c.num_kv_heads.max(1);
    if group > 8 {
        return Err(FallbackReason::GroupSize(group));
    }
    Ok(())
}

/// Whether the fused kernel takes a step of these sequences (padded sequences of a graph bucket
/// included) on this model. A sequence that asks for fewer logits rows than it has tokens is a prompt
/// chunk (decode and verify steps ask for every row).
pub fn supports(c: &ModelConfig, seqs: &[SeqShape]) -> Result<(), FallbackReason> {
    supports_model(c)?;
    if seqs.is_empty() {
        return Err(FallbackReason::Empty);
    }
    if seqs.len() > FUSED_MAX_SEQUENCES {
        return Err(FallbackReason::TooManySequences {
            seqs: seqs.len(),
            max: FUSED_MAX_SEQUENCES,
        });
    }
    for s in seqs {
        if s.num_logits < s.tokens {
            return Err(FallbackReason::PrefillChunk {
                tokens: s.tokens,
                num_logits: s.num_logits,
            });
        }
        if s.tokens > FUSED_MAX_TOKENS {
            return Err(FallbackReason::TooManyTokens {
                tokens: s.tokens,
                max: FUSED_MAX_TOKENS,
            });
        }
    }
    Ok(())
}

/// Most tapped layers one fused step copies out (one byte per slot in a 64-bit launch argument).
pub const FUSED_MAX_TAPS: usize = 8;

/// Whether the fused kernel can copy out these tapped layers (any order, repeats allowed).
pub fn supports_taps(taps: &[usize]) -> Result<(), FallbackReason> {
    if taps.len() > FUSED_MAX_TAPS || taps.iter().any(|&l| l > 254) {
        return Err(FallbackReason::TappedLayers {
            taps: taps.len(),
            max: FUSED_MAX_TAPS,
        });
    }
    Ok(())
}

/// fused_forward's `tap_layers` argument: slot s's layer in bits 8 s .. 8 s + 7 (`supports_taps` first).
fn pack_taps(taps: &[usize]) -> u64 {
    taps.iter()
        .enumerate()
        .fold(0u64, |acc, (s, &l)| acc | ((l as u64 & 0xff) << (8 * s)))
}

/// What the fused kernel does (timing variants; anything but `Full` leaves the outputs meaningless).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FusedMode {
    #[default]
    Full,
    /// Only the grid barriers (and the loop around them): their cost alone.
    BarriersOnly,
    /// Everything but the attention phase (its cost by difference).
    SkipAttention,
    /// The full step, with per-CTA cycle counters per phase, barrier wait, ring wait, epilogue and
    /// staging (`GpuTransformer::fused_profile`); the outputs are valid.
    Profile,
}

impl FusedMode {
    /// fused_step.cu's launch flags (FUSED_SKIP_WORK = 1, FUSED_SKIP_ATTENTION = 2, FUSED_PROFILE = 16).
    fn flags(self) -> i32 {
        // FUSED_WHOLE_ROW_ATTENTION = 4 is added per launch shape by encode_fused.
        match self {
            FusedMode::Full => 0,
            FusedMode::BarriersOnly => 1,
            FusedMode::SkipAttention => 2,
            FusedMode::Profile => 16,
        }
    }
}

/// Launch settings of the fused kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusedOptions {
    /// 1: `fused_forward` (up to 255 registers per thread, one CTA per SM); 2: `fused_forward_x2`
    /// (at most 128 registers, two CTAs per SM: more warps for the latency-bound phases).
    pub ctas_per_sm: u32,
    /// CTAs (None: `ctas_per_sm` per SM). Fewer is allowed (tests of the work distribution).
    pub grid: Option<u32>,
    /// Weight-ring slots per CTA (0: ~136 KB of slots, at least 2; at most `MAX_RING_STAGES`, fewer when
    /// shared memory runs out); more slots keep more weight bytes in flight ahead of the computation,
    /// fewer leave more room for on-chip activations.
    pub ring_stages: u32,
    /// Weight columns per ring chunk (0: `DEFAULT_CHUNK_K`; a multiple of 256, at most 4096).
    pub chunk_k: u32,
    /// A chunk spanning whole rows (K <= chunk_k) as one bulk copy of the tile's 16 contiguous rows
    /// instead of 16 row copies (fused_step.cu FUSED_WHOLE_TILE_COPIES). On by default: 5% faster on
    /// the H200 at 1 x 1 (NOTES v0.7), parity checked with both.
    pub whole_tile_copies: bool,
    /// Fill the ring with cp.async (LDGSTS) by all threads instead of the TMA engine (fused_step.cu
    /// FUSED_LDGSTS): an A/B against the bulk copies' measured per-SM rate. Off by default.
    pub ldgsts: bool,
    /// Launch with `CU_LAUNCH_ATTRIBUTE_COOPERATIVE` (co-residency guaranteed by the driver). Without
    /// it the grid barrier relies on the occupancy check and on nothing else running on the GPU.
    pub cooperative: bool,
    /// Steps of at most `dataflow_max_rows` rows (and `dataflow_max_queries`) run v2, the dataflow kernel (`fused_forward_v2_m8` /
    /// `_m16`: per-stage counters instead of grid barriers, norms and RoPE folded into their
    /// consumers, a dedicated producer warp; fused_step.cu "v2"); larger steps, and models v2 does not
    /// take (head_dim other than 32 or a multiple of 64 up to 256), run v1. On by default: on
    /// llama3.2-1b measured faster than v1 at 1-8 rows except 8 requests x 1 token (2.5% slower),
    /// slower at 16 rows; on qwen2.5-coder-1.5b slower than v1 at 1 request x 8 tokens (NOTES v0.14).
    /// Since then v2 has passed v1 at 8 x 1 and at 16 rows too (NOTES v0.35-v0.36).
    pub dataflow: bool,
    /// Most rows of a step v2 takes (at most `DATAFLOW_MAX_ROWS`). Default 16: on the H200 (session 32,
    /// NOTES v0.36) llama3.2-1b at 2 requests x 8 tokens took 2.04 ms on v2 against 2.55 on v1
    /// (`bench step --fused-dataflow-max-rows 16` against 8); llama3.1-8b ran v1 under both limits, since
    /// v2's shared-memory plan leaves it one ring slot at 16 rows.
    pub dataflow_max_rows: usize,
    /// Most query vectors one of v2's attention items holds, a sequence's rows x query heads per KV
    /// head; steps with a longer sequence run v1. Default 32: llama3.2-1b at 1 request x 8 tokens (32)
    /// measured faster on v2, qwen2.5-coder-1.5b at 1 x 8 (48) slower (NOTES v0.14).
    pub dataflow_max_queries: usize,
    /// v2's producer: weight part copies (32 KB) in flight per CTA from HBM, 1..=15 (0: the kernel's
    /// FV2_MAX_INFLIGHT, 1). One was the best on H100s (sessions 21-22, NOTES v0.26-v0.27); the H200 has
    /// ~1.4x the bandwidth at the same SM count, so a CTA may need more bytes in flight to reach it.
    /// The kernel holds both caps to the ring's part copies (2 x its slots, 4-6 on llama3.2-1b), since a
    /// part's barrier must not be re-armed while its copy flies.
    pub copies_in_flight: u32,
    /// v2's producer: part copies in flight whose parts it prefetched into L2, 1..=15 (0: the kernel's
    /// FV2_L2_INFLIGHT, 4).
    pub l2_copies_in_flight: u32,
    /// v2's paced L2 prefetch: cycles between two part prefetches, a multiple of
    /// `L2_PREFETCH_INTERVAL_UNIT` up to 15 of them (0: the kernel's FV2_L2_PACE_CYCLES, 3000).
    pub l2_prefetch_interval: u32,
    /// v2's paced L2 prefetch: chunks it prefetches ahead of the ring, 0..=14 (0: none; None: the
    /// kernel's FV2_L2_LEAD, 2).
    pub l2_prefetch_lead: Option<u32>,
    /// v2's paced L2 prefetch runs in steps of at most this many sequences and rows, 1..=16 (0: the
    /// kernel's FV2_L2_MAX_SEQS and FV2_L2_MAX_ROWS, 2 and 2: on H100s it lost at 4 x 1 and 2 x 8).
    pub l2_prefetch_max_rows: u32,
    pub mode: FusedMode,
}

/// fused_step.cu FUSED_L2_PACE_UNIT: the paced L2 prefetch's interval is set in units of this many cycles.
pub const L2_PREFETCH_INTERVAL_UNIT: u32 = 500;

impl FusedOptions {
    /// The launch flags of v2's producer settings (fused_step.cu FUSED_INFLIGHT_SHIFT,
    /// FUSED_L2_INFLIGHT_SHIFT, FUSED_L2_PACE_SHIFT, FUSED_L2_LEAD_SHIFT: four bits each;
    /// FUSED_L2_GATE_SHIFT: five; 0 keeping the kernel's default), or why a setting does not fit them.
    pub fn producer_flags(&self) -> Result<i32, String> {
        if self.copies_in_flight > 15 {
            return Err(format!(
                "{} weight copies in flight per CTA (at most 15; 0 keeps the kernel's default)",
                self.copies_in_flight
            ));
        }
        if self.l2_copies_in_flight > 15 {
            return Err(format!(
                "{} copies in flight from L2 per CTA (at most 15; 0 keeps the kernel's default)",
                self.l2_copies_in_flight
            ));
        }
        let unit = L2_PREFETCH_INTERVAL_UNIT;
        if !self.l2_prefetch_interval.is_multiple_of(unit) || self.l2_prefetch_interval > 15 * unit
        {
            return Err(format!(
                "an L2 prefetch interval of {} cycles (a multiple of {unit} up to {}; 0 keeps the kernel's default)",
                self.l2_prefetch_interval,
                15 * unit
            ));
        }
        let lead = match self.l2_prefetch_lead {
            None => 0,
            Some(n) if n <= 14 => n + 1,
            Some(n) => {
                return Err(format!(
                "an L2 prefetch lead of {n} chunks (at most 14; None keeps the kernel's default)"
            ))
            }
        };
        if self.l2_prefetch_max_rows > 16 {
            return Err(format!(
                "the L2 prefetch in steps of up to {} rows (at most 16; 0 keeps the kernel's default)",
                self.l2_prefetch_max_rows
            ));
        }
        Ok((self.copies_in_flight << 8
            | self.l2_copies_in_flight << 12
            | (self.l2_prefetch_interval / unit) << 16
            | lead << 20
            | self.l2_prefetch_max_rows << 24) as i32)
    }
}

/// v2's producer settings as one spec, `IN[:L2[:PACE[:LEAD[:ROWS]]]]`: `FusedOptions::copies_in_flight`,
/// `l2_copies_in_flight`, `l2_prefetch_interval`, `l2_prefetch_lead` and `l2_prefetch_max_rows`. An
/// empty or absent field keeps the kernel's default (`2::::8` sets the copies in flight and the
/// prefetch's row limit); LEAD 0 turns the paced prefetch off. For benches that compare settings
/// (`gpu_fused_check --v2-producer`) or run with one (`specula bench step --fused-producer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProducerSettings {
    pub copies_in_flight: Option<u32>,
    pub l2_copies_in_flight: Option<u32>,
    pub l2_prefetch_interval: Option<u32>,
    pub l2_prefetch_lead: Option<u32>,
    pub l2_prefetch_max_rows: Option<u32>,
}

impl ProducerSettings {
    const FIELDS: [&'static str; 5] = ["IN", "L2", "PACE", "LEAD", "ROWS"];

    /// Parses a spec, refusing what the launch flags cannot hold.
    pub fn parse(spec: &str) -> Result<ProducerSettings, String> {
        let fields: Vec<&str> = spec.split(':').collect();
        if fields.len() > Self::FIELDS.len() || fields.iter().all(|f| f.is_empty()) {
            return Err(format!(
                "producer settings {spec:?}: want IN[:L2[:PACE[:LEAD[:ROWS]]]] with at least one field set"
            ));
        }
        let num = |i: usize| -> Result<Option<u32>, String> {
            let Some(f) = fields.get(i).filter(|f| !f.is_empty()) else {
                return Ok(None);
            };
            let name = Self::FIELDS[i];
            let v: u32 = f
                .parse()
                .map_err(|_| format!("producer settings {spec:?}: {name} {f:?} is not a number"))?;
            // 0 means the kernel's default in FusedOptions; here an empty field says that.
            if v == 0 && name != "LEAD" {
                return Err(format!(
                    "producer settings {spec:?}: {name} 0 (leave the field empty for the kernel's default)"
                ));
            }
            Ok(Some(v))
        };
        let settings = ProducerSettings {
            copies_in_flight: num(0)?,
            l2_copies_in_flight: num(1)?,
            l2_prefetch_interval: num(2)?,
            l2_prefetch_lead: num(3)?,
            l2_prefetch_max_rows: num(4)?,
        };
        settings
            .apply(FusedOptions::default())
            .producer_flags()
            .map_err(|e| format!("producer settings {spec:?}: {e}"))?;
        Ok(settings)
    }

    /// `opts` with its producer fields set to these (the unset ones to the kernel's defaults).
    pub fn apply(self, opts: FusedOptions) -> FusedOptions {
        FusedOptions {
            copies_in_flight: self.copies_in_flight.unwrap_or(0),
            l2_copies_in_flight: self.l2_copies_in_flight.unwrap_or(0),
            l2_prefetch_interval: self.l2_prefetch_interval.unwrap_or(0),
            l2_prefetch_lead: self.l2_prefetch_lead,
            l2_prefetch_max_rows: self.l2_prefetch_max_rows.unwrap_or(0),
            ..opts
        }
    }

    /// The settings `opts` carries.
    pub fn of(opts: &FusedOptions) -> ProducerSettings {
        let set = |v: u32| (v != 0).then_some(v);
        ProducerSettings {
            copies_in_flight: set(opts.copies_in_flight),
            l2_copies_in_flight: set(opts.l2_copies_in_flight),
            l2_prefetch_interval: set(opts.l2_prefetch_interval),
            l2_prefetch_lead: opts.l2_prefetch_lead,
            l2_prefetch_max_rows: set(opts.l2_prefetch_max_rows),
        }
    }

    /// What is set, in words ("the kernel's defaults" when nothing is).
    pub fn describe(self) -> String {
        let set: Vec<String> = [
            self.copies_in_flight
                .map(|v| format!("{v} copies in flight")),
            self.l2_copies_in_flight.map(|v| format!("{v} from L2")),
            self.l2_prefetch_interval
                .map(|v| format!("prefetch every {v} cycles")),
            self.l2_prefetch_lead.map(|v| format!("prefetch lead {v}")),
            self.l2_prefetch_max_rows
                .map(|v| format!("prefetch up to {v} rows")),
        ]
        .into_iter()
        .flatten()
        .collect();
        if set.is_empty() {
            "the kernel's defaults".to_string()
        } else {
            set.join(", ")
        }
    }
}

impl Default for FusedOptions {
    fn default() -> Self {
        FusedOptions {
            ctas_per_sm: 1,
            grid: None,
            ring_stages: 0,
            chunk_k: 0,
            whole_tile_copies: true,
            ldgsts: false,
            cooperative: true,
            dataflow: true,
            dataflow_max_rows: 16,
            dataflow_max_queries: 32,
            copies_in_flight: 0,
            l2_copies_in_flight: 0,
            l2_prefetch_interval: 0,
            l2_prefetch_lead: None,
            l2_prefetch_max_rows: 0,
            mode: FusedMode::Full,
        }
    }
}

/// How the fused kernel was set up on this device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusedInfo {
    /// The entry point: `fused_forward` or `fused_forward_x2`.
    pub kernel: &'static str,
    pub grid: u32,
    pub threads: u32,
    pub smem_bytes: u32,
    /// CTAs of the kernel that fit on one SM (occupancy calculator).
    pub blocks_per_sm: u32,
    pub num_sms: u32,
    /// Whether the dynamic shared memory holds attention_gqa's buffer, so that launches the standard
    /// step gives whole-row attention get it in the fused kernel too.
    pub whole_row_attention: bool,
    /// Weight-ring slots per CTA, and the weight columns of one slot's chunk (16 rows).
    pub ring_stages: u32,
    pub chunk_k: u32,
    /// v2's dynamic shared memory per CTA when it is built (`FusedOptions::dataflow`), else 0.
    pub dataflow_smem_bytes: u32,
    /// v2's grid and its CTAs per thread-block cluster (1: none; 0 and 0 when v2 is not built).
    pub dataflow_grid: u32,
    pub dataflow_cluster: u32,
}

/// The compiled kernel and its device-side parameters for one `GpuTransformer`.
struct FusedStep {
    module: Arc<CudaModule>,
    /// The same program with the in-kernel profile compiled in (`FUSED_PROFILING_SOURCE`), compiled
    /// at the first `FusedMode::Profile`; its kernels run only in that mode.
    prof_module: Option<Arc<CudaModule>>,
    /// The entry point for `FusedOptions::ctas_per_sm`.
    func: CudaFunction,
    /// `FusedParams` (device addresses and sizes), read by every CTA at kernel start.
    params: CudaSlice<u64>,
    /// `FusedLayer` per layer; `params` points at it.
    _layers: CudaSlice<u64>,
    /// Grid barrier word (a 64-bit arrival counter at [0..2]); zero at allocation.
    _barrier: CudaSlice<u32>,
    /// `PROF_SLOTS` cycle counters per CTA, written by profiled launches.
    prof: CudaSlice<u64>,
    /// v2, when `FusedOptions::dataflow` is set and the model suits it.
    dataflow: Option<DataflowStep>,
    info: FusedInfo,
}

/// Most rows of a step the dataflow kernel (v2) takes: two 8-row activation blocks (fused_step.cu
/// FV2_MAX_ROWS).
pub const DATAFLOW_MAX_ROWS: usize = 16;
/// fused_step.cu FV2_SLOT_BYTES, FV2_MAX_SLOTS, FV2_ATT_KEYS, FV2_MAX_SPLITS, FV2_STAGES, FV2_CTR_WORDS.
const V2_SLOT_BYTES: usize = 16 * 2048 * 2;
const V2_MAX_SLOTS: usize = 8;
const V2_ATT_KEYS: usize = 32;
const V2_MAX_SPLITS: usize = 32;
const V2_STAGES: usize = 5;
const V2_CTR_WORDS: usize = 16;

/// v2's compiled entry points and its own buffers: stage counters, attention partials and combine
/// counters (sized for its split scheme), and a `FusedParams` image pointing at them.
struct DataflowStep {
    m8: CudaFunction,
    m16: CudaFunction,
    params: CudaSlice<u64>,
    _counters: CudaSlice<u64>,
    _partials: CudaSlice<f32>,
    _attn_counters: CudaSlice<u32>,
    /// `FusedParams::xn16` and `ss_parts` (see FusedParamsHost).
    _xn16: CudaSlice<u16>,
    _ss_parts: CudaSlice<f32>,
    /// Dynamic shared memory of every v2 launch: the per-block maximum less the static part.
    smem: usize,
    grid: u32,
    /// CTAs per thread-block cluster the entry points were compiled with (1: none).
    cluster: u32,
    /// `FusedOptions::dataflow_max_rows`, clamped to DATAFLOW_MAX_ROWS.
    max_rows: usize,
    /// `FusedOptions::dataflow_max_queries`.
    max_queries: usize,
    /// Threads per CTA: the entry points' `__launch_bounds__` (read back from the compiled kernel, so
    /// a kernel version with a dedicated producer warp gets its extra warp without a host change).
    threads: u32,
}

/// How v2 splits its dynamic shared memory for a step of `rows` rows: the scratch (GEMM reduction and
/// staged activations, or the attention buffers; fused_step.cu fv2_red_bytes, fv2_attention_item) up
/// to `ring_offset`, then `stages` ring slots of V2_SLOT_BYTES. The scratch gets what the slots leave,
/// so more activation columns are staged at once where they fit. None: fewer than two slots fit.
fn v2_plan(rows: usize, head_dim: usize, group: usize, smem: usize) -> Option<(usize, usize)> {
    if rows == 0 || rows > DATAFLOW_MAX_ROWS {
        return None;
    }
    let nt = rows.div_ceil(8);
    let red = nt * 8 * 8 * 16 * 4;
    // Two reduction buffers: an epilogue that skips its closing barrier alternates between them.
    let gemm = 2 * red + rows * (2 * 2048 + 64);
    let qv = rows * group;
    let attention = 4
        * (2 * V2_ATT_KEYS * (head_dim + 4)
            + 2 * qv * head_dim
            + (2 * qv).next_multiple_of(4)
            + 2 * rows * head_dim
            + V2_ATT_KEYS);
    let scratch = gemm.max(attention).next_multiple_of(128);
    let stages = (smem.checked_sub(scratch)? / V2_SLOT_BYTES).min(V2_MAX_SLOTS);
    if stages < 2 {
        return None;
    }
    let ring_offset = (smem - stages * V2_SLOT_BYTES) / 128 * 128;
    Some((ring_offset, stages))
}

/// Whether a step of `rows` rows whose longest sequence has `seq_rows` rows, on a model with `group`
/// query heads per KV head, runs v2 under the limits `FusedOptions::dataflow_max_rows` and
/// `dataflow_max_queries` (v2_plan must also find room for it).
fn v2_takes(
    rows: usize,
    seq_rows: usize,
    group: usize,
    max_rows: usize,
    max_queries: usize,
) -> bool {
    rows <= max_rows && seq_rows.saturating_mul(group) <= max_queries
}

/// The packed `layout` argument of fused_forward_v2: ring offset in bits 0-23, slots in 24-31.
fn v2_layout(plan: (usize, usize)) -> i32 {
    (plan.0 as u32 | ((plan.1 as u32) << 24)) as i32
}

/// Per-CTA cycle counters of a profiled fused step (fused_step.cu FUSED_PROFILE).
#[derive(Debug, Clone)]
pub struct FusedProfile {
    /// Whether v2 (the dataflow kernel) wrote it: its slots mean other things (`SLOTS_V2`).
    pub dataflow: bool,
    pub per_cta: Vec<[u64; PROF_SLOTS]>,
    /// The SM clock the cycles count (the device's nominal rate, kHz).
    pub clock_khz: f64,
}

impl FusedProfile {
    /// Slot names, in slot order (the rest are unused).
    pub const SLOTS: [&'static str; 24] = [
        "A attn norm",
        "B QKV",
        "C RoPE + KV",
        "D attention",
        "E O proj",
        "F ffn norm",
        "G gate/up",
        "H down",
        "Z1 final norm",
        "Z2 LM head",
        "barrier after A",
        "barrier after B",
        "barrier after C",
        "barrier after D",
        "barrier after E",
        "barrier after F",
        "barrier after G",
        "barrier after H",
        "barrier after Z1",
        "(unused)",
        "ring chunk waits (in B E G H Z2)",
        "tile epilogues (in B E G H Z2)",
        "activation staging (in B E G H Z2)",
        "whole kernel",
    ];

    /// v2's slots (fused_step.cu fv2_forward_body): work per stage, the counter wait before a CTA's
    /// first item of a stage, and the same ring / epilogue / staging / kernel totals as v1.
    pub const SLOTS_V2: [&'static str; 24] = [
        "MMA loops (in Q O G D head)",
        "Q QKV (attention norm in the staging)",
        "A: head vectors (bias, norms, RoPE, KV append)",
        "A attention (RoPE, KV append, combine)",
        "O O proj",
        "A: keys and online softmax",
        "G gate/up (FFN norm in the staging)",
        "D down",
        "A: partials and split counter",
        "LM head (final norm in the staging)",
        "A: combine (last split)",
        "wait before Q (D of the layer before)",
        "norm stages' staging (in the staging below)",
        "wait before A's first item (Q)",
        "wait before O (A)",
        "",
        "wait before G (O)",
        "wait before D (G)",
        "",
        "wait before the LM head (last D)",
        "ring chunk waits (in Q O G D head)",
        "tile epilogues (in Q O G D head)",
        "activation staging with norms (in Q O G D head)",
        "whole kernel",
    ];

    /// (name, mean over CTAs, max over CTAs) in microseconds, for each used slot.
    pub fn summary(&self) -> Vec<(&'static str, f64, f64)> {
        let n = self.per_cta.len().max(1) as f64;
        let us = |c: u64| c as f64 / self.clock_khz * 1e3;
        let names = if self.dataflow {
            &Self::SLOTS_V2
        } else {
            &Self::SLOTS
        };
        names
            .iter()
            .enumerate()
            .filter(|(i, name)| !name.is_empty() && (*i != 19 || self.dataflow))
            .map(|(i, &name)| {
                let sum: u64 = self.per_cta.iter().map(|c| c[i]).sum();
                let max = self.per_cta.iter().map(|c| c[i]).max().unwrap_or(0);
                (name, us(sum) / n, us(max))
            })
            .collect()
    }
}

/// The backend selection and the fused kernel's state inside a `GpuTransformer`.
#[derive(Default)]
pub struct FusedState {
    backend: StepBackend,
    opts: FusedOptions,
    step: Option<FusedStep>,
    /// Set by `run` for the step being launched (and captured).
    this_step: bool,
    fused_steps: u64,
    fallbacks: BTreeMap<&'static str, u64>,
    /// Why the most recent step ran standard with the fused backend selected (None: it ran fused,
    /// or the standard backend is selected).
    last_fallback: Option<&'static str>,
    /// The most rows of one sequence in the step being launched (v1 or v2 depends on it).
    step_seq_rows: usize,
    /// `context_bucket` of the step being launched (or the last one launched).
    step_context_bucket: usize,
    shapes: FusedShapes,
    /// `FusedShapes::Measured`'s timings, per shape (dropped when the kernel's options change).
    timings: BTreeMap<FusedShapeKey, ShapeTiming>,
    /// Another fused_step.cu's text in place of this build's (`set_fused_variant`), or None.
    variant: Option<FusedVariant>,
}

/// A fused_step.cu text that replaces this build's fused kernel (`GpuTransformer::set_fused_variant`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct FusedVariant {
    label: String,
    text: Arc<str>,
}

impl FusedState {
    /// Whether the step `run` is launching now goes through the fused kernel.
    pub(super) fn runs_this_step(&self) -> bool {
        self.this_step
    }

    /// Which backend the next `encode` launches (while `run` times both for `FusedShapes::Measured`).
    pub(super) fn set_this_step(&mut self, fused: bool) {
        self.this_step = fused;
    }

    /// Whether a measured shape runs the fused kernel: None when it was not timed (or the policy is
    /// `All`, where every supported shape does).
    fn measured_verdict(&self, key: &FusedShapeKey) -> Option<bool> {
        match self.shapes {
            FusedShapes::All => None,
            FusedShapes::Measured => self.timings.get(key).map(ShapeTiming::fused_wins),
        }
    }
}

/// Host image of fused_step.cu's `FusedParams`: 22 device addresses, then 14 ints and 2 floats of 4
/// bytes, packed two per word (little-endian: the first in the low half), in the struct's order.
#[derive(Debug, Clone, Default, PartialEq)]
struct FusedParamsHost {
    layers: u64,
    embed: u64,
    final_norm: u64,
    lm_head: u64,
    inv_freq: u64,
    tokens: u64,
    positions: u64,
    slots: u64,
    row_table: u64,
    logit_rows: u64,
    block_tables: u64,
    x: u64,
    act16: u64,
    qkv: u64,
    ffn_act16: u64,
    logits: u64,
    attn_partials: u64,
    attn_counters: u64,
    barrier: u64,
    prof: u64,
    /// v2 only: a norm stage's rows as bf16(norm weight * x), [DATAFLOW_MAX_ROWS, hidden], and their
    /// sums of squares per 16-column tile, [DATAFLOW_MAX_ROWS, hidden / 16], for kernels whose residual
    /// writers hand them over (experiments/fused/candidates/xnorm.patch; the shipped kernel ignores both).
    xn16: u64,
    ss_parts: u64,
    n_layers: i32,
    hidden: i32,
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
    ffn: i32,
    vocab: i32,
    max_blocks: i32,
    block_size: i32,
    ring_stages: i32,
    ring_offset: i32,
    xs_bytes: i32,
    chunk_k: i32,
    /// Rows the step buffers hold (GpuOptions::max_rows): attention_partials has 4 key slices per
    /// (row, KV head) of that many rows. Unused by the shipped kernel; candidates that split
    /// attention finer size their slices by it (experiments/fused/candidates/).
    max_rows: i32,
    eps: f32,
    scale: f32,
}

impl FusedParamsHost {
    fn words(&self) -> Vec<u64> {
        let mut w = vec![
            self.layers,
            self.embed,
            self.final_norm,
            self.lm_head,
            self.inv_freq,
            self.tokens,
            self.positions,
            self.slots,
            self.row_table,
            self.logit_rows,
            self.block_tables,
            self.x,
            self.act16,
            self.qkv,
            self.ffn_act16,
            self.logits,
            self.attn_partials,
            self.attn_counters,
            self.barrier,
            self.prof,
            self.xn16,
            self.ss_parts,
        ];
        let small: [u32; 16] = [
            self.n_layers as u32,
            self.hidden as u32,
            self.n_heads as u32,
            self.n_kv_heads as u32,
            self.head_dim as u32,
            self.ffn as u32,
            self.vocab as u32,
            self.max_blocks as u32,
            self.block_size as u32,
            self.ring_stages as u32,
            self.ring_offset as u32,
            self.xs_bytes as u32,
            self.chunk_k as u32,
            self.max_rows as u32,
            self.eps.to_bits(),
            self.scale.to_bits(),
        ];
        w.extend(
            small
                .chunks(2)
                .map(|p| u64::from(p[0]) | (u64::from(p[1]) << 32)),
        );
        w
    }
}

/// The entry point compiled for `ctas_per_sm` CTAs per SM (its register budget).
fn kernel_for(ctas_per_sm: u32) -> Result<&'static str, ModelError> {
    match ctas_per_sm {
        1 => Ok("fused_forward"),
        2 => Ok("fused_forward_x2"),
        n => Err(ModelError::InvalidRequest(format!(
            "fused step: {n} CTAs per SM (the kernel is compiled for 1 or 2)"
        ))),
    }
}

fn addr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    // Event tracking is off in GpuDevice, so taking the address records nothing.
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// fused_step.cu's `FusedLayer`, in its field order (0 for absent tensors).
fn layer_words(l: &GpuLayer, s: &CudaStream) -> [u64; LAYER_WORDS] {
    let opt = |v: &Option<CudaSlice<f32>>| v.as_ref().map_or(0, |v| addr(v, s));
    [
        addr(&l.attn_norm, s),
        addr(&l.wqkv, s),
        opt(&l.bqkv),
        opt(&l.q_norm),
        opt(&l.k_norm),
        addr(&l.wo, s),
        opt(&l.bo),
        addr(&l.ffn_norm, s),
        addr(&l.w_gate_up, s),
        addr(&l.w_down, s),
        addr(&l.k_cache, s),
        addr(&l.v_cache, s),
    ]
}

/// How a CTA's dynamic shared memory is split: GEMM reduction | activations or attention scratch |
/// weight ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SmemPlan {
    chunk_k: u32,
    stages: u32,
    ring_offset: usize,
    xs_bytes: usize,
    whole_row: bool,
    smem: usize,
}

/// The shared-memory plan for a CTA with `budget` bytes (`static_smem` of them static): the ring gets
/// `opts.ring_stages` slots (0: ~DEFAULT_RING_BYTES of them, at least 2) of `opts.chunk_k` columns
/// (0: DEFAULT_CHUNK_K, halved down to 256 while fewer than 2 slots fit, e.g. at two CTAs per SM); the
/// middle region everything else, at least the attention scratch (`whole_row`: attention_gqa's buffer,
/// dropped for split-key attention when it crowds the ring out).
fn plan_smem(
    budget: usize,
    static_smem: usize,
    attention_split: usize,
    whole_row: Option<usize>,
    opts: &FusedOptions,
) -> Result<SmemPlan, String> {
    let chunks: Vec<u32> = if opts.chunk_k == 0 {
        vec![DEFAULT_CHUNK_K, 1024, 512, 256]
    } else {
        if !opts.chunk_k.is_multiple_of(256) || opts.chunk_k > 4096 {
            return Err(format!(
                "{} columns per ring chunk (a multiple of 256, at most 4096)",
                opts.chunk_k
            ));
        }
        vec![opts.chunk_k]
    };
    let room = budget.saturating_sub(static_smem + RED_BYTES);
    for &chunk_k in &chunks {
        let stage = stage_bytes(chunk_k);
        let cap = if opts.ring_stages == 0 {
            ((DEFAULT_RING_BYTES / stage) as u32).clamp(MIN_RING_STAGES, MAX_RING_STAGES)
        } else {
            opts.ring_stages.min(MAX_RING_STAGES)
        };
        for whole in [whole_row, None] {
            let attn = attention_split.max(whole.unwrap_or(0));
            let stages = ((room.saturating_sub(attn) / stage) as u32).min(cap);
            if stages < MIN_RING_STAGES {
                continue;
            }
            let xs_bytes = (room.saturating_sub(stages as usize * stage) / 128) * 128;
            let ring_offset = RED_BYTES + xs_bytes;
            return Ok(SmemPlan {
                chunk_k,
                stages,
                ring_offset,
                xs_bytes,
                whole_row: whole.is_some(),
                smem: ring_offset + stages as usize * stage,
            });
        }
    }
    Err(format!(
        "{budget} bytes of shared memory per CTA ({static_smem} static) do not hold {MIN_RING_STAGES} weight-ring slots of {} columns beside {RED_BYTES} bytes of reduction and {attention_split} of attention scratch",
        chunks.last().copied().unwrap_or(256)
    ))
}

impl FusedStep {
    /// Compiles fused_step.cu (NVRTC, seconds) and sets the kernel up for `t` with `opts`.
    fn build(t: &GpuTransformer, opts: &FusedOptions) -> Result<FusedStep, ModelError> {
        if !t.paired_gate_up {
            return Err(ModelError::Gpu(
                "the fused step needs the gate/up rows paired (intermediate_size % 8 == 0)".into(),
            ));
        }
        let module = t.fused_module(false)?;
        let prof_module = match opts.mode {
            FusedMode::Profile => Some(t.fused_module(true)?),
            _ => None,
        };
        Self::configure(t, opts, module, prof_module)
    }

    /// The launch shape and the device-side parameters for `opts`, on an already compiled kernel
    /// (`prof_module`'s in `FusedMode::Profile`, which needs it).
    fn configure(
        t: &GpuTransformer,
        opts: &FusedOptions,
        module: Arc<CudaModule>,
        prof_module: Option<Arc<CudaModule>>,
    ) -> Result<FusedStep, ModelError> {
        let c = &t.config;
        let s = t.device.stream.clone();
        let kernel = kernel_for(opts.ctas_per_sm)?;
        let active = match (opts.mode, &prof_module) {
            (FusedMode::Profile, Some(m)) => m.clone(),
            (FusedMode::Profile, None) => {
                return Err(ModelError::Gpu(
                    "fused step: FusedMode::Profile needs the profiling build of the kernel".into(),
                ))
            }
            _ => module.clone(),
        };
        let func = active.load_function(kernel).map_err(gpu)?;
        let static_smem = func.shared_size_bytes().map_err(gpu)? as usize;
        let attribute = |a| t.device.ctx.attribute(a).map(|v| v as usize).map_err(gpu);
        let smem_limit = attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )?;
        // attention_gqa's buffer (context-sized) where the standard step can use whole-row attention
        // and it fits beside the kernel's static shared memory; otherwise the fused step always runs
        // split-key attention (then it differs from the standard step for whole-row launch shapes).
        let whole_row =
            t.whole_row_attention_available() && t.attention_smem + static_smem <= smem_limit;
        // Shared memory per CTA: the per-block limit, and the SM's share when several CTAs share one.
        let per_sm = attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        )?;
        // 1 KB per CTA is reserved by the system on sm_90.
        let budget = smem_limit.min(per_sm / opts.ctas_per_sm as usize - 1024);
        // Layout: GEMM reduction | activations or attention scratch | weight ring (plan_smem).
        let plan = plan_smem(
            budget,
            static_smem,
            t.attention_split_smem,
            whole_row.then_some(t.attention_smem),
            opts,
        )
        .map_err(|e| ModelError::Gpu(format!("fused step: {e}")))?;
        let SmemPlan {
            chunk_k,
            stages,
            ring_offset,
            xs_bytes,
            whole_row,
            smem,
        } = plan;
        func.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(gpu)?;
        let num_sms = t.num_sms as u32;
        let blocks_per_sm = func
            .occupancy_max_active_blocks_per_multiprocessor(THREADS, smem, None)
            .map_err(gpu)?;
        let requested = Some(opts.grid.unwrap_or(opts.ctas_per_sm * num_sms));
        let grid = co_resident_grid(&func, requested, num_sms, THREADS, smem).map_err(|e| {
            ModelError::Gpu(format!(
                "fused step: the grid does not fit on the device at once: {e}"
            ))
        })?;
        let words: Vec<u64> = t.layers.iter().flat_map(|l| layer_words(l, &s)).collect();
        let layers = s.clone_htod(&words).map_err(gpu)?;
        let barrier = s.alloc_zeros::<u32>(64).map_err(gpu)?;
        let prof = s
            .alloc_zeros::<u64>(grid.max(num_sms) as usize * PROF_SLOTS)
            .map_err(gpu)?;
        let lay = t.layout;
        let inputs = addr(&t.buf.inputs, &s);
        let at = |offset: usize| inputs + 4 * offset as u64;
        let p = FusedParamsHost {
            layers: addr(&layers, &s),
            embed: addr(&t.embed, &s),
            final_norm: addr(&t.final_norm, &s),
            lm_head: addr(t.lm_head.as_ref().unwrap_or(&t.embed), &s),
            inv_freq: addr(&t.inv_freq, &s),
            tokens: at(lay.tokens),
            positions: at(lay.positions),
            slots: at(lay.slots),
            row_table: at(lay.row_table),
            logit_rows: at(lay.logit_rows),
            block_tables: at(lay.block_tables),
            x: addr(&t.buf.x, &s),
            act16: addr(&t.buf.act16, &s),
            qkv: addr(&t.buf.qkv, &s),
            ffn_act16: addr(&t.buf.ffn_act16, &s),
            logits: addr(&t.buf.logits, &s),
            attn_partials: addr(&t.buf.attn_partials, &s),
            attn_counters: addr(&t.buf.attn_counters, &s),
            barrier: addr(&barrier, &s),
            prof: addr(&prof, &s),
            // v1 does not read them; v2 points them at its own buffers (DataflowStep::configure).
            xn16: 0,
            ss_parts: 0,
            n_layers: c.num_layers as i32,
            hidden: c.hidden_size as i32,
            n_heads: c.num_heads as i32,
            n_kv_heads: c.num_kv_heads as i32,
            head_dim: c.head_dim as i32,
            ffn: c.intermediate_size as i32,
            vocab: c.vocab_size as i32,
            max_blocks: t.max_blocks as i32,
            block_size: super::GPU_BLOCK_SIZE as i32,
            ring_stages: stages as i32,
            ring_offset: ring_offset as i32,
            xs_bytes: xs_bytes as i32,
            chunk_k: chunk_k as i32,
            max_rows: t.opts.max_rows as i32,
            eps: c.rms_norm_eps,
            // The same expression as the standard step's attention scale (bit-identical).
            scale: 1.0 / (c.head_dim as f32).sqrt(),
        };
        let words = p.words();
        debug_assert_eq!(words.len(), PARAMS_WORDS);
        let params = s.clone_htod(&words).map_err(gpu)?;
        // v2 (the dataflow kernel): a head vector is hd / 32 values per lane (at most 8), its RoPE
        // pairs in one lane (hd % 64 == 0) or in lanes d and d + 16 (hd == 32).
        let v2_head_dim = c.head_dim == 32 || (c.head_dim.is_multiple_of(64) && c.head_dim <= 256);
        let dataflow = if opts.dataflow && v2_head_dim {
            Some(DataflowStep::configure(
                t,
                opts,
                &active,
                &p,
                smem_limit.min(per_sm - 1024),
            )?)
        } else {
            None
        };
        s.synchronize().map_err(gpu)?;
        Ok(FusedStep {
            module,
            prof_module,
            func,
            params,
            _layers: layers,
            _barrier: barrier,
            prof,
            info: FusedInfo {
                dataflow_smem_bytes: dataflow.as_ref().map_or(0, |d| d.smem as u32),
                dataflow_grid: dataflow.as_ref().map_or(0, |d| d.grid),
                dataflow_cluster: dataflow.as_ref().map_or(0, |d| d.cluster),
                kernel,
                grid,
                threads: THREADS,
                smem_bytes: smem as u32,
                blocks_per_sm,
                num_sms,
                whole_row_attention: whole_row,
                ring_stages: stages,
                chunk_k,
            },
            dataflow,
        })
    }
}

impl DataflowStep {
    /// v2's entry points and buffers; `v1` is v1's parameter image (the same model buffers), `budget`
    /// the shared memory a CTA may have.
    fn configure(
        t: &GpuTransformer,
        opts: &FusedOptions,
        module: &Arc<CudaModule>,
        v1: &FusedParamsHost,
        budget: usize,
    ) -> Result<DataflowStep, ModelError> {
        let c = &t.config;
        let s = t.device.stream.clone();
        let m8 = module.load_function("fused_forward_v2_m8").map_err(gpu)?;
        let m16 = module.load_function("fused_forward_v2_m16").map_err(gpu)?;
        let static_smem = m8
            .shared_size_bytes()
            .map_err(gpu)?
            .max(m16.shared_size_bytes().map_err(gpu)?) as usize;
        let smem = budget.saturating_sub(static_smem);
        let group = c.num_heads / c.num_kv_heads.max(1);
        if v2_plan(1, c.head_dim, group, smem).is_none() {
            return Err(ModelError::Gpu(format!(
                "fused step v2: {smem} bytes of shared memory per CTA do not hold the scratch of one row and two ring slots"
            )));
        }
        for f in [&m8, &m16] {
            f.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(gpu)?;
        }
        let num_sms = t.num_sms as u32;
        let threads = m8.max_threads_per_block().map_err(gpu)?;
        if threads != m16.max_threads_per_block().map_err(gpu)? || threads < THREADS as i32 {
            return Err(ModelError::Gpu(format!(
                "fused step v2: the entry points' thread counts differ or are below {THREADS}"
            )));
        }
        let threads = threads as u32;
        // A kernel version compiled with thread-block clusters (`__cluster_dims__`, a candidate that
        // shares work within a cluster) is launched with them: whole clusters that are resident at once,
        // and not cooperatively (the kernel needs the co-residency, which this check gives, not the
        // cooperative API). The shipped kernel has none.
        let cluster = required_cluster_width(&m8).map_err(gpu)?;
        if cluster != required_cluster_width(&m16).map_err(gpu)? {
            return Err(ModelError::Gpu(
                "fused step v2: the entry points' cluster widths differ".into(),
            ));
        }
        // One CTA per SM (or the requested grid); both entry points must fit at once.
        let requested = Some(opts.grid.unwrap_or(num_sms));
        let mut grid = u32::MAX;
        for f in [&m8, &m16] {
            let fits = if cluster > 1 {
                co_resident_cluster_grid(f, &s, requested, num_sms, threads, smem, cluster)
            } else {
                co_resident_grid(f, requested, num_sms, threads, smem)
            };
            grid = grid.min(fits.map_err(|e| {
                ModelError::Gpu(format!(
                    "fused step v2: the grid does not fit on the device at once: {e}"
                ))
            })?);
        }
        let counters = s
            .alloc_zeros::<u64>((1 + c.num_layers * V2_STAGES) * V2_CTR_WORDS)
            .map_err(gpu)?;
        let partials = s
            .alloc_zeros::<f32>(DATAFLOW_MAX_ROWS * c.num_heads * V2_MAX_SPLITS * (c.head_dim + 2))
            .map_err(gpu)?;
        let attn_counters = s
            .alloc_zeros::<u32>(DATAFLOW_MAX_ROWS * c.num_kv_heads)
            .map_err(gpu)?;
        let xn16 = s
            .alloc_zeros::<u16>(DATAFLOW_MAX_ROWS * c.hidden_size)
            .map_err(gpu)?;
        let ss_parts = s
            .alloc_zeros::<f32>(DATAFLOW_MAX_ROWS * c.hidden_size.div_ceil(16))
            .map_err(gpu)?;
        let p = FusedParamsHost {
            attn_partials: addr(&partials, &s),
            attn_counters: addr(&attn_counters, &s),
            barrier: addr(&counters, &s),
            xn16: addr(&xn16, &s),
            ss_parts: addr(&ss_parts, &s),
            // Unused by v2 (its layout is a launch argument, v2_plan).
            ring_stages: 0,
            ring_offset: 0,
            xs_bytes: 0,
            chunk_k: 2048,
            ..v1.clone()
        };
        let params = s.clone_htod(&p.words()).map_err(gpu)?;
        Ok(DataflowStep {
            m8,
            m16,
            params,
            _counters: counters,
            _partials: partials,
            _attn_counters: attn_counters,
            _xn16: xn16,
            _ss_parts: ss_parts,
            smem,
            grid,
            cluster,
            max_rows: opts.dataflow_max_rows.min(DATAFLOW_MAX_ROWS),
            max_queries: opts.dataflow_max_queries,
            threads,
        })
    }

    /// The entry point, grid and packed layout for a step of `rows` rows whose longest sequence has
    /// `seq_rows` of them, if v2 takes it.
    fn launch_for(
        &self,
        rows: usize,
        seq_rows: usize,
        c: &ModelConfig,
    ) -> Option<(&CudaFunction, i32)> {
        let group = c.num_heads / c.num_kv_heads.max(1);
        if !v2_takes(rows, seq_rows, group, self.max_rows, self.max_queries) {
            return None;
        }
        let plan = v2_plan(rows, c.head_dim, group, self.smem)?;
        let f = if rows <= 8 { &self.m8 } else { &self.m16 };
        Some((f, v2_layout(plan)))
    }
}

impl GpuTransformer {
    /// Selects the step backend. `LatencySpecialized` compiles the fused kernel the first time and
    /// checks that its grid fits on the device at once (an error if not); on a model the kernel does
    /// not support it is still selected, and every step falls back (counted in `fused_fallbacks`).
    pub fn set_step_backend(&mut self, backend: StepBackend) -> Result<(), ModelError> {
        // The kernel's weight ring needs sm_90 (bulk copies, transaction-count mbarriers); on an older
        // GPU the backend stays selected and every step falls back as `device_unsupported`.
        if backend == StepBackend::LatencySpecialized
            && self.fused.step.is_none()
            && self.device.pdl_capable
            && supports_model(&self.config).is_ok()
        {
            let step = FusedStep::build(self, &self.fused.opts)?;
            self.fused.step = Some(step);
        }
        self.fused.backend = backend;
        Ok(())
    }

    pub fn step_backend(&self) -> StepBackend {
        self.fused.backend
    }

    /// Changes the fused kernel's launch settings and drops its captured graphs. No recompilation,
    /// except that the first `FusedMode::Profile` compiles the kernel's profiling build (seconds).
    pub fn set_fused_options(&mut self, opts: FusedOptions) -> Result<(), ModelError> {
        opts.producer_flags().map_err(ModelError::Config)?;
        // Fused graphs point at the old parameters (freed in stream order below).
        self.graphs.retain(|key, _| !key.4);
        if let Some(old) = self.fused.step.take() {
            let prof_module = match (&old.prof_module, opts.mode) {
                (None, FusedMode::Profile) => match self.fused_module(true) {
                    Ok(m) => Some(m),
                    Err(e) => {
                        self.fused.step = Some(old);
                        return Err(e);
                    }
                },
                (m, _) => m.clone(),
            };
            let configured = FusedStep::configure(self, &opts, old.module.clone(), prof_module);
            match configured {
                Ok(step) => self.fused.step = Some(step),
                Err(e) => {
                    self.fused.step = Some(old);
                    return Err(e);
                }
            }
        }
        self.fused.opts = opts;
        // Timed with the old kernel.
        self.fused.timings.clear();
        Ok(())
    }

    /// The fused program (`profiling`: its FUSED_PROFILING 1 build) with the selected variant's
    /// fused_step.cu, or this build's (which SPECULA_FUSED_STEP_CU may replace for the process).
    fn fused_module(&self, profiling: bool) -> Result<Arc<CudaModule>, ModelError> {
        match &self.fused.variant {
            None => self.device.load_source(if profiling {
                FUSED_PROFILING_SOURCE
            } else {
                "fused_step.cu"
            }),
            Some(v) => self.device.load_fused_variant(&v.text, &v.label, profiling),
        }
        .map_err(gpu)
    }

    /// Runs the fused kernel from another fused_step.cu's text (`label` names it in compile errors),
    /// or this build's again with None: for A/Bs of kernel versions in one process, each shape timed
    /// with every version in turn. The text must fit this build's host side (the same parameters and
    /// entry points). Each text is compiled and loaded once (seconds); switching drops the fused
    /// graphs and shape timings, as `set_fused_options` does. On a compile error nothing changes.
    pub fn set_fused_variant(&mut self, variant: Option<(&str, &str)>) -> Result<(), ModelError> {
        let new = variant.map(|(label, text)| FusedVariant {
            label: label.to_string(),
            text: Arc::from(text),
        });
        if new == self.fused.variant {
            return Ok(());
        }
        let old_variant = std::mem::replace(&mut self.fused.variant, new);
        if let Some(old) = self.fused.step.take() {
            let built = self.fused_module(false).and_then(|module| {
                let prof_module = match self.fused.opts.mode {
                    FusedMode::Profile => Some(self.fused_module(true)?),
                    _ => None,
                };
                FusedStep::configure(self, &self.fused.opts, module, prof_module)
            });
            match built {
                Ok(step) => self.fused.step = Some(step),
                Err(e) => {
                    self.fused.step = Some(old);
                    self.fused.variant = old_variant;
                    return Err(e);
                }
            }
            // Fused graphs point at the old kernel's parameters.
            self.graphs.retain(|key, _| !key.4);
        }
        self.fused.timings.clear();
        Ok(())
    }

    /// The label of the fused-kernel variant in use (`set_fused_variant`), None for this build's.
    pub fn fused_variant(&self) -> Option<&str> {
        self.fused.variant.as_ref().map(|v| v.label.as_str())
    }

    /// Which supported shapes run the fused kernel (default `FusedShapes::All`). Switching to
    /// `Measured` keeps the timings taken so far.
    pub fn set_fused_shapes(&mut self, shapes: FusedShapes) {
        self.fused.shapes = shapes;
    }

    pub fn fused_shapes(&self) -> FusedShapes {
        self.fused.shapes
    }

    /// `FusedShapes::Measured`'s timings so far, per shape.
    pub fn fused_shape_timings(&self) -> &BTreeMap<FusedShapeKey, ShapeTiming> {
        &self.fused.timings
    }

    pub fn fused_options(&self) -> FusedOptions {
        self.fused.opts
    }

    /// The fused kernel's launch shape, once built.
    pub fn fused_info(&self) -> Option<FusedInfo> {
        self.fused.step.as_ref().map(|s| s.info)
    }

    /// Which fused kernel a step of `rows` rows whose longest sequence has `seq_rows` rows launches:
    /// "v2" (the dataflow kernel, with `FusedOptions::dataflow`) or "v1"; None before the backend is
    /// built.
    pub fn fused_kernel_for(&self, rows: usize, seq_rows: usize) -> Option<&'static str> {
        let step = self.fused.step.as_ref()?;
        let v2 = step
            .dataflow
            .as_ref()
            .is_some_and(|d| d.launch_for(rows, seq_rows, &self.config).is_some());
        Some(if v2 { "v2" } else { "v1" })
    }

    /// Whether the most recent step ran the fused kernel.
    pub fn last_step_fused(&self) -> bool {
        self.fused.this_step
    }

    /// Why the most recent step ran the standard step although the fused backend is selected (a
    /// `FallbackReason::kind`); None when it ran fused or the standard backend is selected.
    pub fn last_step_fallback(&self) -> Option<&'static str> {
        self.fused.last_fallback
    }

    /// The counters of the last `FusedMode::Profile` launch, a step of `rows` rows with at most
    /// `seq_rows` per sequence (which says which kernel wrote them; synchronises the stream).
    pub fn fused_profile(
        &self,
        rows: usize,
        seq_rows: usize,
    ) -> Result<Option<FusedProfile>, ModelError> {
        let Some(step) = self.fused.step.as_ref() else {
            return Ok(None);
        };
        let s = &self.device.stream;
        let raw = s.clone_dtoh(&step.prof).map_err(gpu)?;
        let clock_khz = self
            .device
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
            .map_err(gpu)? as f64;
        let dataflow = self.fused_kernel_for(rows, seq_rows) == Some("v2");
        // The CTAs of the kernel that ran (the buffer is sized for v1's grid, at least v2's).
        let ctas = match (&step.dataflow, dataflow) {
            (Some(d), true) => d.grid,
            _ => step.info.grid,
        } as usize;
        Ok(Some(FusedProfile {
            dataflow,
            per_cta: raw
                .chunks(PROF_SLOTS)
                .take(ctas)
                .map(|c| c.try_into().expect("PROF_SLOTS per chunk"))
                .collect(),
            clock_khz,
        }))
    }

    /// Steps that ran the fused kernel.
    pub fn fused_steps(&self) -> u64 {
        self.fused.fused_steps
    }

    /// Steps that fell back to the standard step with the fused backend selected, by reason kind.
    pub fn fused_fallbacks(&self) -> &BTreeMap<&'static str, u64> {
        &self.fused.fallbacks
    }

    /// `supports` for this model.
    pub fn fused_supports(&self, seqs: &[SeqShape]) -> Result<(), FallbackReason> {
        supports(&self.config, seqs)
    }

    /// Decides (and records) whether this step runs fused; `batch` counts the padded sequences of a
    /// graph bucket, which run the same shape as the real ones; `keys` those of the longest sequence
    /// after the step (cached positions plus new tokens). Counts the fallback reason when the
    /// fused backend is selected and the step cannot take it (or, with `FusedShapes::Measured`, its
    /// shape measured slower fused). `Measure` records nothing yet: `record_shape_timing` does.
    pub(super) fn fused_decision(
        &mut self,
        inputs: &[GpuSeqInput<'_>],
        batch: usize,
        keys: usize,
    ) -> FusedDecision {
        let taps = self.step_taps.len();
        let st = &mut self.fused;
        st.this_step = false;
        st.last_fallback = None;
        if st.backend != StepBackend::LatencySpecialized {
            return FusedDecision::Standard;
        }
        let mut shapes: Vec<SeqShape> = inputs
            .iter()
            .map(|i| SeqShape {
                tokens: i.tokens.len(),
                num_logits: i.num_logits,
            })
            .collect();
        if let Some(&first) = shapes.first() {
            // Padding only happens for graph shapes, whose sequences are all alike.
            shapes.resize(batch.max(shapes.len()), first);
        }
        st.step_seq_rows = shapes.iter().map(|s| s.tokens).max().unwrap_or(0);
        st.step_context_bucket = context_bucket(keys);
        let fallback =
            match supports(&self.config, &shapes).and_then(|()| supports_taps(&self.step_taps)) {
                // set_step_backend builds the kernel for every supported model on sm_90+.
                Ok(()) if st.step.is_none() => DEVICE_UNSUPPORTED,
                Ok(()) => {
                    let key = FusedShapeKey {
                        sequences: shapes.len(),
                        tokens: st.step_seq_rows,
                        logits: shapes.iter().map(|s| s.num_logits).max().unwrap_or(0),
                        tapped_layers: taps,
                        context_bucket: st.step_context_bucket,
                    };
                    match (st.shapes, st.measured_verdict(&key)) {
                        (FusedShapes::Measured, None) => return FusedDecision::Measure(key),
                        (_, Some(false)) => MEASURED_SLOWER,
                        _ => {
                            st.this_step = true;
                            st.fused_steps += 1;
                            return FusedDecision::Fused;
                        }
                    }
                }
                Err(reason) => reason.kind(),
            };
        *st.fallbacks.entry(fallback).or_insert(0) += 1;
        st.last_fallback = Some(fallback);
        FusedDecision::Standard
    }

    /// Records `FusedDecision::Measure`'s timing and counts the step under the backend that won,
    /// which `run` then launches for the step's result. Returns whether that is the fused kernel.
    pub(super) fn record_shape_timing(&mut self, key: FusedShapeKey, timing: ShapeTiming) -> bool {
        let st = &mut self.fused;
        st.timings.insert(key, timing);
        let fused = timing.fused_wins();
        st.this_step = fused;
        if fused {
            st.fused_steps += 1;
        } else {
            *st.fallbacks.entry(MEASURED_SLOWER).or_insert(0) += 1;
            st.last_fallback = Some(MEASURED_SLOWER);
        }
        fused
    }

    /// Whether the captured graph of a uniform shape (batch bucket, tokens, logits per sequence) runs
    /// the fused kernel at the last step's context bucket: the same decision as `fused_decision` for
    /// such a step (a measured shape not timed yet has no graph yet either).
    pub(super) fn graph_uses_fused(&self, bucket: usize, tokens: usize, logits: usize) -> bool {
        self.fused.backend == StepBackend::LatencySpecialized
            && self.fused.step.is_some()
            && self.fused.measured_verdict(&FusedShapeKey {
                sequences: bucket,
                tokens,
                logits,
                tapped_layers: self.step_taps.len(),
                context_bucket: self.fused.step_context_bucket,
            }) != Some(false)
            && supports(
                &self.config,
                &vec![
                    SeqShape {
                        tokens,
                        num_logits: logits,
                    };
                    bucket
                ],
            )
            .is_ok()
    }

    /// The fused step: `fused_forward` over `rows` packed rows with logits for `n_logits` of them,
    /// then the greedy ids (as the standard step). Reads only device buffers and launch-time sizes,
    /// so it is captured into a graph like `encode`.
    pub(super) fn encode_fused(&mut self, rows: usize, n_logits: usize) -> Result<(), ModelError> {
        let step = self
            .fused
            .step
            .as_ref()
            .ok_or_else(|| ModelError::Gpu("internal: the fused step is not built".into()))?;
        if rows > FUSED_MAX_ROWS || n_logits > rows {
            return Err(ModelError::Gpu(format!(
                "internal: a fused step of {rows} rows and {n_logits} logits rows"
            )));
        }
        let stream = self.device.stream.clone();
        let s = &*stream;
        // The standard step's attention choice for this launch shape (whole-row or split-key), so
        // both backends run the same attention arithmetic and a captured graph keeps its choice.
        let whole_row = step.info.whole_row_attention && self.whole_row_attention_for(rows);
        let flags = self.fused.opts.mode.flags()
            | if whole_row { 4 } else { 0 }
            | if self.fused.opts.whole_tile_copies {
                8
            } else {
                0
            }
            | if self.fused.opts.ldgsts { 32 } else { 0 }
            // Checked by set_fused_options (and the defaults are 0).
            | self.fused.opts.producer_flags().unwrap_or(0);
        // Tapped layers (fused_decision checked supports_taps): the same slots of the same buffer the
        // standard step copies into; the list is part of the graph key.
        let taps = &self.step_taps;
        let tap_stride = self.opts.max_rows * self.config.hidden_size;
        let args = [
            KernelArg::buf(&step.params, s),
            KernelArg::i32(rows as i32),
            KernelArg::i32(n_logits as i32),
            KernelArg::i32(flags),
            if taps.is_empty() {
                KernelArg::null()
            } else {
                KernelArg::buf(&self.tap_buf, s)
            },
            KernelArg::u64(pack_taps(taps)),
            KernelArg::i32(taps.len() as i32),
            KernelArg::i32(tap_stride as i32),
        ];
        let opts = LaunchOptions {
            pdl: false,
            cooperative: self.fused.opts.cooperative,
        };
        let v2 = step.dataflow.as_ref().and_then(|d| {
            d.launch_for(rows, self.fused.step_seq_rows, &self.config)
                .map(|(f, layout)| (d, f, layout))
        });
        if let Some((d, func, layout)) = v2 {
            // A cluster kernel's co-residency comes from its grid (DataflowStep::configure), not from a
            // cooperative launch.
            let opts = LaunchOptions {
                cooperative: opts.cooperative && d.cluster <= 1,
                ..opts
            };
            let mut args = args.to_vec();
            args[0] = KernelArg::buf(&d.params, s);
            args.push(KernelArg::i32(layout));
            let cfg = LaunchConfig {
                grid_dim: (d.grid, 1, 1),
                block_dim: (d.threads, 1, 1),
                shared_mem_bytes: d.smem as u32,
            };
            // SAFETY: v2's `params` is the FusedParams image of this model's buffers with v2's own
            // counters and attention partials (sized for DATAFLOW_MAX_ROWS rows, which launch_for
            // checked); the arguments follow fused_forward_v2's signature, `layout` is v2_plan's for
            // these rows within `smem`; the grid was checked to be co-resident (the stage counters'
            // waits cannot deadlock).
            unsafe { launch_with(s, func, cfg, &args, opts) }.map_err(gpu)?;
        } else {
            let cfg = LaunchConfig {
                grid_dim: (step.info.grid, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: step.info.smem_bytes,
            };
            // SAFETY: `params` holds the FusedParams image of this model's buffers (allocated at
            // construction for max_rows rows and max_logit_rows logits rows; run() checked rows and
            // n_logits against them); the arguments follow fused_forward's signature; the grid was
            // checked against the occupancy at build time (co-resident, so the grid barrier cannot
            // deadlock).
            unsafe { launch_with(s, &step.func, cfg, &args, opts) }.map_err(gpu)?;
        }
        if n_logits > 0 {
            let args = [
                KernelArg::buf(&self.buf.logits, s),
                KernelArg::i32(self.config.vocab_size as i32),
                KernelArg::buf(&self.buf.argmax, s),
            ];
            // SAFETY: logits holds n_logits rows of vocab_size, argmax n_logits entries; argmax_rows'
            // argument order; launched without PDL.
            unsafe {
                launch(
                    s,
                    &self.k.argmax_rows,
                    rows_cfg(n_logits, 1024),
                    &args,
                    false,
                )
            }
            .map_err(gpu)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::preset;

    #[test]
    fn a_shape_timing_stops_once_the_backends_differ_clearly() {
        let plan = ShapeTimingPlan::DEFAULT;
        // Too few samples: never settled, however far apart.
        assert!(!plan.settled(&[2.6, 2.6], &[5.3, 5.3]));
        // 2.04x apart after the minimum: settled.
        assert!(plan.settled(&[2.6, 2.6, 2.6], &[5.3, 5.4, 5.3]));
        // Either direction.
        assert!(plan.settled(&[2.6, 2.7, 2.6], &[2.3, 2.3, 2.4]));
        // Within the margin (1.002x, 0.961x): keep sampling until the maximum.
        assert!(!plan.settled(&[2.56, 2.56, 2.57], &[2.57, 2.56, 2.57]));
        assert!(!plan.settled(&[2.76, 2.76, 2.75, 2.77], &[2.65, 2.66, 2.65, 2.65]));
        let seven = [2.56; 7];
        assert!(plan.settled(&seven, &[2.57; 7]));
        // The medians decide, not one outlier.
        assert!(!plan.settled(&[2.6, 2.6, 2.6], &[2.6, 9.0, 2.61]));
        assert_eq!(median_ms(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median_ms(&[4.0, 1.0, 2.0, 3.0]), 3.0);
        assert_eq!(median_ms(&[]), 0.0);
    }

    fn llama() -> ModelConfig {
        preset("llama3.2-1b").unwrap()
    }

    fn verify(seqs: usize, tokens: usize) -> Vec<SeqShape> {
        vec![
            SeqShape {
                tokens,
                num_logits: tokens
            };
            seqs
        ]
    }

    #[test]
    fn the_presets_are_supported() {
        for name in ["llama3.2-1b", "qwen2.5-coder-1.5b"] {
            let c = preset(name).unwrap();
            assert_eq!(supports_model(&c), Ok(()), "{name}");
        }
        let c = llama();
        for (seqs, tokens) in [(1, 1), (1, 8), (8, 1), (8, 8), (8, 16), (3, 16)] {
            assert_eq!(supports(&c, &verify(seqs, tokens)), Ok(()));
        }
    }

    #[test]
    fn unsupported_shapes_name_their_reason() {
        let c = llama();
        assert_eq!(supports(&c, &[]), Err(FallbackReason::Empty));
        assert_eq!(
            supports(&c, &verify(9, 1)),
            Err(FallbackReason::TooManySequences { seqs: 9, max: 8 })
        );
        assert_eq!(
            supports(&c, &verify(1, 17)),
            Err(FallbackReason::TooManyTokens {
                tokens: 17,
                max: 16
            })
        );
        // A prompt chunk asks for fewer logits rows than it has tokens, whatever its length.
        let chunk = SeqShape {
            tokens: 12,
            num_logits: 1,
        };
        assert_eq!(
            supports(&c, &[verify(1, 8)[0], chunk]),
            Err(FallbackReason::PrefillChunk {
                tokens: 12,
                num_logits: 1
            })
        );
        let long_prompt = SeqShape {
            tokens: 500,
            num_logits: 1,
        };
        assert_eq!(
            supports(&c, &[long_prompt]).unwrap_err().kind(),
            "prefill_chunk"
        );
        // Mixed token counts are fine as long as each fits.
        let mixed: Vec<SeqShape> = [1usize, 3, 8, 16]
            .iter()
            .map(|&t| SeqShape {
                tokens: t,
                num_logits: t,
            })
            .collect();
        assert_eq!(supports(&c, &mixed), Ok(()));
    }

    #[test]
    fn unsupported_models_name_their_reason() {
        let mut c = llama();
        c.intermediate_size = 8200;
        assert_eq!(
            supports_model(&c),
            Err(FallbackReason::Alignment {
                what: "intermediate_size",
                value: 8200
            })
        );
        // The model's reason comes first, whatever the shape.
        assert_eq!(supports(&c, &verify(1, 1)).unwrap_err().kind(), "alignment");
        let mut c = llama();
        c.head_dim = 48; // q_dim 1536 is still a multiple of 32
        assert_eq!(supports_model(&c), Err(FallbackReason::HeadDim(48)));
        let mut c = llama();
        c.head_dim = 320;
        assert_eq!(supports_model(&c), Err(FallbackReason::HeadDim(320)));
        let mut c = llama();
        c.num_kv_heads = 2; // 16 query heads per KV head
        assert_eq!(supports_model(&c), Err(FallbackReason::GroupSize(16)));
    }

    #[test]
    fn measured_shapes_run_fused_only_where_strictly_faster() {
        let key = |sequences, tokens, tapped_layers, context_bucket| FusedShapeKey {
            sequences,
            tokens,
            logits: tokens,
            tapped_layers,
            context_bucket,
        };
        let mut st = FusedState::default();
        let (slower, faster, tie, untimed) = (
            key(1, 8, 0, 512),
            key(1, 1, 0, 512),
            key(2, 1, 0, 512),
            key(4, 1, 0, 512),
        );
        for (key, fused_ms) in [(slower, 2.2), (faster, 1.29), (tie, 1.4)] {
            st.timings.insert(
                key,
                ShapeTiming {
                    fused_ms,
                    standard_ms: 1.4,
                },
            );
        }
        // `All` ignores the timings: every supported shape runs fused.
        assert_eq!(st.shapes, FusedShapes::All);
        for key in [slower, faster, tie, untimed] {
            assert_eq!(st.measured_verdict(&key), None);
        }
        st.shapes = FusedShapes::Measured;
        assert_eq!(st.measured_verdict(&slower), Some(false));
        assert_eq!(st.measured_verdict(&faster), Some(true));
        assert_eq!(
            st.measured_verdict(&tie),
            Some(false),
            "a tie keeps the standard step"
        );
        assert_eq!(st.measured_verdict(&untimed), None);
        // Another tapped-layer count is another shape, and so is a longer cache.
        assert_eq!(st.measured_verdict(&key(1, 1, 2, 512)), None);
        assert_eq!(st.measured_verdict(&key(1, 1, 0, 1024)), None);
    }

    #[test]
    fn context_buckets_double_from_the_minimum() {
        for (keys, bucket) in [
            (0, 512),
            (1, 512),
            (512, 512),
            (513, 1024),
            (1024, 1024),
            (4000, 4096),
            (32768, 32768),
            (32769, 65536),
        ] {
            assert_eq!(context_bucket(keys), bucket, "{keys} keys");
        }
        assert_eq!(context_bucket(1), CONTEXT_BUCKET_MIN);
        // Up to 32K keys: the minimum bucket and 6 doublings.
        let buckets: std::collections::BTreeSet<usize> = (1..=32768).map(context_bucket).collect();
        assert_eq!(buckets.len(), 7);
    }

    #[test]
    fn taps_pack_one_byte_per_slot_in_list_order() {
        assert_eq!(supports_taps(&[]), Ok(()));
        assert_eq!(supports_taps(&[0, 2]), Ok(()));
        assert_eq!(supports_taps(&[15, 3, 3, 0, 1, 2, 4, 5]), Ok(()));
        assert_eq!(
            supports_taps(&[0; 9]),
            Err(FallbackReason::TappedLayers { taps: 9, max: 8 })
        );
        assert_eq!(supports_taps(&[255]).unwrap_err().kind(), "tapped_layers");
        assert_eq!(pack_taps(&[]), 0);
        assert_eq!(pack_taps(&[0, 2]), 0x0200);
        // Any order, repeats allowed: slot s holds its own layer.
        assert_eq!(pack_taps(&[15, 3, 3]), 0x03_03_0f);
        assert_eq!(pack_taps(&[254; 8]), 0xfefe_fefe_fefe_fefe);
    }

    #[test]
    fn fallback_kinds_are_distinct() {
        let all = [
            FallbackReason::Alignment {
                what: "hidden_size",
                value: 1,
            },
            FallbackReason::HeadDim(1),
            FallbackReason::GroupSize(9),
            FallbackReason::Empty,
            FallbackReason::TooManySequences { seqs: 9, max: 8 },
            FallbackReason::TooManyTokens {
                tokens: 17,
                max: 16,
            },
            FallbackReason::PrefillChunk {
                tokens: 2,
                num_logits: 1,
            },
            FallbackReason::TappedLayers { taps: 9, max: 8 },
        ];
        let kinds: std::collections::BTreeSet<_> = all.iter().map(FallbackReason::kind).collect();
        assert_eq!(kinds.len(), all.len());
        for r in &all {
            assert!(!r.to_string().is_empty());
        }
    }

    #[test]
    fn each_ctas_per_sm_has_an_entry_point() {
        assert_eq!(kernel_for(1).unwrap(), "fused_forward");
        assert_eq!(kernel_for(2).unwrap(), "fused_forward_x2");
        assert!(kernel_for(0).is_err() && kernel_for(3).is_err());
        let exported = specula_kernels::cuda::FUSED_KERNELS;
        assert!(exported.contains(&"fused_forward") && exported.contains(&"fused_forward_x2"));
    }

    #[test]
    fn shared_memory_plans_fit_and_shrink_chunks_when_needed() {
        // H200: 227 KB per block (opt-in), 228 KB per SM, 1 KB reserved per CTA.
        let budget = 232_448;
        let stat = 5_000;
        let split = 22_624; // attention_split_smem of llama3.2-1b (group 4, head_dim 64)
        let p = plan_smem(budget, stat, split, None, &FusedOptions::default()).unwrap();
        assert_eq!((p.chunk_k, p.stages), (DEFAULT_CHUNK_K, 2));
        assert!(p.smem + stat <= budget && p.xs_bytes >= split);
        assert_eq!(p.ring_offset, RED_BYTES + p.xs_bytes);
        assert_eq!(p.ring_offset % 128, 0);
        // Two CTAs per SM: 2048-column slots no longer fit twice, the chunk shrinks.
        let half = 233_472 / 2 - 1024;
        let p2 = plan_smem(half, stat, split, None, &FusedOptions::default()).unwrap();
        assert!(p2.chunk_k < DEFAULT_CHUNK_K && p2.stages >= MIN_RING_STAGES);
        assert!(p2.smem + stat <= half);
        // A whole-row attention buffer that crowds the ring out is dropped (split-key attention).
        let p3 = plan_smem(budget, stat, split, Some(150_000), &FusedOptions::default()).unwrap();
        assert!(!p3.whole_row);
        let p4 = plan_smem(budget, stat, split, Some(40_000), &FusedOptions::default()).unwrap();
        assert!(p4.whole_row && p4.xs_bytes >= 40_000);
        // An explicit chunk is kept or refused, never silently changed.
        let fixed = FusedOptions {
            chunk_k: 4096,
            ..Default::default()
        };
        assert!(plan_smem(half, stat, split, None, &fixed).is_err());
        let bad = FusedOptions {
            chunk_k: 300,
            ..Default::default()
        };
        assert!(plan_smem(budget, stat, split, None, &bad).is_err());
        let slots = FusedOptions {
            chunk_k: 512,
            ring_stages: 8,
            ..Default::default()
        };
        let p5 = plan_smem(budget, stat, split, None, &slots).unwrap();
        assert_eq!((p5.chunk_k, p5.stages), (512, 8));
    }

    #[test]
    fn v2_takes_small_steps_whose_attention_items_stay_small() {
        let d = FusedOptions::default();
        let takes = |rows, seq_rows, group| {
            v2_takes(
                rows,
                seq_rows,
                group,
                d.dataflow_max_rows,
                d.dataflow_max_queries,
            )
        };
        // llama3.2-1b (4 query heads per KV head): every measured shape of <= 16 rows.
        for (rows, seq_rows) in [(1, 1), (2, 1), (4, 1), (8, 1), (8, 8), (9, 1), (16, 8)] {
            assert!(
                takes(rows, seq_rows, 4),
                "{rows} rows, {seq_rows} per sequence"
            );
        }
        // More than 16 rows, or a sequence whose items would hold more than 32 query vectors
        // (qwen2.5-coder-1.5b, 6 per KV head, at 1 request x 8 tokens), run v1.
        assert!(!takes(17, 1, 4));
        assert!(!takes(32, 8, 4));
        assert!(!takes(8, 8, 6));
        assert!(takes(8, 1, 6) && takes(5, 5, 6) && !takes(6, 6, 6));
        assert!(!takes(1, usize::MAX, 4), "no overflow");
    }

    #[test]
    fn dataflow_plans_leave_the_scratch_room_and_align_the_ring() {
        // H200: 227 KB per block less ~1.5 KB of v2's static shared memory.
        let smem = 232_448 - 1_536;
        for (hd, group) in [
            (32, 3),
            (32, 4),
            (64, 4),
            (128, 4),
            (128, 6),
            (128, 7),
            (128, 8),
            (256, 8),
        ] {
            let mut last = usize::MAX;
            for rows in 1..=DATAFLOW_MAX_ROWS {
                let qv = rows * group;
                let attention = 4
                    * (2 * 32 * (hd + 4)
                        + 2 * qv * hd
                        + (2 * qv).next_multiple_of(4)
                        + 2 * rows * hd
                        + 32);
                let Some((offset, stages)) = v2_plan(rows, hd, group, smem) else {
                    // Only steps whose attention scratch leaves less than two 64 KB slots run v1
                    // (wide head groups at several rows); llama3's shapes up to 8 rows never do.
                    assert!(
                        attention > smem - 2 * V2_SLOT_BYTES,
                        "{hd} x {group}, {rows} rows"
                    );
                    assert!(hd * group > 512 || rows > 8, "{hd} x {group}, {rows} rows");
                    continue;
                };
                assert!((2..=V2_MAX_SLOTS).contains(&stages));
                assert_eq!(offset % 128, 0);
                assert!(offset + stages * V2_SLOT_BYTES <= smem);
                assert!(offset < 1 << 24 && stages < 256);
                // The scratch holds the GEMM reduction's two buffers plus one chunk of staged
                // activations per row, and the attention buffers.
                let red = rows.div_ceil(8) * 4096;
                assert!(offset >= 2 * red + rows * (4096 + 64));
                assert!(offset >= attention);
                // More rows never get more slots.
                assert!(stages <= last);
                last = stages;
            }
        }
        // llama3.2-1b at one row: three slots, and the down projection's whole K (8192) staged.
        let (offset, stages) = v2_plan(1, 64, 4, smem).unwrap();
        assert_eq!(stages, 3);
        assert!(offset - 2 * 4096 >= 2 * 8192 + 64);
        assert_eq!(v2_plan(0, 64, 4, smem), None);
        assert_eq!(v2_plan(17, 64, 4, smem), None);
        assert_eq!(v2_plan(1, 64, 4, 40_000), None);
        let l = v2_layout((99_840, 4));
        assert_eq!((l & 0xff_ffff, l >> 24), (99_840, 4));
    }

    #[test]
    fn profile_summary_is_mean_and_max_over_ctas_in_microseconds() {
        let mut a = [0u64; PROF_SLOTS];
        let mut b = [0u64; PROF_SLOTS];
        a[1] = 2_000; // QKV: 2000 and 4000 cycles at 1 GHz = 2 and 4 us
        b[1] = 4_000;
        b[23] = 10_000;
        let p = FusedProfile {
            dataflow: false,
            per_cta: vec![a, b],
            clock_khz: 1e6,
        };
        let rows = p.summary();
        assert_eq!(
            rows.len(),
            FusedProfile::SLOTS.len() - 1,
            "the unused slot is left out"
        );
        let qkv = rows.iter().find(|r| r.0 == "B QKV").unwrap();
        assert!((qkv.1 - 3.0).abs() < 1e-9 && (qkv.2 - 4.0).abs() < 1e-9);
        let total = rows.iter().find(|r| r.0 == "whole kernel").unwrap();
        assert!((total.1 - 5.0).abs() < 1e-9 && (total.2 - 10.0).abs() < 1e-9);
    }

    #[test]
    fn backends_parse_by_name() {
        for b in [StepBackend::Standard, StepBackend::LatencySpecialized] {
            assert_eq!(b.name().parse::<StepBackend>(), Ok(b));
        }
        assert_eq!("fused".parse(), Ok(StepBackend::LatencySpecialized));
        assert!("megakernel".parse::<StepBackend>().is_err());
        assert_eq!(StepBackend::default(), StepBackend::Standard);
    }

    #[test]
    fn params_image_matches_the_device_struct_layout() {
        let p = FusedParamsHost {
            layers: 0x1000,
            barrier: 0x2000,
            prof: 0x3000,
            xn16: 0x4000,
            ss_parts: 0x5000,
            n_layers: 16,
            hidden: 2048,
            ring_stages: 12,
            ring_offset: 32768,
            xs_bytes: 4096,
            chunk_k: 2048,
            max_rows: 512,
            eps: 1e-5,
            scale: 0.125,
            ..Default::default()
        };
        let w = p.words();
        // 22 pointers + 16 four-byte fields = 240 bytes (static_assert in fused_step.cu).
        assert_eq!(w.len(), PARAMS_WORDS);
        assert_eq!(w[0], 0x1000);
        assert_eq!(w[18], 0x2000);
        assert_eq!(w[19], 0x3000);
        assert_eq!(w[20], 0x4000);
        assert_eq!(w[21], 0x5000);
        // n_layers then hidden share word 22, the first in the low half.
        assert_eq!(w[22], 16 | (2048u64 << 32));
        // block_size (9th int) and ring_stages (10th) share word 26, ring_offset and xs_bytes word
        // 27.
        assert_eq!(w[26] >> 32, 12);
        assert_eq!(w[27], 32768 | (4096u64 << 32));
        // chunk_k and max_rows share word 28; eps and scale word 29.
        assert_eq!(w[28], 2048 | (512u64 << 32));
        assert_eq!(
            w[29],
            u64::from(1e-5f32.to_bits()) | (u64::from(0.125f32.to_bits()) << 32)
        );
        assert_eq!(FusedMode::Full.flags(), 0);
        assert_eq!(FusedMode::BarriersOnly.flags(), 1);
        assert_eq!(FusedMode::SkipAttention.flags(), 2);
        assert_eq!(FusedMode::Profile.flags(), 16);
        // v2's producer settings: bits 8-11, 12-15, 16-19, 20-23 and 24-28 (fused_step.cu FUSED_*_SHIFT), 0 = default.
        assert_eq!(FusedOptions::default().producer_flags(), Ok(0));
        let set = FusedOptions {
            copies_in_flight: 2,
            l2_copies_in_flight: 15,
            l2_prefetch_interval: 2000,
            l2_prefetch_lead: Some(4),
            l2_prefetch_max_rows: 16,
            ..Default::default()
        };
        assert_eq!(
            set.producer_flags(),
            Ok(2 << 8 | 15 << 12 | 4 << 16 | 5 << 20 | 16 << 24)
        );
        // A lead of 0 (no prefetch) is a setting of its own, not the default.
        let off = FusedOptions {
            l2_prefetch_lead: Some(0),
            ..Default::default()
        };
        assert_eq!(off.producer_flags(), Ok(1 << 20));
        // The flags above bit 5 are the producer's alone.
        assert_eq!(set.producer_flags().unwrap() & 63, 0);
        for bad in [
            FusedOptions {
                copies_in_flight: 16,
                ..Default::default()
            },
            FusedOptions {
                l2_copies_in_flight: 16,
                ..Default::default()
            },
            FusedOptions {
                l2_prefetch_interval: 700,
                ..Default::default()
            },
            FusedOptions {
                l2_prefetch_interval: 8000,
                ..Default::default()
            },
            FusedOptions {
                l2_prefetch_lead: Some(15),
                ..Default::default()
            },
            FusedOptions {
                l2_prefetch_max_rows: 17,
                ..Default::default()
            },
        ] {
            assert!(bad.producer_flags().is_err(), "{bad:?}");
        }
        // The spec form: empty fields keep the defaults, LEAD 0 turns the prefetch off.
        let d = FusedOptions::default();
        let s = ProducerSettings::parse("2").unwrap();
        assert_eq!(s.apply(d).producer_flags(), Ok(2 << 8));
        assert_eq!(s.describe(), "2 copies in flight");
        assert_eq!(ProducerSettings::of(&s.apply(d)), s);
        let s = ProducerSettings::parse("3:4:2000").unwrap();
        assert_eq!(s.apply(d).producer_flags(), Ok(3 << 8 | 4 << 12 | 4 << 16));
        assert_eq!(
            s.describe(),
            "3 copies in flight, 4 from L2, prefetch every 2000 cycles"
        );
        let s = ProducerSettings::parse("2:::0").unwrap();
        assert_eq!(s.apply(d).producer_flags(), Ok(2 << 8 | 1 << 20));
        assert_eq!(ProducerSettings::of(&s.apply(d)), s);
        let s = ProducerSettings::parse("::::8").unwrap();
        assert_eq!(s.apply(d).producer_flags(), Ok(8 << 24));
        // run_fused_h200.sh's `producer` list: a lead of 4 chunks in every v2 step (the field is lead + 1).
        let s = ProducerSettings::parse("2:::4:16").unwrap();
        assert_eq!(s.apply(d).producer_flags(), Ok(2 << 8 | 5 << 20 | 16 << 24));
        assert_eq!(ProducerSettings::of(&d).describe(), "the kernel's defaults");
        for bad in [
            "",
            ":",
            "x",
            "0",
            "16",
            "1:16",
            "1:0",
            "1:1:700",
            "1:::15",
            "::::17",
            "1:2:3:4:5:6",
            "-1",
        ] {
            assert!(ProducerSettings::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(LAYER_WORDS * 8, 96);
        assert_eq!(FusedProfile::SLOTS.len(), 24);
        assert!(FusedProfile::SLOTS.len() <= PROF_SLOTS);
    }
}
