//! The decoder forward on the CUDA backend (feature `cuda`), batched over sequences.
//!
//! Weights are bf16 on the device (uploaded from a CPU `Transformer`, or filled in place with seeded
//! random values for `--random-weights`); activations f32 with bf16 copies feeding the linear layers
//! (cuBLAS or the skinny tensor-core kernel, chosen per shape by measurement); the KV cache is f32 in
//! a paged pool of 16-position blocks shared by all sequences.
//!
//! One forward takes several sequences, each with its own new tokens and logits count, like the CPU
//! `Transformer::forward` (the oracle it is checked against by `gpu_forward_check`). Every per-step
//! input (token ids, positions, cache slots, block tables, which rows need logits) lives in one device
//! buffer allocated at construction and is refreshed by a single async copy, and every kernel takes
//! its sizes from the launch or from that buffer — so the step for a (batch bucket, tokens per
//! sequence, logits per sequence) shape is captured once into a CUDA graph and replayed with new
//! inputs, with no host synchronisation inside the step. Batches are padded up to a power-of-two
//! bucket with rows that write to a reserved trash block. Shapes that don't fit a graph (prefill
//! chunks of any length, mixed token counts) run the same kernels launched directly.

use crate::config::ModelConfig;
use crate::random::{self, TensorKind};
use crate::transformer::Transformer;
use crate::ModelError;
use cudarc::driver::{sys, CudaFunction, CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use specula_kernels::cuda::{
    capture_graph, launch, CudaError, Gemm, GpuDevice, KernelArg, LinearBackend, LinearChoice,
    OwnedGraph,
};
use specula_kernels::{Matrix, MatrixData};
use std::collections::HashMap;

// The `latency_specialized` backend (issue 6): one persistent kernel per step on this model's weights,
// KV cache and step buffers. A child module so that it reads the private state directly.
#[path = "gpu_fused.rs"]
pub mod fused;
use fused::{FusedDecision, ShapeTiming};

fn gpu(e: impl Into<CudaError>) -> ModelError {
    ModelError::Gpu(e.into().to_string())
}

/// Positions per KV block.
pub const GPU_BLOCK_SIZE: usize = 16;
/// attention_split's key slices per row (ATTN_MAX_SPLITS in decoder.cu).
const ATTN_MAX_SPLITS: usize = 4;

/// The most new tokens per sequence a captured step takes (a verify block of k = 15 drafts).
pub const MAX_GRAPH_TOKENS: usize = 16;

/// Capacities, fixed at construction (every step buffer is allocated from them before any capture).
#[derive(Debug, Clone)]
pub struct GpuOptions {
    /// Sequences alive at once; also the largest batch of one step.
    pub max_sequences: usize,
    /// Positions per sequence.
    pub max_positions: usize,
    /// Activation rows per device launch: longer prefills are split into chunks of this many.
    pub max_rows: usize,
    /// Logits rows one launch may return, at least (the floor is `max_sequences * MAX_GRAPH_TOKENS`
    /// and 64). An engine step that verifies blocks of up to 17 tokens per sequence and finishes
    /// prefills in the same launch needs more than the floor.
    pub min_logit_rows: usize,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            max_sequences: 8,
            max_positions: 2048,
            max_rows: 512,
            min_logit_rows: 0,
        }
    }
}

/// A sequence slot of a `GpuTransformer`.
pub type GpuSeqId = usize;

/// One sequence's part of a GPU forward (as `SeqInput` for the CPU).
#[derive(Debug, Clone)]
pub struct GpuSeqInput<'a> {
    pub seq: GpuSeqId,
    pub tokens: &'a [u32],
    pub num_logits: usize,
}

/// Logits on the host, `[sum of num_logits, vocab]`, sequences in input order.
#[derive(Debug, Clone, Default)]
pub struct GpuForwardOutput {
    pub logits: Vec<f32>,
    pub logits_start: Vec<usize>,
    pub vocab_size: usize,
    /// For each tapped layer, `[total new tokens, hidden]`: the residual stream after that layer
    /// (HF `hidden_states[layer + 1]`), exactly what the CPU `ForwardOutput::hidden` holds.
    pub hidden: Vec<Vec<f32>>,
}

impl GpuForwardOutput {
    pub fn row(&self, i: usize, j: usize) -> &[f32] {
        let r = self.logits_start[i] + j;
        &self.logits[r * self.vocab_size..(r + 1) * self.vocab_size]
    }
}

/// How the last step ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepPath {
    /// Replayed a captured graph.
    Graph,
    /// First use of a graph shape: ran directly, then captured for the next time.
    Captured,
    /// Launched kernel by kernel (no graph for this shape).
    Direct,
}

/// Parts of the step left out, for timing only (`specula bench step` prints where the time goes by
/// difference: "time variants that leave one stage out"). Any skip makes the outputs meaningless;
/// the default runs everything.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepAblation {
    /// Launch the step's kernels with programmatic dependent launch even where it is off by default.
    pub force_pdl: bool,
    pub skip_attention: bool,
    /// RoPE + KV append.
    pub skip_rope_kv: bool,
    /// The two RMSNorms of each layer.
    pub skip_norms: bool,
    /// The four linear layers of each layer (and SwiGLU).
    pub skip_layer_linears: bool,
    /// Final norm, LM head, argmax.
    pub skip_head: bool,
    /// Launch attention twice per layer (the second launch's time is the kernel's own cost).
    pub double_attention: bool,
    /// Which attention kernel every launch uses (default: chosen by launch size).
    pub attention: AttentionKernel,
}

/// The step's attention kernel. `Auto` picks per launch from the number of blocks the whole-row
/// kernel would run: split-key attention only while that leaves most SMs idle (decode and small
/// verify batches), whole-row attention otherwise (H200, llama3.2-1b, 260 keys: split 1.41 vs
/// whole-row 1.45 ms per step at 1 x 8 rows, but 2.48 vs 1.71 ms at 8 x 8 rows, where 512 whole-row
/// blocks already fill the GPU and splitting only adds blocks and a combine pass).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    #[default]
    Auto,
    /// attention_split for every launch.
    Split,
    /// attention_gqa for every launch (when the context fits its shared memory).
    WholeRow,
}

struct GpuLayer {
    attn_norm: CudaSlice<f32>,
    wqkv: CudaSlice<u16>,
    bqkv: Option<CudaSlice<f32>>,
    q_norm: Option<CudaSlice<f32>>,
    k_norm: Option<CudaSlice<f32>>,
    wo: CudaSlice<u16>,
    bo: Option<CudaSlice<f32>>,
    ffn_norm: CudaSlice<f32>,
    w_gate_up: CudaSlice<u16>,
    w_down: CudaSlice<u16>,
    k_cache: CudaSlice<f32>,
    v_cache: CudaSlice<f32>,
}

struct Kernels {
    embed_rows: CudaFunction,
    rms_norm_bf16: CudaFunction,
    head_rms_norm: CudaFunction,
    add_bias_rows: CudaFunction,
    rope_kv_append: CudaFunction,
    /// attention_split: the step's attention.
    attention: CudaFunction,
    /// attention_gqa (one block per row over every key), for the step profile.
    attention_whole_row: CudaFunction,
    swiglu_bf16: CudaFunction,
    argmax_rows: CudaFunction,
}

/// Device buffers of one step, sized from `GpuOptions`.
struct StepBuffers {
    /// Packed i32 inputs; see `InputLayout`.
    inputs: CudaSlice<i32>,
    x: CudaSlice<f32>,
    act16: CudaSlice<u16>,
    qkv: CudaSlice<f32>,
    gate_up: CudaSlice<f32>,
    /// attention_split's per-slice outputs, `[rows, kv heads, ATTN_MAX_SPLITS, G * (head_dim + 2)]`.
    attn_partials: CudaSlice<f32>,
    /// attention_split's finished-slice counters per (row, KV head); zero between launches.
    attn_counters: CudaSlice<u32>,
    /// SwiGLU output (the down projection's input), bf16 `[rows, ffn]`.
    ffn_act16: CudaSlice<u16>,
    logits: CudaSlice<f32>,
    argmax: CudaSlice<u32>,
}

