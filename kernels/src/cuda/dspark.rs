//! Host side of `kernels/cuda/dspark.cu`: the DSpark drafter's non-causal block attention and its fused
//! Markov loop (one launch for every slot of every sequence). The drafter crate runs the rest of the
//! block pass with `decoder.cu`'s kernels and [`super::Gemm`].
//!
//! `dspark.cu` is compiled appended to `sampling.cu` (see [`super::KERNEL_SOURCES`]) so that the loop
//! turns each slot's logits into the draft distribution with the very device code of
//! `logits_to_probs`, which `gpu_sampling_check` holds to the CPU semantics of
//! [`crate::sampling::probabilities`].

use super::{compile_source, CudaError, GpuDevice};
use crate::sampling::SamplingParams;
use cudarc::driver::{
    sys, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// The kernels `dspark.cu` must export (checked at load, and for every architecture by the compile test).
pub const DSPARK_KERNELS: &[&str] = &[
    "dspark_block_attention",
    "dspark_qk_norm_rope_append",
    "dspark_markov_loop",
    "dspark_markov_cluster",
];
/// CTAs per sequence of the cluster Markov loop (`DSP_CLUSTER`).
pub const MARKOV_CLUSTER: usize = 8;
/// Padding of a W2 row in the cluster loop's shared memory, in bf16 entries (`DSP_W2_PAD`).
const W2_PAD: usize = 8;

/// Ints per sequence of the Markov loop's integer parameters: anchor, slots, top_k, limit.
pub const SEQ_INTS: usize = 4;
/// Floats per sequence: temperature, top_p, confidence threshold (< 0: none).
pub const SEQ_FLOATS: usize = 3;
/// Ints per sequence of the loop's status record: code, detail, failing slot, slots drafted.
pub const STATUS_INTS: usize = 4;
/// Threads per CTA of the attention kernel (`DSP_ATTN_THREADS`).
const ATTN_THREADS: u32 = 256;
/// Threads per CTA of the Markov loop: `row_logits_to_probs` is written for exactly this many.
const MARKOV_THREADS: u32 = 256;
/// Most query heads per KV head the attention kernel serves (`DSP_MAX_GROUP`).
pub const MAX_GROUP: usize = 8;
/// Largest head_dim of the attention kernel (one thread per dimension in its last phase).
pub const MAX_HEAD_DIM: usize = 256;
/// Largest Markov rank: the loop keeps `W1[prev]` in shared memory beside `logits_to_probs`'s ~36 KB,
/// under the 48 KB a launch gets without opting in.
pub const MAX_RANK: usize = 2048;

// Status codes (sampling.cu's SPL_* for the probability step, dspark.cu's DSP_* for the loop).
const SPL_OK: i32 = 0;
const SPL_NON_FINITE_LOGIT: i32 = 1;
const SPL_ALL_MASKED: i32 = 2;
const SPL_BAD_BLOCK: i32 = 3;
const DSP_BAD_TOKEN: i32 = 20;
const DSP_NOTHING_ALLOWED: i32 = 21;

/// Why the Markov loop stopped a sequence early (the CPU drafter's errors that depend on device data).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MarkovFailure {
    #[error("slot {slot}: logit {index} is NaN or +inf: the model produced a non-finite value")]
    NonFiniteLogit { slot: usize, index: usize },
    #[error("slot {slot}: every logit is -inf: nothing can be drafted")]
    AllMasked { slot: usize },
    #[error("the Markov loop ran with {0} threads per sequence (needs {MARKOV_THREADS})")]
    BadBlock(i32),
    #[error("slot {slot}: previous token {token} is outside the vocabulary")]
    BadToken { slot: usize, token: i32 },
    #[error("no token of the pruned draft vocabulary is below the vocabulary limit")]
    NothingAllowed,
    #[error("unknown status {code} (detail {detail}): kernel and host disagree on the codes")]
    Unknown { code: i32, detail: i32 },
}

/// Decodes one sequence's status record: the number of slots drafted, or why it failed.
pub fn decode_markov_status(rec: &[i32]) -> Result<usize, MarkovFailure> {
    let (code, detail, slot, drafted) = match rec {
        [a, b, c, d, ..] => (*a, *b, (*c).max(0) as usize, *d),
        _ => {
            return Err(MarkovFailure::Unknown {
                code: -1,
                detail: -1,
            })
        }
    };
    match code {
        SPL_OK if drafted >= 0 => Ok(drafted as usize),
        SPL_NON_FINITE_LOGIT => Err(MarkovFailure::NonFiniteLogit {
            slot,
            index: detail.max(0) as usize,
        }),
        SPL_ALL_MASKED => Err(MarkovFailure::AllMasked { slot }),
        SPL_BAD_BLOCK => Err(MarkovFailure::BadBlock(detail)),
        DSP_BAD_TOKEN => Err(MarkovFailure::BadToken {
            slot,
            token: detail,
        }),
        DSP_NOTHING_ALLOWED => Err(MarkovFailure::NothingAllowed),
        _ => Err(MarkovFailure::Unknown { code, detail }),
    }
}

/// One sequence's Markov-loop parameters, packed by [`pack_markov_params`].
#[derive(Debug, Clone, Copy)]
pub struct MarkovSeqParams {
    /// The block's anchor (the previous token of slot 0), a target id.
    pub anchor: u32,
    /// Slots to draft (<= the block size).
    pub slots: usize,
    pub sampling: SamplingParams,
    /// Without a pruned vocabulary: the row length min(vocab_limit, vocab). With one: vocab_limit
    /// (draft ids whose target id is below it are kept).
    pub limit: usize,
    /// Stop before the first slot whose sigmoid(confidence logit) is below this.
    pub confidence_threshold: Option<f32>,
}

/// Packs per-sequence parameters into the loop's `seq_i` and `seq_f` layouts, validating the sampling
/// settings as the CPU does.
pub fn pack_markov_params(
    seqs: &[MarkovSeqParams],
) -> Result<(Vec<i32>, Vec<f32>), crate::sampling::SamplingError> {
    let mut ints = Vec::with_capacity(seqs.len() * SEQ_INTS);
    let mut floats = Vec::with_capacity(seqs.len() * SEQ_FLOATS);
    for s in seqs {
        s.sampling.validate()?;
        let clamp = |v: usize| v.min(i32::MAX as usize) as i32;
        ints.extend_from_slice(&[
            s.anchor.min(i32::MAX as u32) as i32,
            clamp(s.slots),
            clamp(s.sampling.top_k),
            clamp(s.limit),
        ]);
        floats.extend_from_slice(&[
            s.sampling.temperature,
            s.sampling.top_p,
            s.confidence_threshold.unwrap_or(-1.0),
        ]);
    }
    Ok((ints, floats))
}

/// Arguments of [`DSparkKernels::qk_norm_rope_append`]: `rows` rows of `qkv` (`row_stride` floats:
/// `n_heads` q heads, `n_kv_heads` k heads, `n_kv_heads` v heads of `head_dim`); q and k heads are
/// RMS-normed with `q_norm` / `k_norm` (`[head_dim]`) and rotated at `positions[row]` (q in place, k into
/// the context), v copied; context row `slots[row]` of `k_ctx` / `v_ctx` (`[*, n_kv_heads * head_dim]`).
pub struct QkNormRopeAppend<'a> {
    pub rows: usize,
    pub qkv: &'a mut CudaSlice<f32>,
    pub row_stride: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub q_norm: &'a CudaSlice<f32>,
    pub k_norm: &'a CudaSlice<f32>,
    pub eps: f32,
    pub positions: &'a CudaView<'a, i32>,
    /// `[head_dim / 2]` RoPE inverse frequencies.
    pub inv_freq: &'a CudaSlice<f64>,
    pub slots: &'a CudaView<'a, i32>,
    pub k_ctx: &'a mut CudaSlice<f32>,
    pub v_ctx: &'a mut CudaSlice<f32>,
}

/// Arguments of [`DSparkKernels::block_attention`]: `rows` block rows whose q (RoPE applied) are the
/// first `n_heads * head_dim` columns of `qkv` rows of `row_stride` floats; row i of the block attends
/// to keys `0..key_counts[i]` of sequence slot `seq_of_row[i]` in `k_ctx`/`v_ctx`
/// (`[slots * max_ctx, kv_dim]`). Writes `[rows, n_heads * head_dim]` bf16 into `out`.
pub struct BlockAttention<'a> {
    pub rows: usize,
    pub qkv: &'a CudaSlice<f32>,
    pub row_stride: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub key_counts: &'a CudaView<'a, i32>,
    pub seq_of_row: &'a CudaView<'a, i32>,
    pub max_ctx: usize,
    pub k_ctx: &'a CudaSlice<f32>,
    pub v_ctx: &'a CudaSlice<f32>,
    pub out: &'a mut CudaSlice<u16>,
    pub scale: f32,
}