/// Offsets of the sections of the packed input buffer.
#[derive(Debug, Clone, Copy)]
struct InputLayout {
    tokens: usize,
    positions: usize,
    slots: usize,
    row_table: usize,
    logit_rows: usize,
    block_tables: usize,
    len: usize,
}

impl InputLayout {
    fn new(max_rows: usize, max_sequences: usize, max_blocks: usize) -> InputLayout {
        InputLayout {
            tokens: 0,
            positions: max_rows,
            slots: 2 * max_rows,
            row_table: 3 * max_rows,
            logit_rows: 4 * max_rows,
            block_tables: 5 * max_rows,
            len: 5 * max_rows + max_sequences * max_blocks,
        }
    }
}

struct SeqState {
    blocks: Vec<u32>,
    len: usize,
}

/// A model resident on the GPU with a paged KV cache for up to `max_sequences` sequences.
pub struct GpuTransformer {
    pub device: GpuDevice,
    gemm: Gemm,
    k: Kernels,
    config: ModelConfig,
    embed: CudaSlice<u16>,
    layers: Vec<GpuLayer>,
    final_norm: CudaSlice<f32>,
    lm_head: Option<CudaSlice<u16>>,
    inv_freq: CudaSlice<f64>,
    opts: GpuOptions,
    /// Blocks a sequence may hold (`max_positions / GPU_BLOCK_SIZE`, rounded up).
    max_blocks: usize,
    /// Dynamic shared memory of attention_gqa (profile only).
    attention_smem: usize,
    /// Dynamic shared memory of attention_split.
    attention_split_smem: usize,
    /// The block padded rows write to (never part of a sequence).
    trash_block: u32,
    free_blocks: Vec<u32>,
    seqs: Vec<Option<SeqState>>,
    layout: InputLayout,
    host_inputs: Vec<i32>,
    buf: StepBuffers,
    /// Largest logits rows per launch.
    max_logit_rows: usize,
    /// Captured steps by (batch bucket, tokens per sequence, logits per sequence, tapped layers,
    /// whether the fused kernel runs it).
    graphs: HashMap<(usize, usize, usize, Vec<usize>, bool), OwnedGraph>,
    /// Tapped layers of the step being encoded (set only for the duration of one forward).
    step_taps: Vec<usize>,
    /// `[tapped layer slot, max_rows, hidden]`: the tapped layers' outputs of the last step. Sized
    /// by `reserve_tapped_layers` before any tapped step, so captured graphs copy into a buffer that
    /// stays put.
    tap_buf: CudaSlice<f32>,
    tap_capacity: usize,
    /// Gate/up rows interleaved in groups of 8 so SwiGLU runs in the GEMM's epilogue (ffn % 8 == 0).
    paired_gate_up: bool,
    ablation: StepAblation,
    /// Streaming multiprocessors (attention's kernel choice).
    num_sms: usize,
    /// Set when a capture failed: later steps run directly (correct, slower) and reports say why.
    graph_error: Option<String>,
    /// The step backend and the fused kernel's state (gpu_fused.rs).
    fused: fused::FusedState,
}