/// Arguments of [`DSparkKernels::markov_loop`] for `batch` sequences of `g`-slot blocks (row
/// r = b * g + j). Optional tensors are `None` when the checkpoint lacks them.
pub struct MarkovLoop<'a> {
    /// From [`DSparkKernels::choose_markov`].
    pub kernel: MarkovKernel,
    pub batch: usize,
    pub g: usize,
    /// Draft vocabulary (columns of the logits rows).
    pub vd: usize,
    /// Target vocabulary (ids `prev` may take).
    pub vocab: usize,
    pub hidden_dim: usize,
    pub rank: usize,
    /// `[rows, vd]` base logits and `[rows, hidden_dim]` final hidden states of the block pass.
    pub base_logits: &'a CudaSlice<f32>,
    pub hidden: &'a CudaSlice<f32>,
    /// `[w1 rows, rank]` bf16; `w1_row_of_token` (`[vocab]`, -1 = none) when W1 is indexed by draft ids.
    pub w1: &'a CudaSlice<u16>,
    pub w1_row_of_token: Option<&'a CudaSlice<i32>>,
    /// `[vd, rank]` bf16.
    pub w2: &'a CudaSlice<u16>,
    /// `[hidden_dim (+ rank)]` and bias.
    pub confidence: Option<(&'a CudaSlice<f32>, f32)>,
    /// `[vd]` target id of each draft id, for a pruned draft vocabulary.
    pub draft_to_target: Option<&'a CudaSlice<i32>>,
    /// From [`pack_markov_params`]: `[batch, SEQ_INTS]`, `[batch, SEQ_FLOATS]`.
    pub seq_i: &'a CudaSlice<i32>,
    pub seq_f: &'a CudaSlice<f32>,
    /// `[rows]` uniforms (read only for sampled sequences).
    pub uniforms: &'a CudaSlice<f64>,
    pub corrected: &'a mut CudaSlice<f32>,
    /// `[rows, vd]` scratch (written only by the single-CTA kernel, with a pruned vocabulary).
    pub masked: &'a mut CudaSlice<f32>,
    pub probs: &'a mut CudaSlice<f32>,
    pub conf_out: &'a mut CudaSlice<f32>,
    pub tokens: &'a mut CudaSlice<i32>,
    /// `[batch, STATUS_INTS]`.
    pub status: &'a mut CudaSlice<i32>,
}

fn shape(msg: String) -> CudaError {
    CudaError::Shape(msg)
}

fn need(what: &str, len: usize, n: usize) -> Result<(), CudaError> {
    if len < n {
        return Err(shape(format!(
            "DSpark {what}: buffer of {len} elements, need {n}"
        )));
    }
    Ok(())
}

fn int(what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| shape(format!("DSpark {what} = {v} does not fit an int")))
}

/// Which kernel runs a Markov loop (see dspark.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkovKernel {
    /// `dspark_markov_loop`: one CTA per sequence; every sampling setting, every architecture.
    SingleCta,
    /// `dspark_markov_cluster`: [`MARKOV_CLUSTER`] CTAs per sequence sharing the row through
    /// distributed shared memory (sm_90 and later); rows without top-k / top-p only. `w2_shared`:
    /// each CTA keeps its slice of W2 in shared memory (needs rank % 8 == 0 and room), else reads it
    /// from global memory every slot.
    Cluster { w2_shared: bool },
}

/// The Markov kernel for a launch: the cluster loop when the device has one (`cluster_room`: the dynamic
/// shared memory it may use) and `cluster_ok` (no row uses top-k / top-p, and the caller allows it), with
/// W2 in shared memory when allowed, rank % 8 == 0 and it fits, else reading W2 from global memory when
/// the rest fits; otherwise the single-CTA loop.
pub fn markov_kernel_for(
    cluster_room: Option<usize>,
    vd: usize,
    rank: usize,
    cluster_ok: bool,
    allow_w2_shared: bool,
) -> MarkovKernel {
    let Some(room) = cluster_room else {
        return MarkovKernel::SingleCta;
    };
    if !cluster_ok || vd == 0 || rank == 0 {
        return MarkovKernel::SingleCta;
    }
    if allow_w2_shared
        && rank.is_multiple_of(8)
        && DSparkKernels::cluster_smem_bytes(vd, rank, true) <= room
    {
        MarkovKernel::Cluster { w2_shared: true }
    } else if DSparkKernels::cluster_smem_bytes(vd, rank, false) <= room {
        MarkovKernel::Cluster { w2_shared: false }
    } else {
        MarkovKernel::SingleCta
    }
}

impl MarkovSeqParams {
    /// Whether the cluster Markov loop serves this sequence: no top-k (0, or at least the row's
    /// `row_len` entries, which keeps every id) and no top-p.
    pub fn plain_row(&self, row_len: usize) -> bool {
        (self.sampling.top_k == 0 || self.sampling.top_k >= row_len) && self.sampling.top_p >= 1.0
    }
}

/// The DSpark kernels compiled for one device, launching on its stream.
pub struct DSparkKernels {
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    attention: CudaFunction,
    qk_norm_rope: CudaFunction,
    markov: CudaFunction,
    /// The cluster Markov loop and the dynamic shared memory it may use (sm_90 and later only).
    markov_cluster: Option<(CudaFunction, usize)>,
    /// Opt-in shared-memory limit of the device (bytes per block).
    smem_limit: usize,
    /// Dynamic shared memory the attention kernel is currently allowed.
    attention_smem: usize,
}

impl DSparkKernels {
    /// Compiles `dspark.cu` (with `sampling.cu`) for the device and loads its kernels.
    pub fn new(device: &GpuDevice) -> Result<DSparkKernels, CudaError> {
        let module = device
            .ctx
            .load_module(compile_source("dspark.cu", &device.arch)?)?;
        for k in DSPARK_KERNELS {
            module.load_function(k)?;
        }
        let smem_limit = device.ctx.attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )? as usize;
        // Thread-block clusters and distributed shared memory exist from sm_90; below, the kernel's
        // body traps and is never chosen.
        let major: u32 = device
            .arch
            .trim_start_matches("sm_")
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect::<String>()
            .parse()
            .unwrap_or(0)
            / 10;
        let markov_cluster = if major >= 9 {
            let f = module.load_function("dspark_markov_cluster")?;
            let dynamic = smem_limit.saturating_sub(f.shared_size_bytes()? as usize);
            f.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dynamic as i32,
            )?;
            Some((f, dynamic))
        } else {
            None
        };
        Ok(DSparkKernels {
            stream: device.stream.clone(),
            attention: module.load_function("dspark_block_attention")?,
            qk_norm_rope: module.load_function("dspark_qk_norm_rope_append")?,
            markov: module.load_function("dspark_markov_loop")?,
            markov_cluster,
            _module: module,
            smem_limit,
            attention_smem: 0,
        })
    }

    /// Dynamic shared memory of the attention kernel for this shape (see dspark.cu).
    pub fn attention_smem_bytes(group: usize, head_dim: usize, max_ctx: usize) -> usize {
        4 * (group * head_dim + group * max_ctx + ATTN_THREADS as usize * group + group)
    }

    /// Checks that the attention kernel can serve this shape and raises its shared-memory limit to
    /// what `max_ctx` needs (once, before any launch).
    pub fn prepare_attention(
        &mut self,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        max_ctx: usize,
    ) -> Result<(), CudaError> {
        if n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(shape(format!(
                "DSpark attention: {n_heads} query heads are not a multiple of {n_kv_heads} KV heads"
            )));
        }
        let group = n_heads / n_kv_heads;
        if group > MAX_GROUP || head_dim == 0 || head_dim > MAX_HEAD_DIM || max_ctx == 0 {
            return Err(shape(format!(
                "the GPU DSpark attention serves at most {MAX_GROUP} query heads per KV head and \
                 head_dim 1..={MAX_HEAD_DIM}, got {group} and {head_dim}; use the CPU drafter"
            )));
        }
        let smem = Self::attention_smem_bytes(group, head_dim, max_ctx);
        if smem > self.smem_limit {
            return Err(shape(format!(
                "GPU DSpark attention over {max_ctx} positions needs {smem} bytes of shared memory, \
                 over the device's {}: lower the context capacity",
                self.smem_limit
            )));
        }
        self.attention.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
        self.attention_smem = smem;
        Ok(())
    }

    /// Non-causal attention of block rows over their sequences' context and block keys/values.
    /// `key_counts` must lie in `1..=max_ctx` (the caller builds them from its own bookkeeping).
    pub fn block_attention(&self, a: BlockAttention<'_>) -> Result<(), CudaError> {
        if a.rows == 0 {
            return Ok(());
        }
        let group = a.n_heads / a.n_kv_heads.max(1);
        let smem = Self::attention_smem_bytes(group, a.head_dim, a.max_ctx);
        if smem > self.attention_smem || a.n_heads != group * a.n_kv_heads {
            return Err(shape(format!(
                "DSpark attention launched for {} heads / {} KV heads / head_dim {} / {} positions \
                 without prepare_attention for that shape",
                a.n_heads, a.n_kv_heads, a.head_dim, a.max_ctx
            )));
        }
        let q_width = a.n_heads * a.head_dim;
        let kv_dim = a.n_kv_heads * a.head_dim;
        if a.row_stride < q_width {
            return Err(shape(format!(
                "DSpark attention: rows of {} floats cannot hold {q_width} query columns",
                a.row_stride
            )));
        }
        need("qkv", a.qkv.len(), a.rows * a.row_stride)?;
        need("key counts", a.key_counts.len(), a.rows)?;
        need("row sequences", a.seq_of_row.len(), a.rows)?;
        need("attention output", a.out.len(), a.rows * q_width)?;
        if a.k_ctx.len() != a.v_ctx.len() || !a.k_ctx.len().is_multiple_of(a.max_ctx * kv_dim) {
            return Err(shape(format!(
                "DSpark context buffers of {} and {} floats are not slots of {} x {kv_dim}",
                a.k_ctx.len(),
                a.v_ctx.len(),
                a.max_ctx
            )));
        }
        let (stride, nh, nkv, hd, mc) = (
            int("row stride", a.row_stride)?,
            int("heads", a.n_heads)?,
            int("kv heads", a.n_kv_heads)?,
            int("head_dim", a.head_dim)?,
            int("context capacity", a.max_ctx)?,
        );
        let mut b = self.stream.launch_builder(&self.attention);
        b.arg(a.qkv)
            .arg(&stride)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(a.key_counts)
            .arg(a.seq_of_row)
            .arg(&mc)
            .arg(a.k_ctx)
            .arg(a.v_ctx)
            .arg(a.out)
            .arg(&a.scale);
        let cfg = LaunchConfig {
            grid_dim: (a.rows as u32, a.n_kv_heads as u32, 1),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: buffer sizes checked above; the caller guarantees key_counts in 1..=max_ctx and
        // sequence slots inside the context buffers; arguments in dspark_block_attention's order and
        // types.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The q/k head norms, RoPE and the K/V store of block rows in one launch (see dspark.cu).
    pub fn qk_norm_rope_append(&self, a: QkNormRopeAppend<'_>) -> Result<(), CudaError> {
        if a.rows == 0 {
            return Ok(());
        }
        let hd = a.head_dim;
        if hd == 0 || !hd.is_multiple_of(2) || hd > MAX_HEAD_DIM {
            return Err(shape(format!(
                "DSpark q/k norm + RoPE: head_dim {hd} must be even and at most {MAX_HEAD_DIM}"
            )));
        }
        let width = (a.n_heads + 2 * a.n_kv_heads) * hd;
        let kv_dim = a.n_kv_heads * hd;
        if a.row_stride < width {
            return Err(shape(format!(
                "DSpark q/k norm + RoPE: rows of {} floats cannot hold {width} q/k/v columns",
                a.row_stride
            )));
        }
        need("qkv", a.qkv.len(), a.rows * a.row_stride)?;
        need("q norm", a.q_norm.len(), hd)?;
        need("k norm", a.k_norm.len(), hd)?;
        need("positions", a.positions.len(), a.rows)?;
        need("context rows", a.slots.len(), a.rows)?;
        need("RoPE frequencies", a.inv_freq.len(), hd / 2)?;
        if a.k_ctx.len() != a.v_ctx.len() || !a.k_ctx.len().is_multiple_of(kv_dim) {
            return Err(shape(format!(
                "DSpark context buffers of {} and {} floats are not rows of {kv_dim}",
                a.k_ctx.len(),
                a.v_ctx.len()
            )));
        }
        let (stride, nh, nkv, hd_i) = (
            int("row stride", a.row_stride)?,
            int("heads", a.n_heads)?,
            int("kv heads", a.n_kv_heads)?,
            int("head_dim", hd)?,
        );
        let mut b = self.stream.launch_builder(&self.qk_norm_rope);
        b.arg(a.qkv)
            .arg(&stride)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd_i)
            .arg(a.q_norm)
            .arg(a.k_norm)
            .arg(&a.eps)
            .arg(a.positions)
            .arg(a.inv_freq)
            .arg(a.slots)
            .arg(a.k_ctx)
            .arg(a.v_ctx);
        let cfg = LaunchConfig {
            grid_dim: (a.rows as u32, (a.n_heads + 2 * a.n_kv_heads) as u32, 1),
            // Whole warps (the sum of squares is reduced with full-warp shuffles); <= 4 warps.
            block_dim: ((hd / 2).next_multiple_of(32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: buffer sizes checked above; the caller keeps context rows (slots) inside the context
        // buffers (its own bookkeeping, as for block_attention); arguments in
        // dspark_qk_norm_rope_append's order and types.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Dynamic shared memory of the cluster Markov loop (see dspark.cu).
    pub fn cluster_smem_bytes(vd: usize, rank: usize, w2_shared: bool) -> usize {
        let s = vd.div_ceil(MARKOV_CLUSTER);
        let w2 = if w2_shared {
            (s * (rank + W2_PAD) * 2).next_multiple_of(16)
        } else {
            0
        };
        w2 + 4 * (rank.next_multiple_of(4) + 2 * s)
    }

    /// The fastest Markov kernel that serves these rows: the cluster loop (W2 in shared memory when
    /// it fits) when the device has clusters, `allow_cluster` is set and no row uses top-k / top-p
    /// (`plain_rows`), else the single-CTA loop.
    pub fn choose_markov(
        &self,
        vd: usize,
        rank: usize,
        plain_rows: bool,
        allow_cluster: bool,
        allow_w2_shared: bool,
    ) -> MarkovKernel {
        markov_kernel_for(
            self.markov_cluster.as_ref().map(|(_, room)| *room),
            vd,
            rank,
            plain_rows && allow_cluster,
            allow_w2_shared,
        )
    }

    /// The fused Markov loop over every slot of every sequence (one launch).
    pub fn markov_loop(&self, a: MarkovLoop<'_>) -> Result<(), CudaError> {
        if a.batch == 0 {
            return Ok(());
        }
        if a.rank == 0 || a.rank > MAX_RANK {
            return Err(shape(format!(
                "the GPU Markov loop serves ranks 1..={MAX_RANK}, got {}",
                a.rank
            )));
        }
        let rows = a.batch * a.g;
        need("base logits", a.base_logits.len(), rows * a.vd)?;
        need("hidden", a.hidden.len(), rows * a.hidden_dim)?;
        need("W2", a.w2.len(), a.vd * a.rank)?;
        need("W1", a.w1.len(), a.rank)?;
        need("parameters", a.seq_i.len(), a.batch * SEQ_INTS)?;
        need("parameters", a.seq_f.len(), a.batch * SEQ_FLOATS)?;
        need("uniforms", a.uniforms.len(), rows)?;
        need("corrected logits", a.corrected.len(), rows * a.vd)?;
        need("probabilities", a.probs.len(), rows * a.vd)?;
        need("confidence logits", a.conf_out.len(), rows)?;
        need("tokens", a.tokens.len(), rows)?;
        need("status", a.status.len(), a.batch * STATUS_INTS)?;
        if a.draft_to_target.is_some() {
            need("masked logits", a.masked.len(), rows * a.vd)?;
        }
        if let Some(m) = a.draft_to_target {
            need("d2t", m.len(), a.vd)?;
        }
        if let Some(m) = a.w1_row_of_token {
            need("W1 rows of tokens", m.len(), a.vocab)?;
        }
        let conf_width = match &a.confidence {
            Some((w, _)) => {
                if w.len() != a.hidden_dim && w.len() != a.hidden_dim + a.rank {
                    return Err(shape(format!(
                        "DSpark confidence head of width {} for hidden {} and rank {}",
                        w.len(),
                        a.hidden_dim,
                        a.rank
                    )));
                }
                w.len()
            }
            None => 0,
        };
        let (g, vd, vocab, hd, rank, cw) = (
            int("block size", a.g)?,
            int("draft vocabulary", a.vd)?,
            int("vocabulary", a.vocab)?,
            int("hidden", a.hidden_dim)?,
            int("rank", a.rank)?,
            int("confidence width", conf_width)?,
        );
        let null: u64 = 0;
        let conf_b = a.confidence.as_ref().map_or(0.0, |c| c.1);
        let (function, cfg, w2_shared) = match a.kernel {
            MarkovKernel::SingleCta => (
                &self.markov,
                LaunchConfig {
                    grid_dim: (a.batch as u32, 1, 1),
                    block_dim: (MARKOV_THREADS, 1, 1),
                    shared_mem_bytes: (4 * a.rank) as u32,
                },
                None,
            ),
            MarkovKernel::Cluster { w2_shared } => {
                let Some((f, room)) = &self.markov_cluster else {
                    return Err(shape(
                        "the cluster Markov loop needs sm_90 or later".to_string(),
                    ));
                };
                let smem = Self::cluster_smem_bytes(a.vd, a.rank, w2_shared);
                if smem > *room || (w2_shared && !a.rank.is_multiple_of(8)) {
                    return Err(shape(format!(
                        "cluster Markov loop for vocabulary {} and rank {} (W2 shared: {w2_shared}) \
                         needs {smem} bytes of shared memory, {room} available",
                        a.vd, a.rank
                    )));
                }
                (
                    f,
                    LaunchConfig {
                        grid_dim: ((a.batch * MARKOV_CLUSTER) as u32, 1, 1),
                        block_dim: (MARKOV_THREADS, 1, 1),
                        shared_mem_bytes: smem as u32,
                    },
                    Some(w2_shared as i32),
                )
            }
        };
        let mut b = self.stream.launch_builder(function);
        b.arg(a.base_logits)
            .arg(a.hidden)
            .arg(&g)
            .arg(&vd)
            .arg(&vocab)
            .arg(&hd)
            .arg(&rank)
            .arg(a.w1);
        match a.w1_row_of_token {
            Some(m) => b.arg(m),
            None => b.arg(&null),
        };
        b.arg(a.w2);
        match &a.confidence {
            Some((w, _)) => b.arg(*w),
            None => b.arg(&null),
        };
        b.arg(&cw).arg(&conf_b);
        match a.draft_to_target {
            Some(m) => b.arg(m),
            None => b.arg(&null),
        };
        b.arg(a.seq_i).arg(a.seq_f).arg(a.uniforms).arg(a.corrected);
        if w2_shared.is_none() {
            b.arg(a.masked);
        }
        b.arg(a.probs).arg(a.conf_out).arg(a.tokens).arg(a.status);
        if let Some(flag) = &w2_shared {
            b.arg(flag);
        }
        // SAFETY: buffer sizes checked above (the caller keeps anchors, limits and slot counts inside
        // the vocabularies and the block, which the kernel re-checks for prev); null pointers only for
        // the optional tensors the kernel tests for; arguments in the order and types of
        // dspark_markov_loop (single CTA: `masked`, no flag) or dspark_markov_cluster (no `masked`,
        // the W2 flag last); the cluster kernel's grid is a whole number of its compile-time clusters
        // and its shared memory was checked against the limit set in `new`.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(top_k: usize, top_p: f32) -> MarkovSeqParams {
        MarkovSeqParams {
            anchor: 3,
            slots: 7,
            sampling: SamplingParams {
                temperature: 1.0,
                top_k,
                top_p,
            },
            limit: 4096,
            confidence_threshold: None,
        }
    }

    #[test]
    fn cluster_shared_memory_matches_the_kernel_layout() {
        // Embedded drafter: 512 ids per CTA, W2 rows of 128 + 8 padding bf16, then e (128 floats) and
        // the slice's logits and probabilities.
        assert_eq!(
            DSparkKernels::cluster_smem_bytes(4096, 128, true),
            512 * 136 * 2 + 4 * (128 + 2 * 512)
        );
        assert_eq!(
            DSparkKernels::cluster_smem_bytes(4096, 128, false),
            4 * (128 + 2 * 512)
        );
        // Ragged vocabulary and rank: slices of ceil(vd / 8), e rounded up to 4 floats, W2 to 16 bytes.
        assert_eq!(
            DSparkKernels::cluster_smem_bytes(1001, 13, false),
            4 * (16 + 2 * 126)
        );
        assert_eq!(
            DSparkKernels::cluster_smem_bytes(1001, 16, true),
            (126 * 24 * 2usize).next_multiple_of(16) + 4 * (16 + 2 * 126)
        );
    }

    #[test]
    fn the_kernel_choice_follows_device_rows_and_room() {
        let h200 = Some(227 * 1024 - 624);
        assert_eq!(
            markov_kernel_for(h200, 4096, 128, true, true),
            MarkovKernel::Cluster { w2_shared: true }
        );
        // No clusters on the device, rows with top-k/top-p, or the caller's opt-out: single CTA.
        assert_eq!(
            markov_kernel_for(None, 4096, 128, true, true),
            MarkovKernel::SingleCta
        );
        assert_eq!(
            markov_kernel_for(h200, 4096, 128, false, true),
            MarkovKernel::SingleCta
        );
        // W2 kept out of shared memory when not allowed, when the rank is not a multiple of 8, or when
        // the slice does not fit (a 32k vocabulary at rank 256: 1 MB per CTA).
        for (vd, rank, allow) in [(4096, 128, false), (4096, 12, true), (32768, 256, true)] {
            assert_eq!(
                markov_kernel_for(h200, vd, rank, true, allow),
                MarkovKernel::Cluster { w2_shared: false },
                "vd {vd} rank {rank}"
            );
        }
        // Nothing fits: a vocabulary whose row slices alone overflow shared memory.
        assert_eq!(
            markov_kernel_for(h200, 8 * 40_000, 128, true, true),
            MarkovKernel::SingleCta
        );
        assert_eq!(
            markov_kernel_for(h200, 0, 128, true, true),
            MarkovKernel::SingleCta
        );
    }

    #[test]
    fn plain_rows_have_no_top_k_or_top_p() {
        assert!(seq(0, 1.0).plain_row(4096));
        assert!(seq(4096, 1.0).plain_row(4096));
        assert!(seq(5000, 1.0).plain_row(4096));
        assert!(!seq(50, 1.0).plain_row(4096));
        assert!(!seq(0, 0.95).plain_row(4096));
    }

    #[test]
    fn markov_status_records_decode_to_their_failures() {
        assert_eq!(decode_markov_status(&[SPL_OK, 0, 0, 7]), Ok(7));
        assert_eq!(
            decode_markov_status(&[SPL_NON_FINITE_LOGIT, 42, 3, 3]),
            Err(MarkovFailure::NonFiniteLogit { slot: 3, index: 42 })
        );
        assert_eq!(
            decode_markov_status(&[SPL_ALL_MASKED, 0, 2, 2]),
            Err(MarkovFailure::AllMasked { slot: 2 })
        );
        assert_eq!(
            decode_markov_status(&[DSP_BAD_TOKEN, -5, 1, 1]),
            Err(MarkovFailure::BadToken { slot: 1, token: -5 })
        );
        assert_eq!(
            decode_markov_status(&[DSP_NOTHING_ALLOWED, 0, 0, 0]),
            Err(MarkovFailure::NothingAllowed)
        );
        assert_eq!(
            decode_markov_status(&[SPL_BAD_BLOCK, 128, 0, 0]),
            Err(MarkovFailure::BadBlock(128))
        );
        assert!(matches!(
            decode_markov_status(&[99, 1, 0, 0]),
            Err(MarkovFailure::Unknown { code: 99, .. })
        ));
        assert!(decode_markov_status(&[0, 0]).is_err());
    }

    #[test]
    fn markov_params_pack_in_the_kernel_layout_and_are_validated() {
        let mut s = seq(50, 0.9);
        s.confidence_threshold = Some(0.25);
        let (ints, floats) = pack_markov_params(&[s, seq(0, 1.0)]).unwrap();
        assert_eq!(ints, vec![3, 7, 50, 4096, 3, 7, 0, 4096]);
        assert_eq!(floats, vec![1.0, 0.9, 0.25, 1.0, 1.0, -1.0]);
        assert!(pack_markov_params(&[seq(0, 1.5)]).is_err());
    }
}