fn rows_cfg(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn grid_cfg(x: usize, y: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Weight bits as bf16 (f32 checkpoints are rounded: the GPU path computes in bf16 x bf16 -> f32).
fn bf16_bits(m: &Matrix) -> Vec<u16> {
    match &m.data {
        MatrixData::Bf16(v) => v.iter().map(|x| x.to_bits()).collect(),
        MatrixData::F32(v) => v
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect(),
    }
}

/// Where the weights come from.
enum WeightSource<'a> {
    Cpu(&'a Transformer),
    Random { seed: u64 },
}

/// The smallest power of two >= `n`, capped at `cap` (then `cap` itself).
fn batch_bucket(n: usize, cap: usize) -> usize {
    n.next_power_of_two().min(cap).max(n)
}

impl GpuTransformer {
    /// Uploads a CPU model.
    pub fn upload(cpu: &Transformer, opts: GpuOptions) -> Result<GpuTransformer, ModelError> {
        Self::build(cpu.config.clone(), WeightSource::Cpu(cpu), opts)
    }

    /// A model of `config`'s shape with seeded random bf16 weights generated on the device (the same
    /// values `random::random_transformer` makes on the CPU).
    pub fn random(
        config: ModelConfig,
        seed: u64,
        opts: GpuOptions,
    ) -> Result<GpuTransformer, ModelError> {
        Self::build(config, WeightSource::Random { seed }, opts)
    }

    fn build(
        config: ModelConfig,
        source: WeightSource<'_>,
        opts: GpuOptions,
    ) -> Result<GpuTransformer, ModelError> {
        config.validate()?;
        let c = config.clone();
        let group = c.num_heads / c.num_kv_heads;
        if !c.head_dim.is_multiple_of(32) || c.head_dim > 256 || group > 8 {
            return Err(ModelError::Gpu(format!(
                "the GPU attention kernel needs head_dim a multiple of 32 and at most 256 and at most 8 query heads per KV head, got head_dim {} and {group}; use the CPU backend",
                c.head_dim
            )));
        }
        if opts.max_sequences == 0 || opts.max_positions == 0 {
            return Err(ModelError::InvalidRequest(
                "GPU options: max_sequences and max_positions must be positive".into(),
            ));
        }
        let max_rows = opts
            .max_rows
            .max(opts.max_sequences * MAX_GRAPH_TOKENS)
            .max(1);
        let opts = GpuOptions { max_rows, ..opts };
        let device = GpuDevice::new(0).map_err(gpu)?;
        let s = device.stream.clone();
        let gemm = Gemm::new(&device).map_err(gpu)?;
        let f = |n: &str| device.function(n).map_err(gpu);
        let k = Kernels {
            embed_rows: f("embed_rows")?,
            rms_norm_bf16: f("rms_norm_bf16")?,
            head_rms_norm: f("head_rms_norm")?,
            add_bias_rows: f("add_bias_rows")?,
            rope_kv_append: f("rope_kv_append")?,
            attention: f("attention_split")?,
            attention_whole_row: f("attention_gqa")?,
            swiglu_bf16: f("swiglu_bf16")?,
            argmax_rows: f("argmax_rows")?,
        };
        let (h, qd, kvd, ffn) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let width = qd + 2 * kvd;
        let max_blocks = opts.max_positions.div_ceil(GPU_BLOCK_SIZE);
        // attention_gqa's shared memory (see decoder.cu), fixed by the largest context.
        let max_keys = max_blocks * GPU_BLOCK_SIZE;
        let attention_smem =
            4 * (group * c.head_dim + group * max_keys + max_keys + 1024 * group + 8);
        let num_sms = device
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(gpu)? as usize;
        let smem_limit = device
            .ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(gpu)? as usize;
        // attention_split's shared memory (decoder.cu): independent of the context length.
        let attention_split_smem = 4 * (group * c.head_dim + group * 256 + 256 + 1024 * group + 24);
        if attention_split_smem > smem_limit {
            return Err(ModelError::Gpu(format!(
                "GPU attention needs {attention_split_smem} bytes of shared memory, over the device's {smem_limit}; use the CPU backend"
            )));
        }
        k.attention
            .set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                attention_split_smem as i32,
            )
            .map_err(gpu)?;
        // The whole-row kernel (step profile only) needs room for every key; without it the profile
        // leaves that variant out.
        let attention_smem = if attention_smem <= smem_limit {
            k.attention_whole_row
                .set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    attention_smem as i32,
                )
                .map_err(gpu)?;
            attention_smem
        } else {
            0
        };
        let num_blocks = opts.max_sequences * max_blocks;
        // One more block: the trash block padded rows write to.
        let cache_len = (num_blocks + 1) * GPU_BLOCK_SIZE * kvd;

        let fill_bf16 = f("fill_random_bf16")?;
        let fill_f32 = f("fill_random_f32")?;
        let fill_cfg = LaunchConfig {
            grid_dim: (4096, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // Matrices: from the CPU model, or seeded on the device.
        let matrix = |m: Option<&Matrix>,
                      layer: Option<usize>,
                      kind: TensorKind,
                      n: usize|
         -> Result<CudaSlice<u16>, ModelError> {
            match (m, &source) {
                (Some(m), _) => s.clone_htod(&bf16_bits(m)).map_err(gpu),
                (None, WeightSource::Random { seed }) => {
                    let mut d = s.alloc_zeros::<u16>(n).map_err(gpu)?;
                    let (n64, tag, scale) = (
                        n as u64,
                        random::tensor_tag(layer, kind),
                        random::MATRIX_SCALE,
                    );
                    let mut b = s.launch_builder(&fill_bf16);
                    b.arg(&mut d).arg(&n64).arg(seed).arg(&tag).arg(&scale);
                    // SAFETY: d holds n elements; arguments in fill_random_bf16's order and types.
                    unsafe { b.launch(fill_cfg) }.map_err(gpu)?;
                    Ok(d)
                }
                (None, WeightSource::Cpu(_)) => Err(ModelError::Gpu(
                    "internal: CPU weights missing for a tensor".into(),
                )),
            }
        };
        let vector = |v: Option<&[f32]>,
                      layer: Option<usize>,
                      kind: TensorKind,
                      n: usize,
                      scale: f32,
                      offset: f32|
         -> Result<CudaSlice<f32>, ModelError> {
            match (v, &source) {
                (Some(v), _) => s.clone_htod(v).map_err(gpu),
                (None, WeightSource::Random { seed }) => {
                    let mut d = s.alloc_zeros::<f32>(n).map_err(gpu)?;
                    let (n64, tag) = (n as u64, random::tensor_tag(layer, kind));
                    let mut b = s.launch_builder(&fill_f32);
                    b.arg(&mut d)
                        .arg(&n64)
                        .arg(seed)
                        .arg(&tag)
                        .arg(&scale)
                        .arg(&offset);
                    // SAFETY: d holds n elements; arguments in fill_random_f32's order and types.
                    unsafe { b.launch(fill_cfg) }.map_err(gpu)?;
                    Ok(d)
                }
                (None, WeightSource::Cpu(_)) => Err(ModelError::Gpu(
                    "internal: CPU weights missing for a tensor".into(),
                )),
            }
        };
        let cpu = match &source {
            WeightSource::Cpu(t) => Some(*t),
            WeightSource::Random { .. } => None,
        };
        let (ns, bs) = (random::NORM_SCALE, random::BIAS_SCALE);
        let mut layers = Vec::with_capacity(c.num_layers);
        for li in 0..c.num_layers {
            let l = cpu.map(|t| &t.layers[li]);
            let at = Some(li);
            layers.push(GpuLayer {
                attn_norm: vector(
                    l.map(|l| &l.attn_norm[..]),
                    at,
                    TensorKind::AttnNorm,
                    h,
                    ns,
                    1.0,
                )?,
                wqkv: matrix(l.map(|l| &l.wqkv), at, TensorKind::Wqkv, width * h)?,
                bqkv: if c.qkv_bias {
                    Some(vector(
                        l.and_then(|l| l.bqkv.as_deref()),
                        at,
                        TensorKind::Bqkv,
                        width,
                        bs,
                        0.0,
                    )?)
                } else {
                    None
                },
                q_norm: if c.qk_norm {
                    Some(vector(
                        l.and_then(|l| l.q_norm.as_deref()),
                        at,
                        TensorKind::QNorm,
                        c.head_dim,
                        ns,
                        1.0,
                    )?)
                } else {
                    None
                },
                k_norm: if c.qk_norm {
                    Some(vector(
                        l.and_then(|l| l.k_norm.as_deref()),
                        at,
                        TensorKind::KNorm,
                        c.head_dim,
                        ns,
                        1.0,
                    )?)
                } else {
                    None
                },
                wo: matrix(l.map(|l| &l.wo), at, TensorKind::Wo, h * qd)?,
                bo: if c.o_bias {
                    Some(vector(
                        l.and_then(|l| l.bo.as_deref()),
                        at,
                        TensorKind::Bo,
                        h,
                        bs,
                        0.0,
                    )?)
                } else {
                    None
                },
                ffn_norm: vector(
                    l.map(|l| &l.ffn_norm[..]),
                    at,
                    TensorKind::FfnNorm,
                    h,
                    ns,
                    1.0,
                )?,
                w_gate_up: matrix(
                    l.map(|l| &l.w_gate_up),
                    at,
                    TensorKind::WGateUp,
                    2 * ffn * h,
                )?,
                w_down: matrix(l.map(|l| &l.w_down), at, TensorKind::WDown, h * ffn)?,
                k_cache: s.alloc_zeros::<f32>(cache_len).map_err(gpu)?,
                v_cache: s.alloc_zeros::<f32>(cache_len).map_err(gpu)?,
            });
        }
        let embed = matrix(
            cpu.map(|t| &t.embed),
            None,
            TensorKind::Embed,
            c.vocab_size * h,
        )?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(matrix(
                cpu.and_then(|t| t.lm_head.as_ref()),
                None,
                TensorKind::LmHead,
                c.vocab_size * h,
            )?)
        };
        let final_norm = vector(
            cpu.map(|t| &t.final_norm[..]),
            None,
            TensorKind::FinalNorm,
            h,
            ns,
            1.0,
        )?;
        let inv_freq = s.clone_htod(&c.rope_inv_freq()).map_err(gpu)?;
        // Pair gate and up rows for the fused SwiGLU epilogue (decoder.cu, interleave_gate_up).
        let paired_gate_up = ffn.is_multiple_of(8);
        if paired_gate_up {
            let interleave = f("interleave_gate_up")?;
            for l in &mut layers {
                let mut dst = s.alloc_zeros::<u16>(2 * ffn * h).map_err(gpu)?;
                let args = [
                    KernelArg::buf(&l.w_gate_up, &s),
                    KernelArg::buf(&dst, &s),
                    KernelArg::i32(ffn as i32),
                    KernelArg::i32(h as i32),
                ];
                // SAFETY: both buffers hold 2 * ffn * h elements; interleave_gate_up's arguments.
                unsafe { launch(&s, &interleave, rows_cfg(2 * ffn, 256), &args, false) }
                    .map_err(gpu)?;
                std::mem::swap(&mut l.w_gate_up, &mut dst);
                s.synchronize().map_err(gpu)?;
            }
        }

        let max_logit_rows = (opts.max_sequences * MAX_GRAPH_TOKENS)
            .max(64)
            .max(opts.min_logit_rows);
        let layout = InputLayout::new(max_rows, opts.max_sequences, max_blocks);
        let act_width = h.max(qd).max(ffn);
        let buf = StepBuffers {
            inputs: s.alloc_zeros::<i32>(layout.len).map_err(gpu)?,
            x: s.alloc_zeros::<f32>(max_rows * h).map_err(gpu)?,
            act16: s.alloc_zeros::<u16>(max_rows * act_width).map_err(gpu)?,
            qkv: s.alloc_zeros::<f32>(max_rows * width).map_err(gpu)?,
            gate_up: s.alloc_zeros::<f32>(max_rows * 2 * ffn).map_err(gpu)?,
            ffn_act16: s.alloc_zeros::<u16>(max_rows * ffn).map_err(gpu)?,
            attn_partials: s
                .alloc_zeros::<f32>(
                    max_rows * c.num_kv_heads * ATTN_MAX_SPLITS * group * (c.head_dim + 2),
                )
                .map_err(gpu)?,
            attn_counters: s
                .alloc_zeros::<u32>(max_rows * c.num_kv_heads)
                .map_err(gpu)?,
            logits: s
                .alloc_zeros::<f32>(max_logit_rows * c.vocab_size)
                .map_err(gpu)?,
            argmax: s.alloc_zeros::<u32>(max_logit_rows).map_err(gpu)?,
        };
        s.synchronize().map_err(gpu)?;
        Ok(GpuTransformer {
            device,
            gemm,
            k,
            embed,
            layers,
            final_norm,
            lm_head,
            inv_freq,
            max_blocks,
            attention_smem,
            attention_split_smem,
            trash_block: num_blocks as u32,
            // Popped from the end: hand out low block numbers first.
            free_blocks: (0..num_blocks as u32).rev().collect(),
            seqs: Vec::new(),
            host_inputs: vec![0; layout.len],
            layout,
            buf,
            max_logit_rows,
            graphs: HashMap::new(),
            step_taps: Vec::new(),
            tap_buf: s.alloc_zeros::<f32>(1).map_err(gpu)?,
            tap_capacity: 0,
            paired_gate_up,
            ablation: StepAblation::default(),
            num_sms,
            graph_error: None,
            fused: fused::FusedState::default(),
            opts,
            config: c,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn options(&self) -> &GpuOptions {
        &self.opts
    }

    /// Bytes of weights one step streams: every layer matrix and the LM head (bf16).
    pub fn weight_bytes(&self) -> usize {
        let c = &self.config;
        let (h, qd, kvd, ffn) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let per_layer = (qd + 2 * kvd) * h + h * qd + 2 * ffn * h + h * ffn;
        2 * (c.num_layers * per_layer + c.vocab_size * h)
    }

    /// Bytes of keys and values (f32) that attention reads for `keys` cached positions in total.
    pub fn kv_bytes(&self, keys: usize) -> usize {
        keys * self.config.num_layers * 2 * self.config.kv_dim() * 4
    }

    /// Times cuBLAS and the skinny kernel on every distinct linear-layer shape of the model for each
    /// activation-row bucket in `tokens`, and uses the faster from now on. Run before capturing graphs
    /// (graphs captured earlier keep their kernels).
    pub fn tune_linear_layers(
        &mut self,
        tokens: &[usize],
        reps: usize,
    ) -> Result<Vec<LinearChoice>, ModelError> {
        let c = self.config.clone();
        let (h, qd, kvd, ffn) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let ls = &self.layers;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let mut out = Vec::new();
        let mut shapes: Vec<(Vec<&CudaSlice<u16>>, usize, usize)> = vec![
            (ls.iter().map(|l| &l.wqkv).collect(), qd + 2 * kvd, h),
            (ls.iter().map(|l| &l.wo).collect(), h, qd),
            (ls.iter().map(|l| &l.w_down).collect(), h, ffn),
            (vec![head], c.vocab_size, h),
        ];
        if !self.paired_gate_up {
            shapes.insert(2, (ls.iter().map(|l| &l.w_gate_up).collect(), 2 * ffn, h));
        }
        for (weights, rows, cols) in &shapes {
            out.extend(
                self.gemm
                    .tune(weights, *rows, *cols, tokens, reps)
                    .map_err(gpu)?,
            );
        }
        if self.paired_gate_up {
            // The paired gate/up matrix: the fused SwiGLU kernel against cuBLAS + the SwiGLU kernel,
            // reported as a "skinny split 1" vs "cublas" row whose times include SwiGLU.
            let weights: Vec<&CudaSlice<u16>> = ls.iter().map(|l| &l.w_gate_up).collect();
            for (n, fused_us, split_us) in self
                .gemm
                .tune_swiglu(&weights, 2 * ffn, h, tokens, reps)
                .map_err(gpu)?
            {
                out.push(LinearChoice {
                    rows: 2 * ffn,
                    cols: h,
                    tokens: n,
                    cublas_us: split_us,
                    skinny_us: vec![(1, fused_us)],
                    backend: if fused_us <= split_us {
                        LinearBackend::Skinny { splits: 1 }
                    } else {
                        LinearBackend::Cublas
                    },
                });
            }
        }
        self.graphs.clear();
        Ok(out)
    }

    /// Whether the whole-row attention kernel fits this model's context in shared memory.
    pub fn whole_row_attention_available(&self) -> bool {
        self.attention_smem > 0
    }

    /// Whether a launch over `rows` rows runs whole-row attention (else split-key attention). Depends
    /// only on the launch shape, so a captured graph keeps its kernel; a row's attention output is
    /// therefore the same within one shape but may differ in the last bits between shapes that
    /// choose differently (as with the GEMM choice per row bucket).
    fn whole_row_attention_for(&self, rows: usize) -> bool {
        if !self.whole_row_attention_available() {
            return false;
        }
        match self.ablation.attention {
            AttentionKernel::Split => false,
            AttentionKernel::WholeRow => true,
            AttentionKernel::Auto => 2 * rows * self.config.num_kv_heads > self.num_sms,
        }
    }

    /// Whether the gate/up projection runs with SwiGLU fused (its tuning rows include SwiGLU).
    pub fn fused_swiglu(&self) -> bool {
        self.paired_gate_up
    }

    /// Leaves parts of the step out (timing only), forces PDL on, or forces one attention kernel (the
    /// outputs stay valid for that); drops captured graphs so the next steps capture the variant.
    /// `StepAblation::default()` restores the real step.
    pub fn set_ablation(&mut self, ablation: StepAblation) {
        if ablation != self.ablation {
            self.ablation = ablation;
            self.gemm
                .set_pdl(self.device.pdl || (ablation.force_pdl && self.device.pdl_capable));
            self.graphs.clear();
        }
    }

    pub fn add_sequence(&mut self) -> Result<GpuSeqId, ModelError> {
        let state = SeqState {
            blocks: Vec::new(),
            len: 0,
        };
        if let Some(i) = self.seqs.iter().position(Option::is_none) {
            self.seqs[i] = Some(state);
            return Ok(i);
        }
        if self.seqs.len() >= self.opts.max_sequences {
            return Err(ModelError::InvalidRequest(format!(
                "the GPU model holds at most {} sequences",
                self.opts.max_sequences
            )));
        }
        self.seqs.push(Some(state));
        Ok(self.seqs.len() - 1)
    }

    fn seq(&self, seq: GpuSeqId) -> Result<&SeqState, ModelError> {
        self.seqs
            .get(seq)
            .and_then(Option::as_ref)
            .ok_or_else(|| ModelError::InvalidRequest(format!("no GPU sequence {seq}")))
    }

    pub fn remove_sequence(&mut self, seq: GpuSeqId) -> Result<(), ModelError> {
        self.seq(seq)?;
        let state = self.seqs[seq].take().expect("checked");
        self.free_blocks.extend(state.blocks.into_iter().rev());
        Ok(())
    }

    pub fn seq_len(&self, seq: GpuSeqId) -> Result<usize, ModelError> {
        Ok(self.seq(seq)?.len)
    }

    /// Rolls a sequence back to `len` positions (rejected drafts) and frees blocks past it.
    pub fn truncate(&mut self, seq: GpuSeqId, len: usize) -> Result<(), ModelError> {
        self.seq(seq)?;
        let state = self.seqs[seq].as_mut().expect("checked");
        state.len = state.len.min(len);
        let keep = state.len.div_ceil(GPU_BLOCK_SIZE);
        let freed: Vec<u32> = state.blocks.drain(keep..).collect();
        self.free_blocks.extend(freed.into_iter().rev());
        Ok(())
    }

    /// Runs the inputs and returns their logits on the host. Prefills longer than `max_rows` rows are
    /// split into chunks (each a direct launch); batches that fit run as one step.
    pub fn forward(&mut self, inputs: &[GpuSeqInput<'_>]) -> Result<GpuForwardOutput, ModelError> {
        self.forward_tapped(inputs, &[])
    }

    /// Sizes the tapped-layer buffer for up to `layers` taps per step (drafters that condition on
    /// target features). Call before the first tapped step: graphs captured earlier are dropped,
    /// because they copy into the old buffer.
    pub fn reserve_tapped_layers(&mut self, layers: usize) -> Result<(), ModelError> {
        if layers <= self.tap_capacity {
            return Ok(());
        }
        let n = layers * self.opts.max_rows * self.config.hidden_size;
        self.tap_buf = self.device.stream.alloc_zeros::<f32>(n).map_err(gpu)?;
        self.tap_capacity = layers;
        self.graphs.clear();
        Ok(())
    }

    fn check_taps(&self, taps: &[usize]) -> Result<(), ModelError> {
        if taps.len() > self.tap_capacity {
            return Err(ModelError::InvalidRequest(format!(
                "{} tapped layers asked for; reserve_tapped_layers made room for {}",
                taps.len(),
                self.tap_capacity
            )));
        }
        if let Some(&l) = taps.iter().find(|&&l| l >= self.config.num_layers) {
            return Err(ModelError::InvalidRequest(format!(
                "hidden layer {l} requested of {}",
                self.config.num_layers
            )));
        }
        Ok(())
    }

    /// Runs one step (graph or direct) with the tapped layers' outputs kept on the device; the
    /// taps are part of the graph key, so a tapped and an untapped step of one shape are two graphs.
    fn run_tapped(
        &mut self,
        inputs: &[GpuSeqInput<'_>],
        taps: &[usize],
    ) -> Result<(usize, StepPath), ModelError> {
        self.check_taps(taps)?;
        self.step_taps = taps.to_vec();
        let result = self.run(inputs, true);
        self.step_taps.clear();
        result
    }

    /// One step that leaves its logits on the device (`logits_on_device`, rows packed in input
    /// order, `num_logits` per sequence) and its tapped outputs in the tap buffer (`read_tapped`).
    /// Nothing is copied back and nothing waits: the caller queues its own work behind it. The
    /// step must fit one launch (`max_rows` rows, `max_logit_rows` logits rows).
    pub fn forward_on_device(
        &mut self,
        inputs: &[GpuSeqInput<'_>],
        taps: &[usize],
    ) -> Result<usize, ModelError> {
        let total: usize = inputs.iter().map(|i| i.tokens.len()).sum();
        let logits: usize = inputs.iter().map(|i| i.num_logits).sum();
        if total > self.opts.max_rows || logits > self.max_logit_rows {
            return Err(ModelError::InvalidRequest(format!(
                "{total} rows / {logits} logits rows do not fit one GPU step (limits {} / {})",
                self.opts.max_rows, self.max_logit_rows
            )));
        }
        Ok(self.run_tapped(inputs, taps)?.0)
    }

    /// The logits of the last step, `[logits rows, vocab]` (valid until the next step).
    pub fn logits_on_device(&self) -> &CudaSlice<f32> {
        &self.buf.logits
    }

    /// Most logits rows one step returns.
    pub fn max_logit_rows(&self) -> usize {
        self.max_logit_rows
    }

    /// The first `rows` rows of each of the last step's `layers` tapped outputs, on the host.
    pub fn read_tapped(&self, layers: usize, rows: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        let (h, stride) = (
            self.config.hidden_size,
            self.opts.max_rows * self.config.hidden_size,
        );
        if layers > self.tap_capacity || rows > self.opts.max_rows {
            return Err(ModelError::InvalidRequest(format!(
                "{layers} tapped layers x {rows} rows read; the buffer holds {} x {}",
                self.tap_capacity, self.opts.max_rows
            )));
        }
        let s = &self.device.stream;
        (0..layers)
            .map(|slot| {
                s.clone_dtoh(&self.tap_buf.slice(slot * stride..slot * stride + rows * h))
                    .map_err(gpu)
            })
            .collect()
    }

    /// `forward`, also returning the outputs of the layers in `taps` (as the CPU forward's
    /// `hidden_layers`).
    pub fn forward_tapped(
        &mut self,
        inputs: &[GpuSeqInput<'_>],
        taps: &[usize],
    ) -> Result<GpuForwardOutput, ModelError> {
        let vocab = self.config.vocab_size;
        let total: usize = inputs.iter().map(|i| i.tokens.len()).sum();
        let logits: usize = inputs.iter().map(|i| i.num_logits).sum();
        if total <= self.opts.max_rows && logits <= self.max_logit_rows {
            let (n, _) = self.run_tapped(inputs, taps)?;
            let mut out = vec![0f32; n * vocab];
            let s = self.device.stream.clone();
            if n > 0 {
                s.memcpy_dtoh(&self.buf.logits.slice(..n * vocab), &mut out)
                    .map_err(gpu)?;
            }
            s.synchronize().map_err(gpu)?;
            let hidden = self.read_tapped(taps.len(), total)?;
            let mut starts = Vec::with_capacity(inputs.len());
            let mut acc = 0;
            for i in inputs {
                starts.push(acc);
                acc += i.num_logits;
            }
            return Ok(GpuForwardOutput {
                logits: out,
                logits_start: starts,
                vocab_size: vocab,
                hidden,
            });
        }
        // One sequence at a time, in chunks of max_rows tokens; logits for the rows asked for.
        let mut all = GpuForwardOutput {
            vocab_size: vocab,
            hidden: vec![Vec::new(); taps.len()],
            ..Default::default()
        };
        for inp in inputs {
            if inp.num_logits > self.max_logit_rows {
                return Err(ModelError::InvalidRequest(format!(
                    "asked for {} logits rows; the GPU model returns at most {} per sequence",
                    inp.num_logits, self.max_logit_rows
                )));
            }
            all.logits_start.push(all.logits.len() / vocab);
            let first_logit = inp.tokens.len().saturating_sub(inp.num_logits);
            for (ci, chunk) in inp.tokens.chunks(self.opts.max_rows).enumerate() {
                let start = ci * self.opts.max_rows;
                let end = start + chunk.len();
                let num_logits = end.saturating_sub(first_logit.max(start));
                let o = self.forward_tapped(
                    &[GpuSeqInput {
                        seq: inp.seq,
                        tokens: chunk,
                        num_logits,
                    }],
                    taps,
                )?;
                all.logits.extend_from_slice(&o.logits);
                for (dst, src) in all.hidden.iter_mut().zip(&o.hidden) {
                    dst.extend_from_slice(src);
                }
            }
        }
        Ok(all)
    }

    /// One step with the greedy token of every logits row as the result (the benchmark's step: the
    /// logits stay on the device, only the ids come back). One launch: unlike `forward`, it does not
    /// split inputs of more than `max_rows` rows, so callers prefill long inputs first
    /// (`ModelDrafter` does).
    pub fn step_argmax(&mut self, inputs: &[GpuSeqInput<'_>]) -> Result<Vec<u32>, ModelError> {
        let (n, _) = self.run(inputs, true)?;
        let mut ids = vec![0u32; n];
        let s = self.device.stream.clone();
        s.memcpy_dtoh(&self.buf.argmax.slice(..n), &mut ids)
            .map_err(gpu)?;
        s.synchronize().map_err(gpu)?;
        Ok(ids)
    }

    /// As `step_argmax` but always launched kernel by kernel (for comparing with the graph path).
    pub fn step_argmax_direct(
        &mut self,
        inputs: &[GpuSeqInput<'_>],
    ) -> Result<Vec<u32>, ModelError> {
        let (n, _) = self.run(inputs, false)?;
        let mut ids = vec![0u32; n];
        let s = self.device.stream.clone();
        s.memcpy_dtoh(&self.buf.argmax.slice(..n), &mut ids)
            .map_err(gpu)?;
        s.synchronize().map_err(gpu)?;
        Ok(ids)
    }

    /// Device time of one replay of the captured graph of a shape (CUDA events): `batches` samples,
    /// each the mean over 10 replays queued back to back, so host launch gaps are hidden and the number
    /// is the GPU's own time per step. The inputs are those of the last step, so the replays rewrite
    /// the same cache slots with the same values. None when that shape has no graph yet.
    pub fn time_graph_replays(
        &self,
        batch: usize,
        tokens: usize,
        logits: usize,
        batches: usize,
    ) -> Result<Option<Vec<f64>>, ModelError> {
        const PER_SAMPLE: usize = 10;
        let bucket = batch_bucket(batch, self.opts.max_sequences);
        let key = (
            bucket,
            tokens,
            logits,
            Vec::new(),
            self.graph_uses_fused(bucket, tokens, logits),
        );
        let Some(OwnedGraph(graph)) = self.graphs.get(&key) else {
            return Ok(None);
        };
        let s = &self.device.stream;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.device.ctx.new_event(flags).map_err(gpu)?;
        let end = self.device.ctx.new_event(flags).map_err(gpu)?;
        for _ in 0..3 {
            graph.launch().map_err(gpu)?;
        }
        let mut times = Vec::with_capacity(batches);
        for _ in 0..batches.max(1) {
            start.record(s).map_err(gpu)?;
            for _ in 0..PER_SAMPLE {
                graph.launch().map_err(gpu)?;
            }
            end.record(s).map_err(gpu)?;
            times.push(start.elapsed_ms(&end).map_err(gpu)? as f64 / PER_SAMPLE as f64);
        }
        Ok(Some(times))
    }

    /// Why graphs were switched off (a failed capture), if they were.
    pub fn graph_error(&self) -> Option<&str> {
        self.graph_error.as_deref()
    }

    /// How the most recent `run` of this shape would go: whether a graph exists for it.
    pub fn has_graph(&self, batch: usize, tokens: usize, logits: usize) -> bool {
        let bucket = batch_bucket(batch, self.opts.max_sequences);
        let fused = self.graph_uses_fused(bucket, tokens, logits);
        self.graphs
            .contains_key(&(bucket, tokens, logits, Vec::new(), fused))
    }

    /// Validates, grows the sequences' blocks, copies the packed inputs to the device and runs the
    /// step (graph or direct). Returns the logits rows computed and the path taken. On error the
    /// sequences are left as they were.
    fn run(
        &mut self,
        inputs: &[GpuSeqInput<'_>],
        allow_graph: bool,
    ) -> Result<(usize, StepPath), ModelError> {
        let c = &self.config;
        if inputs.is_empty() {
            return Err(ModelError::InvalidRequest(
                "a GPU forward needs at least one sequence".into(),
            ));
        }
        let mut seen = vec![false; self.seqs.len()];
        let mut starts = Vec::with_capacity(inputs.len());
        for inp in inputs {
            let st = self.seq(inp.seq)?;
            if std::mem::replace(&mut seen[inp.seq], true) {
                return Err(ModelError::InvalidRequest(format!(
                    "GPU sequence {} appears twice in one forward",
                    inp.seq
                )));
            }
            if inp.tokens.is_empty() || inp.num_logits > inp.tokens.len() {
                return Err(ModelError::InvalidRequest(format!(
                    "a sequence has {} new tokens and asks for {} logits rows",
                    inp.tokens.len(),
                    inp.num_logits
                )));
            }
            if let Some(&id) = inp.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(ModelError::TokenOutOfRange {
                    id,
                    vocab_size: c.vocab_size,
                });
            }
            let needed = st.len + inp.tokens.len();
            let limit = self.opts.max_positions.min(c.max_position_embeddings);
            if needed > limit {
                return Err(ModelError::ContextOverflow { needed, limit });
            }
            starts.push(st.len);
        }
        let rows: usize = inputs.iter().map(|i| i.tokens.len()).sum();
        let n_logits: usize = inputs.iter().map(|i| i.num_logits).sum();
        if rows > self.opts.max_rows || n_logits > self.max_logit_rows {
            return Err(ModelError::InvalidRequest(format!(
                "{rows} rows / {n_logits} logits rows in one GPU launch (limits {} / {})",
                self.opts.max_rows, self.max_logit_rows
            )));
        }
        // Graph shape: every sequence with the same token and logits counts.
        let t = inputs[0].tokens.len();
        let lg = inputs[0].num_logits;
        let uniform = inputs
            .iter()
            .all(|i| i.tokens.len() == t && i.num_logits == lg);
        let graph_shape = (allow_graph
            && self.graph_error.is_none()
            && uniform
            && t <= MAX_GRAPH_TOKENS
            && lg >= 1)
            .then(|| (batch_bucket(inputs.len(), self.opts.max_sequences), t, lg));

        // Blocks for the new positions (all or nothing).
        let blocks_needed: usize = inputs
            .iter()
            .zip(&starts)
            .map(|(i, &s)| {
                (s + i.tokens.len())
                    .div_ceil(GPU_BLOCK_SIZE)
                    .saturating_sub(self.seqs[i.seq].as_ref().map_or(0, |x| x.blocks.len()))
            })
            .sum();
        if blocks_needed > self.free_blocks.len() {
            return Err(ModelError::InvalidRequest(format!(
                "GPU KV cache exhausted: {blocks_needed} blocks needed, {} free",
                self.free_blocks.len()
            )));
        }
        for (inp, &s) in inputs.iter().zip(&starts) {
            let want = (s + inp.tokens.len()).div_ceil(GPU_BLOCK_SIZE);
            let st = self.seqs[inp.seq].as_mut().expect("checked");
            while st.blocks.len() < want {
                st.blocks.push(self.free_blocks.pop().expect("counted"));
            }
        }

        // Packed inputs (padded rows of a bucket: token 0 at position 0 in the trash block).
        let lay = self.layout;
        let (bsz, mb, trash) = (GPU_BLOCK_SIZE, self.max_blocks, self.trash_block as i32);
        let (batch, rows_total, logits_total) = match graph_shape {
            Some((bucket, t, lg)) => (bucket, bucket * t, bucket * lg),
            None => (inputs.len(), rows, n_logits),
        };
        let h = &mut self.host_inputs;
        let mut row = 0;
        let mut lrow = 0;
        for b in 0..batch {
            let table = &mut h[lay.block_tables + b * mb..lay.block_tables + (b + 1) * mb];
            table.fill(trash);
            if let Some(inp) = inputs.get(b) {
                let st = self.seqs[inp.seq].as_ref().expect("checked");
                for (dst, &blk) in table.iter_mut().zip(&st.blocks) {
                    *dst = blk as i32;
                }
                let n = inp.tokens.len();
                for (j, &tok) in inp.tokens.iter().enumerate() {
                    let pos = starts[b] + j;
                    h[lay.tokens + row] = tok as i32;
                    h[lay.positions + row] = pos as i32;
                    h[lay.slots + row] = (st.blocks[pos / bsz] as usize * bsz + pos % bsz) as i32;
                    h[lay.row_table + row] = b as i32;
                    if j >= n - inp.num_logits {
                        h[lay.logit_rows + lrow] = row as i32;
                        lrow += 1;
                    }
                    row += 1;
                }
            } else if let Some((_, t, lg)) = graph_shape {
                for j in 0..t {
                    h[lay.tokens + row] = 0;
                    h[lay.positions + row] = j as i32;
                    h[lay.slots + row] = trash * bsz as i32 + j as i32;
                    h[lay.row_table + row] = b as i32;
                    if j >= t - lg {
                        h[lay.logit_rows + lrow] = row as i32;
                        lrow += 1;
                    }
                    row += 1;
                }
            }
        }
        debug_assert_eq!((row, lrow), (rows_total, logits_total));
        let s = self.device.stream.clone();
        s.memcpy_htod(&self.host_inputs, &mut self.buf.inputs)
            .map_err(gpu)?;

        // The fused kernel or the standard launches (counts the fallback reason when the fused backend
        // is selected but cannot take this step); part of the graph key, so each keeps its own graph.
        let keys = inputs
            .iter()
            .zip(&starts)
            .map(|(i, &start)| start + i.tokens.len())
            .max()
            .unwrap_or(0);
        let fused = match self.fused_decision(inputs, batch, keys) {
            FusedDecision::Standard => false,
            FusedDecision::Fused => true,
            FusedDecision::Measure(key) => {
                let timing = self.time_both_backends(graph_shape, rows_total, logits_total)?;
                self.record_shape_timing(key, timing)
            }
        };
        let graph_key = graph_shape.map(|(b, t, lg)| (b, t, lg, self.step_taps.clone(), fused));
        let path = match graph_key {
            Some(key) if self.graphs.contains_key(&key) => {
                self.graphs[&key].0.launch().map_err(gpu)?;
                StepPath::Graph
            }
            Some(key) => {
                // Run it directly (this is the step's result), then capture the same launches.
                self.encode(rows_total, logits_total)?;
                match capture_graph(&s, || self.encode(rows_total, logits_total)) {
                    Ok(graph) => {
                        self.graphs.insert(key, graph);
                        StepPath::Captured
                    }
                    Err(e) => {
                        self.graph_error = Some(e.to_string());
                        StepPath::Direct
                    }
                }
            }
            None => {
                self.encode(rows_total, logits_total)?;
                StepPath::Direct
            }
        };
        for (inp, &start) in inputs.iter().zip(&starts) {
            self.seqs[inp.seq].as_mut().expect("checked").len = start + inp.tokens.len();
        }
        Ok((n_logits, path))
    }

    /// `FusedShapes::Measured`'s timing of a step shape not timed yet, on the inputs `run` has just
    /// copied to the device: each backend's graph of the shape is captured (where the shape has
    /// graphs and they work), then samples of a few back-to-back launches alternate between the
    /// backends, timed by CUDA events; medians after warm-up samples, as many as
    /// `ShapeTimingPlan::DEFAULT` needs to tell the backends apart. Every launch rewrites the same
    /// cache slots from the same inputs, so the step's own launch afterwards (`run`, on the backend
    /// that won) leaves the state as a single step would. Direct steps are timed as they run,
    /// host launch gaps included.
    fn time_both_backends(
        &mut self,
        graph_shape: Option<(usize, usize, usize)>,
        rows: usize,
        n_logits: usize,
    ) -> Result<ShapeTiming, ModelError> {
        let plan = fused::ShapeTimingPlan::DEFAULT;
        let s = self.device.stream.clone();
        let key_of = |this: &Self, fused: bool| {
            graph_shape.map(|(b, t, lg)| (b, t, lg, this.step_taps.clone(), fused))
        };
        for fused in [false, true] {
            self.fused.set_this_step(fused);
            if let Some(key) = key_of(self, fused) {
                if self.graph_error.is_none() && !self.graphs.contains_key(&key) {
                    self.encode(rows, n_logits)?;
                    match capture_graph(&s, || self.encode(rows, n_logits)) {
                        Ok(graph) => {
                            self.graphs.insert(key, graph);
                        }
                        Err(e) => self.graph_error = Some(e.to_string()),
                    }
                }
            }
        }
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.device.ctx.new_event(flags).map_err(gpu)?;
        let end = self.device.ctx.new_event(flags).map_err(gpu)?;
        let mut ms: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        for sample in 0..plan.warmup + plan.max_samples {
            for fused in [false, true] {
                self.fused.set_this_step(fused);
                let key = key_of(self, fused).filter(|k| self.graphs.contains_key(k));
                start.record(&s).map_err(gpu)?;
                for _ in 0..plan.per_sample {
                    match &key {
                        Some(k) => self.graphs[k].0.launch().map_err(gpu)?,
                        None => self.encode(rows, n_logits)?,
                    }
                }
                end.record(&s).map_err(gpu)?;
                let t = start.elapsed_ms(&end).map_err(gpu)? as f64 / plan.per_sample as f64;
                if sample >= plan.warmup {
                    ms[fused as usize].push(t);
                }
            }
            if plan.settled(&ms[0], &ms[1]) {
                break;
            }
        }
        Ok(ShapeTiming {
            standard_ms: fused::median_ms(&ms[0]),
            fused_ms: fused::median_ms(&ms[1]),
        })
    }

    /// Launches one forward over `rows` packed input rows with logits for `n_logits` of them. Reads
    /// only device buffers and launch-time sizes, so it can be captured into a graph. The step's own
    /// kernels go out with programmatic dependent launch where the device has it (launch.rs): each
    /// may start during the previous kernel's tail and waits inside for its results.
    fn encode(&mut self, rows: usize, n_logits: usize) -> Result<(), ModelError> {
        if self.fused.runs_this_step() {
            return self.encode_fused(rows, n_logits);
        }
        let c = &self.config;
        let stream = self.device.stream.clone();
        let s = &*stream;
        let ab = self.ablation;
        let pdl = self.device.pdl || (ab.force_pdl && self.device.pdl_capable);
        let paired = self.paired_gate_up;
        let whole_row_attention = self.whole_row_attention_for(rows);
        let k = &self.k;
        let gemm = &self.gemm;
        let lay = self.layout;
        let buf = &mut self.buf;
        let (taps, tap_buf, max_rows) = (&self.step_taps, &mut self.tap_buf, self.opts.max_rows);
        let (h, qd, kvd, hd, ffn) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.head_dim,
            c.intermediate_size,
        );
        let width = qd + 2 * kvd;
        let (h_i, w_i, hd_i, eps) = (
            KernelArg::i32(h as i32),
            KernelArg::i32(width as i32),
            KernelArg::i32(hd as i32),
            KernelArg::f32(c.rms_norm_eps),
        );
        let (nh_i, nkv_i) = (
            KernelArg::i32(c.num_heads as i32),
            KernelArg::i32(c.num_kv_heads as i32),
        );
        let (rows_i, ffn_i) = (KernelArg::i32(rows as i32), KernelArg::i32(ffn as i32));
        let scale = KernelArg::f32(1.0 / (hd as f32).sqrt());
        let arg = |p: &CudaView<'_, i32>| KernelArg::buf(p, s);
        let tokens = arg(&buf.inputs.slice(lay.tokens..lay.tokens + rows));
        let positions = arg(&buf.inputs.slice(lay.positions..lay.positions + rows));
        let slots = arg(&buf.inputs.slice(lay.slots..lay.slots + rows));
        let row_table = arg(&buf.inputs.slice(lay.row_table..lay.row_table + rows));
        let logit_rows = arg(&buf.inputs.slice(lay.logit_rows..lay.logit_rows + n_logits));
        let tables = arg(&buf.inputs.slice(lay.block_tables..lay.len));
        let (x, act16, qkv) = (
            KernelArg::buf(&buf.x, s),
            KernelArg::buf(&buf.act16, s),
            KernelArg::buf(&buf.qkv, s),
        );
        let elems = |n: usize| LaunchConfig::for_num_elems(n as u32);
        let blas = |e: CudaError| ModelError::Gpu(e.to_string());
        // SAFETY (every launch below): buffers were allocated at construction for max_rows rows and
        // max_logit_rows logits rows (run() checked rows and n_logits against them), arguments follow
        // the order and types of decoder.cu's signatures, and every kernel launched here keeps the PDL
        // contract (it waits before touching anything an earlier kernel wrote).
        let go = |f: &CudaFunction, cfg: LaunchConfig, args: &[KernelArg]| {
            unsafe { launch(s, f, cfg, args, pdl) }.map_err(gpu)
        };

        go(
            &k.embed_rows,
            rows_cfg(rows, 128),
            &[KernelArg::buf(&self.embed, s), tokens, x, h_i],
        )?;
        for (li, l) in self.layers.iter_mut().enumerate() {
            let norm =
                |w: &CudaSlice<f32>| [x, KernelArg::null(), KernelArg::buf(w, s), act16, h_i, eps];
            if !ab.skip_norms {
                go(&k.rms_norm_bf16, rows_cfg(rows, 256), &norm(&l.attn_norm))?;
            }
            if !ab.skip_layer_linears {
                gemm.linear(&l.wqkv, &buf.act16, &mut buf.qkv, width, h, rows)
                    .map_err(blas)?;
            }
            if let Some(bq) = &l.bqkv {
                let args = [qkv, KernelArg::buf(bq, s), rows_i, w_i];
                go(&k.add_bias_rows, elems(rows * width), &args)?;
            }
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                for (w, off, heads) in [(qn, 0, c.num_heads), (kn, qd, c.num_kv_heads)] {
                    let args = [
                        qkv,
                        w_i,
                        KernelArg::i32(off as i32),
                        KernelArg::buf(w, s),
                        hd_i,
                        eps,
                    ];
                    go(&k.head_rms_norm, grid_cfg(rows, heads, 128), &args)?;
                }
            }
            let heads = c.num_heads + 2 * c.num_kv_heads;
            if !ab.skip_rope_kv {
                go(
                    &k.rope_kv_append,
                    grid_cfg(rows, heads, (hd / 2) as u32),
                    &[
                        qkv,
                        w_i,
                        nh_i,
                        nkv_i,
                        hd_i,
                        positions,
                        KernelArg::buf(&self.inv_freq, s),
                        slots,
                        KernelArg::buf(&l.k_cache, s),
                        KernelArg::buf(&l.v_cache, s),
                    ],
                )?;
            }
            for _ in 0..(!ab.skip_attention as usize) * (1 + ab.double_attention as usize) {
                let common = [
                    qkv,
                    w_i,
                    nh_i,
                    nkv_i,
                    hd_i,
                    positions,
                    row_table,
                    KernelArg::i32(self.max_blocks as i32),
                    tables,
                    KernelArg::i32(GPU_BLOCK_SIZE as i32),
                    KernelArg::buf(&l.k_cache, s),
                    KernelArg::buf(&l.v_cache, s),
                    act16,
                    scale,
                ];
                if whole_row_attention {
                    let mut args = common.to_vec();
                    args.push(KernelArg::i32((self.max_blocks * GPU_BLOCK_SIZE) as i32));
                    let cfg = LaunchConfig {
                        grid_dim: (rows as u32, c.num_kv_heads as u32, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: self.attention_smem as u32,
                    };
                    go(&k.attention_whole_row, cfg, &args)?;
                } else {
                    let mut args = common.to_vec();
                    args.push(KernelArg::buf(&buf.attn_partials, s));
                    args.push(KernelArg::buf(&buf.attn_counters, s));
                    let cfg = LaunchConfig {
                        grid_dim: (rows as u32, c.num_kv_heads as u32, ATTN_MAX_SPLITS as u32),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: self.attention_split_smem as u32,
                    };
                    go(&k.attention, cfg, &args)?;
                }
            }
            // O projection added onto the residual stream.
            if !ab.skip_layer_linears {
                gemm.linear_acc(&l.wo, &buf.act16, &mut buf.x, h, qd, rows, true)
                    .map_err(blas)?;
            }
            if let Some(bo) = &l.bo {
                let args = [x, KernelArg::buf(bo, s), rows_i, h_i];
                go(&k.add_bias_rows, elems(rows * h), &args)?;
            }
            if !ab.skip_norms {
                go(&k.rms_norm_bf16, rows_cfg(rows, 256), &norm(&l.ffn_norm))?;
            }
            if ab.skip_layer_linears {
                continue;
            }
            if paired {
                // Gate/up with SwiGLU fused (or cuBLAS + the paired SwiGLU kernel, as tuned).
                gemm.linear_swiglu(
                    &l.w_gate_up,
                    &buf.act16,
                    &mut buf.gate_up,
                    &mut buf.ffn_act16,
                    2 * ffn,
                    h,
                    rows,
                )
                .map_err(blas)?;
            } else {
                gemm.linear(&l.w_gate_up, &buf.act16, &mut buf.gate_up, 2 * ffn, h, rows)
                    .map_err(blas)?;
                let args = [
                    KernelArg::buf(&buf.gate_up, s),
                    KernelArg::buf(&buf.ffn_act16, s),
                    rows_i,
                    ffn_i,
                ];
                go(&k.swiglu_bf16, elems(rows * ffn), &args)?;
            }
            gemm.linear_acc(&l.w_down, &buf.ffn_act16, &mut buf.x, h, ffn, rows, true)
                .map_err(blas)?;
            copy_tapped_output(&stream, &buf.x, taps, li, tap_buf, rows * h, max_rows * h)?;
        }
        // Final norm of the logits rows only, LM head, greedy ids (none for a prefill chunk that
        // needs no logits).
        if n_logits == 0 || ab.skip_head {
            return Ok(());
        }
        let args = [
            x,
            logit_rows,
            KernelArg::buf(&self.final_norm, s),
            act16,
            h_i,
            eps,
        ];
        go(&k.rms_norm_bf16, rows_cfg(n_logits, 256), &args)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        gemm.linear(head, &buf.act16, &mut buf.logits, c.vocab_size, h, n_logits)
            .map_err(blas)?;
        let args = [
            KernelArg::buf(&buf.logits, s),
            KernelArg::i32(c.vocab_size as i32),
            KernelArg::buf(&buf.argmax, s),
        ];
        go(&k.argmax_rows, rows_cfg(n_logits, 1024), &args)?;
        Ok(())
    }
}

/// After layer `layer`: copies the residual stream (`x`, its first `n` values: the step's rows) into
/// every tap slot that asked for this layer (slot `i` starts at `i * slot_len`). A device-to-device
/// copy on the step's stream, so it is captured into graphs like the kernels around it; like cuBLAS
/// it is no PDL launch, so it waits for the layer's last kernel and the next kernel waits for it.
fn copy_tapped_output(
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    x: &CudaSlice<f32>,
    taps: &[usize],
    layer: usize,
    tap_buf: &mut CudaSlice<f32>,
    n: usize,
    slot_len: usize,
) -> Result<(), ModelError> {
    for (slot, _) in taps.iter().enumerate().filter(|&(_, &t)| t == layer) {
        let mut dst = tap_buf.slice_mut(slot * slot_len..slot * slot_len + n);
        s.memcpy_dtod(&x.slice(..n), &mut dst).map_err(gpu)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_pad_to_a_power_of_two_within_the_sequence_limit() {
        assert_eq!(batch_bucket(1, 8), 1);
        assert_eq!(batch_bucket(3, 8), 4);
        assert_eq!(batch_bucket(8, 8), 8);
        // A limit that is no power of two is a bucket of its own.
        assert_eq!(batch_bucket(5, 6), 6);
        assert_eq!(batch_bucket(6, 6), 6);
    }

    #[test]
    fn input_sections_do_not_overlap() {
        let l = InputLayout::new(64, 4, 10);
        let starts = [
            l.tokens,
            l.positions,
            l.slots,
            l.row_table,
            l.logit_rows,
            l.block_tables,
        ];
        assert!(starts.windows(2).all(|w| w[1] - w[0] == 64));
        assert_eq!(l.len, l.block_tables + 4 * 10);
    }
}
