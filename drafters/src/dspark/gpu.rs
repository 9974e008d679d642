//! The DSpark draft network on the CUDA backend (feature `cuda`): the same computation as `model.rs`,
//! with bf16 weights on the device (uploaded from a loaded [`DSparkModel`], including the embedding and
//! LM head it shares with the target) and f32 activations feeding the linear layers as bf16 (the
//! `GpuTransformer` convention: bf16 x bf16 -> f32 on `cuda::Gemm`).
//!
//! Per-sequence context keys/values live on the device, one contiguous slot of `max_context` positions
//! per sequence and layer. A context append projects the host's tapped target features through `fc`,
//! `hidden_norm` and every layer's k/v (k_norm, RoPE at their own positions) into the slot. The block
//! pass writes the block's own keys/values right after the context and attends to context + block with
//! no mask (`dspark_block_attention`); the next append overwrites those rows, so the block is never
//! cached and a rejection needs no rollback — as on the CPU, where context rows are only ever appended
//! for committed positions. The Markov loop runs every slot of every sequence in one launch:
//! on sm_90+ for rows without top-k / top-p, a thread-block cluster of 8 CTAs per sequence
//! (`dspark_markov_cluster`, each CTA with an eighth of the vocabulary and of W2 in shared memory);
//! otherwise one CTA per sequence (`dspark_markov_loop`). Per layer, the block pass runs the q/k head
//! norms, RoPE and the K/V store as one launch and SwiGLU inside the gate/up GEMM.
//!
//! Latency: a proposal is a few dozen small kernels on tiny tensors, so host overhead is most of its
//! cost. The block pass (per batch size) and small context appends (per row count) are captured into
//! CUDA graphs at first use and replayed after that (they read only device buffers and launch-time
//! sizes); host inputs go through page-locked staging buffers, so uploads don't stall the host, and the
//! Markov loop's results come back with one synchronisation instead of one per buffer.

use super::model::{BlockOutput, DSparkModel};
use crate::DraftError;
use cudarc::driver::{
    sys, CudaEvent, CudaFunction, CudaSlice, LaunchConfig, PinnedHostSlice, PushKernelArg,
    ValidAsZeroBits,
};
use specula_kernels::cuda::dspark::{
    decode_markov_status, pack_markov_params, BlockAttention, DSparkKernels, MarkovFailure,
    MarkovKernel, MarkovLoop, MarkovSeqParams, QkNormRopeAppend, STATUS_INTS,
};
use specula_kernels::cuda::{capture_graph, CudaError, Gemm, GpuDevice, OwnedGraph};
use specula_kernels::Matrix;
use std::collections::HashMap;
use std::sync::Arc;

fn gpu(e: impl Into<CudaError>) -> DraftError {
    DraftError::Gpu(e.into().to_string())
}

/// Capacities of a [`GpuDSpark`], fixed at construction (every buffer is allocated from them).
#[derive(Debug, Clone)]
pub struct GpuDSparkOptions {
    /// Sequences held at once; also the largest batch of one proposal.
    pub max_sequences: usize,
    /// Context positions per sequence, the block's own rows included (the attention kernel's shared
    /// memory grows with it).
    pub max_context: usize,
    /// Feature rows per device launch of a context append; longer appends (a prompt) are chunked.
    pub max_append_rows: usize,
    /// Replay the block pass and small context appends as CUDA graphs (captured at the first use of
    /// each batch size / row count). Off: every kernel is launched one by one (for comparison).
    pub graphs: bool,
    /// Run the Markov loop on a cluster of CTAs per sequence where the device and the rows allow it
    /// (sm_90+, no top-k / top-p); off: always the single-CTA kernel (for comparison).
    pub markov_cluster: bool,
    /// Let the cluster loop keep W2 in shared memory (off: it reads W2 from global memory; for tests).
    pub markov_w2_shared: bool,
}

impl Default for GpuDSparkOptions {
    fn default() -> Self {
        GpuDSparkOptions {
            max_sequences: 8,
            max_context: 4096,
            max_append_rows: 256,
            graphs: true,
            markov_cluster: true,
            markov_w2_shared: true,
        }
    }
}

/// One sequence's block in a [`GpuDSpark::block_pass`].
#[derive(Debug, Clone, Copy)]
pub struct GpuBlock {
    pub slot: usize,
    /// Context rows the sequence holds (the block sits at positions ctx_len .. ctx_len + g).
    pub ctx_len: usize,
    pub anchor: u32,
}

/// One sequence's result of the Markov loop.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MarkovResult {
    /// Drafted tokens (target ids).
    pub tokens: Vec<u32>,
    /// The draft distribution q of each drafted slot over target ids, as the CPU drafter returns it:
    /// `min(vocab_limit, vocab)` entries, 0 for ids outside a pruned draft vocabulary.
    pub probs: Vec<Vec<f32>>,
    /// Pre-sigmoid confidence logits of the drafted slots (empty without a confidence head).
    pub confidence_logits: Vec<f32>,
}

struct GpuLayer {
    input_norm: CudaSlice<f32>,
    wqkv: CudaSlice<u16>,
    wkv: CudaSlice<u16>,
    q_norm: CudaSlice<f32>,
    k_norm: CudaSlice<f32>,
    wo: CudaSlice<u16>,
    post_norm: CudaSlice<f32>,
    w_gate_up: CudaSlice<u16>,
    w_down: CudaSlice<u16>,
    /// `[max_sequences * max_context, kv_dim]`: context keys (k_norm, RoPE) and values, then the
    /// current block's.
    k_ctx: CudaSlice<f32>,
    v_ctx: CudaSlice<f32>,
}

struct DecoderFns {
    embed_rows: CudaFunction,
    rms_norm: CudaFunction,
    rms_norm_bf16: CudaFunction,
    swiglu_bf16: CudaFunction,
    f32_to_bf16_rows: CudaFunction,
}

/// What a captured graph replays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum GraphKey {
    /// A context append of this many feature rows.
    Append(usize),
    /// A block pass over this many sequences.
    Block(usize),
}

/// Context appends of at most this many rows are captured (a verify step commits at most k + 1
/// positions); longer ones (prompts) are launched directly rather than holding a graph per length.
const MAX_GRAPH_APPEND_ROWS: usize = 32;

/// Page-locked host memory for `len` values, zeroed. `write_combined` suits buffers the host only
/// writes (uploads); buffers the host reads back must be cached.
fn pinned<T: cudarc::driver::DeviceRepr + ValidAsZeroBits + Default + Copy>(
    device: &GpuDevice,
    len: usize,
    write_combined: bool,
) -> Result<PinnedHostSlice<T>, DraftError> {
    let flags = if write_combined {
        sys::CU_MEMHOSTALLOC_WRITECOMBINED
    } else {
        0
    };
    // SAFETY: the memory is uninitialised until the fill below, and nothing reads it before.
    let mut p = unsafe {
        device
            .stream
            .context()
            .alloc_pinned_with_flags::<T>(len.max(1), flags)
    }
    .map_err(gpu)?;
    p.as_mut_slice().map_err(gpu)?.fill(T::default());
    Ok(p)
}

/// A page-locked upload buffer with its own completion event. cudarc orders a pinned buffer's
/// copies with an event only while the context tracks events, and `GpuDevice` switches tracking off
/// (graph capture needs that), so without this the host could rewrite the buffer while an earlier
/// asynchronous upload from it is still queued behind GPU work.
struct Staging<T> {
    host: PinnedHostSlice<T>,
    uploaded: CudaEvent,
}

impl<T: cudarc::driver::DeviceRepr + ValidAsZeroBits + Default + Copy> Staging<T> {
    /// A staging buffer as long as its device buffer (every upload copies the whole buffer).
    fn new(device: &GpuDevice, len: usize) -> Result<Staging<T>, DraftError> {
        let ctx = device.stream.context();
        Ok(Staging {
            host: pinned(device, len, true)?,
            uploaded: ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(gpu)?,
        })
    }

    /// The host side, once the previous upload from it has been copied.
    fn write(&mut self) -> Result<&mut [T], DraftError> {
        self.uploaded.synchronize().map_err(gpu)?;
        self.host.as_mut_slice().map_err(gpu)
    }

    /// Queues the copy of the whole buffer into `dst` and marks its completion.
    fn upload(
        &mut self,
        stream: &Arc<cudarc::driver::CudaStream>,
        dst: &mut CudaSlice<T>,
    ) -> Result<(), DraftError> {
        stream.memcpy_htod(&self.host, dst).map_err(gpu)?;
        self.uploaded.record(stream).map_err(gpu)
    }
}

/// Sections of the packed i32 step inputs, each `rows` long.
const IN_IDS: usize = 0;
const IN_POSITIONS: usize = 1;
const IN_SLOTS: usize = 2;
const IN_KEY_COUNTS: usize = 3;
const IN_SEQ_OF_ROW: usize = 4;
const IN_SECTIONS: usize = 5;

#[derive(Debug, Clone, Copy)]
struct Dims {
    h: usize,
    qd: usize,
    kvd: usize,
    hd: usize,
    nh: usize,
    nkv: usize,
    ffn: usize,
    g: usize,
    vd: usize,
    vocab: usize,
    rank: usize,
    feature_width: usize,
    eps: f32,
    mask: u32,
}

/// A DSpark drafter's network resident on the GPU, with device context K/V for up to
/// `max_sequences` sequences.
pub struct GpuDSpark {
    device: Arc<GpuDevice>,
    gemm: Gemm,
    kernels: DSparkKernels,
    k: DecoderFns,
    d: Dims,
    opts: GpuDSparkOptions,
    fc: CudaSlice<u16>,
    hidden_norm: CudaSlice<f32>,
    layers: Vec<GpuLayer>,
    norm: CudaSlice<f32>,
    embed: CudaSlice<u16>,
    lm_head: CudaSlice<u16>,
    w1: CudaSlice<u16>,
    w2: CudaSlice<u16>,
    w1_row_of_token: Option<CudaSlice<i32>>,
    draft_to_target: Option<CudaSlice<i32>>,
    /// The same map on the host, to place draft distributions on target ids.
    host_draft_to_target: Option<Vec<u32>>,
    confidence: Option<(CudaSlice<f32>, f32)>,
    inv_freq: CudaSlice<f64>,
    free_slots: Vec<usize>,
    /// Rows of one launch: max(block rows, append rows).
    max_rows: usize,
    /// Block rows of one proposal: max_sequences * g.
    max_block_rows: usize,
    host_inputs: Staging<i32>,
    inputs: CudaSlice<i32>,
    features: CudaSlice<f32>,
    x: CudaSlice<f32>,
    act16: CudaSlice<u16>,
    qkv: CudaSlice<f32>,
    gate_up: CudaSlice<f32>,
    /// `[max_block_rows, ffn]` SwiGLU output (the paired gate/up GEMM cannot write its own input).
    ffn_act16: CudaSlice<u16>,
    /// Gate/up rows are interleaved in groups of 8 (ffn % 8 == 0): SwiGLU fused into the GEMM.
    paired_gate_up: bool,
    hidden: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    corrected: CudaSlice<f32>,
    masked: CudaSlice<f32>,
    probs: CudaSlice<f32>,
    conf: CudaSlice<f32>,
    tokens: CudaSlice<i32>,
    status: CudaSlice<i32>,
    seq_i: CudaSlice<i32>,
    seq_f: CudaSlice<f32>,
    uniforms: CudaSlice<f64>,
    /// Page-locked staging of the Markov loop's inputs and results.
    host_seq_i: Staging<i32>,
    host_seq_f: Staging<f32>,
    host_uniforms: Staging<f64>,
    host_status: PinnedHostSlice<i32>,
    host_tokens: PinnedHostSlice<i32>,
    host_conf: PinnedHostSlice<f32>,
    host_probs: PinnedHostSlice<f32>,
    /// Batch of the last block pass (what `read_block_outputs` and the Markov loop may read).
    last_batch: usize,
    graphs: HashMap<GraphKey, OwnedGraph>,
    /// Why graphs were switched off (a failed capture), if they were.
    graph_error: Option<String>,
    /// Events around the last Markov kernel launch, when timing is on (`set_kernel_timing`).
    markov_events: Option<(CudaEvent, CudaEvent)>,
    /// The kernel the last Markov loop ran on.
    last_markov_kernel: Option<MarkovKernel>,
}

fn rows_cfg(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn int(v: usize) -> Result<i32, DraftError> {
    i32::try_from(v).map_err(|_| DraftError::Gpu(format!("{v} does not fit the kernels' int")))
}

impl GpuDSpark {
    /// Opens GPU 0 (checking for a driver first, so a machine without one gets an error naming the CPU
    /// drafter rather than a panic) and uploads `model`.
    pub fn open(model: &DSparkModel, opts: GpuDSparkOptions) -> Result<GpuDSpark, DraftError> {
        if !specula_kernels::cuda::driver_available() {
            return Err(gpu(CudaError::NoDriver));
        }
        let device = Arc::new(GpuDevice::new(0).map_err(gpu)?);
        Self::new(model, device, opts)
    }

    /// Uploads `model` to `device` (bf16 weights; f32 norms, confidence head and RoPE frequencies).
    pub fn new(
        model: &DSparkModel,
        device: Arc<GpuDevice>,
        opts: GpuDSparkOptions,
    ) -> Result<GpuDSpark, DraftError> {
        let c = &model.config;
        let d = Dims {
            h: c.hidden_size,
            qd: c.q_dim(),
            kvd: c.kv_dim(),
            hd: c.head_dim(),
            nh: c.num_attention_heads,
            nkv: c.num_key_value_heads,
            ffn: c.intermediate_size,
            g: c.block_size,
            vd: model.draft_vocab(),
            vocab: c.vocab_size,
            rank: c.markov_rank,
            feature_width: model.feature_width(),
            eps: c.rms_norm_eps,
            mask: c.mask_token_id,
        };
        if opts.max_sequences == 0 || opts.max_append_rows == 0 {
            return Err(DraftError::Config(
                "GPU DSpark options: max_sequences and max_append_rows must be positive".into(),
            ));
        }
        if opts.max_context <= d.g {
            return Err(DraftError::Config(format!(
                "GPU DSpark options: max_context {} leaves no room for context beside a block of {}",
                opts.max_context, d.g
            )));
        }
        let mut kernels = DSparkKernels::new(&device).map_err(gpu)?;
        kernels
            .prepare_attention(d.nh, d.nkv, d.hd, opts.max_context)
            .map_err(gpu)?;
        let gemm = Gemm::new(&device).map_err(gpu)?;
        let f = |n: &str| device.function(n).map_err(gpu);
        let k = DecoderFns {
            embed_rows: f("embed_rows")?,
            rms_norm: f("rms_norm")?,
            rms_norm_bf16: f("rms_norm_bf16")?,
            swiglu_bf16: f("swiglu_bf16")?,
            f32_to_bf16_rows: f("f32_to_bf16_rows")?,
        };
        let s = device.stream.clone();
        let mat = |m: &Matrix| s.clone_htod(&m.bf16_bits()).map_err(gpu);
        let vec = |v: &[f32]| s.clone_htod(v).map_err(gpu);
        let ctx_len = opts.max_sequences * opts.max_context * d.kvd;
        let mut layers = Vec::with_capacity(model.layers.len());
        for l in &model.layers {
            layers.push(GpuLayer {
                input_norm: vec(&l.input_norm)?,
                wqkv: mat(&l.wqkv)?,
                wkv: mat(&l.wkv)?,
                q_norm: vec(&l.q_norm)?,
                k_norm: vec(&l.k_norm)?,
                wo: mat(&l.wo)?,
                post_norm: vec(&l.post_norm)?,
                w_gate_up: mat(&l.w_gate_up)?,
                w_down: mat(&l.w_down)?,
                k_ctx: s.alloc_zeros::<f32>(ctx_len).map_err(gpu)?,
                v_ctx: s.alloc_zeros::<f32>(ctx_len).map_err(gpu)?,
            });
        }
        // Gate/up rows paired in groups of 8 (decoder.cu interleave_gate_up) so SwiGLU runs in the
        // GEMM's epilogue (Gemm::linear_swiglu) instead of as its own launch per layer.
        let paired_gate_up = d.ffn.is_multiple_of(8);
        if paired_gate_up {
            let interleave = f("interleave_gate_up")?;
            let (ffn_i, h_i) = (int(d.ffn)?, int(d.h)?);
            let mut unpaired = Vec::with_capacity(layers.len());
            for l in &mut layers {
                let mut dst = s.alloc_zeros::<u16>(2 * d.ffn * d.h).map_err(gpu)?;
                let mut b = s.launch_builder(&interleave);
                b.arg(&l.w_gate_up).arg(&mut dst).arg(&ffn_i).arg(&h_i);
                // SAFETY: both buffers hold 2 * ffn * h elements; interleave_gate_up's arguments.
                unsafe { b.launch(rows_cfg(2 * d.ffn, 256)) }.map_err(gpu)?;
                unpaired.push(std::mem::replace(&mut l.w_gate_up, dst));
            }
            // The unpaired copies are freed only after the copies from them have run (event tracking
            // is off on this device, so nothing else orders the free after the kernels).
            s.synchronize().map_err(gpu)?;
            drop(unpaired);
        }
        let ids = |v: &[u32]| -> Result<CudaSlice<i32>, DraftError> {
            let v: Vec<i32> = v.iter().map(|&x| x as i32).collect();
            s.clone_htod(&v).map_err(gpu)
        };
        let w1_row_of_token = match &model.markov_row_of_target {
            Some(rows) => {
                let v: Vec<i32> = rows.iter().map(|r| r.map_or(-1, |r| r as i32)).collect();
                Some(s.clone_htod(&v).map_err(gpu)?)
            }
            None => None,
        };
        let draft_to_target = match &model.draft_to_target {
            Some(m) => Some(ids(m)?),
            None => None,
        };
        let confidence = match &model.confidence {
            Some((w, b)) => Some((vec(w)?, *b)),
            None => None,
        };
        let max_block_rows = opts.max_sequences * d.g;
        let max_rows = max_block_rows.max(opts.max_append_rows);
        let width = d.qd + 2 * d.kvd;
        let act_width = d.h.max(d.qd).max(d.ffn).max(d.feature_width);
        let zeros_f32 = |n: usize| s.alloc_zeros::<f32>(n.max(1)).map_err(gpu);
        let out = GpuDSpark {
            fc: mat(&model.fc)?,
            hidden_norm: vec(&model.hidden_norm)?,
            norm: vec(&model.norm)?,
            embed: mat(&model.embed)?,
            lm_head: mat(&model.lm_head)?,
            w1: mat(&model.markov_w1)?,
            w2: mat(&model.markov_w2)?,
            inv_freq: s.clone_htod(&model.inv_freq).map_err(gpu)?,
            layers,
            w1_row_of_token,
            draft_to_target,
            host_draft_to_target: model.draft_to_target.clone(),
            confidence,
            free_slots: (0..opts.max_sequences).rev().collect(),
            host_inputs: Staging::new(&device, IN_SECTIONS * max_rows)?,
            inputs: s.alloc_zeros::<i32>(IN_SECTIONS * max_rows).map_err(gpu)?,
            features: zeros_f32(opts.max_append_rows * d.feature_width)?,
            x: zeros_f32(max_rows * d.h)?,
            act16: s.alloc_zeros::<u16>(max_rows * act_width).map_err(gpu)?,
            qkv: zeros_f32(max_rows * width)?,
            gate_up: zeros_f32(max_block_rows * 2 * d.ffn)?,
            ffn_act16: s.alloc_zeros::<u16>(max_block_rows * d.ffn).map_err(gpu)?,
            paired_gate_up,
            hidden: zeros_f32(max_block_rows * d.h)?,
            logits: zeros_f32(max_block_rows * d.vd)?,
            corrected: zeros_f32(max_block_rows * d.vd)?,
            masked: zeros_f32(max_block_rows * d.vd)?,
            probs: zeros_f32(max_block_rows * d.vd)?,
            conf: zeros_f32(max_block_rows)?,
            tokens: s.alloc_zeros::<i32>(max_block_rows).map_err(gpu)?,
            status: s
                .alloc_zeros::<i32>(opts.max_sequences * STATUS_INTS)
                .map_err(gpu)?,
            seq_i: s
                .alloc_zeros::<i32>(opts.max_sequences * specula_kernels::cuda::dspark::SEQ_INTS)
                .map_err(gpu)?,
            seq_f: zeros_f32(opts.max_sequences * specula_kernels::cuda::dspark::SEQ_FLOATS)?,
            uniforms: s.alloc_zeros::<f64>(max_block_rows).map_err(gpu)?,
            host_seq_i: Staging::new(
                &device,
                opts.max_sequences * specula_kernels::cuda::dspark::SEQ_INTS,
            )?,
            host_seq_f: Staging::new(
                &device,
                opts.max_sequences * specula_kernels::cuda::dspark::SEQ_FLOATS,
            )?,
            host_uniforms: Staging::new(&device, max_block_rows)?,
            host_status: pinned(&device, opts.max_sequences * STATUS_INTS, false)?,
            host_tokens: pinned(&device, max_block_rows, false)?,
            host_conf: pinned(&device, max_block_rows, false)?,
            host_probs: pinned(&device, max_block_rows * d.vd, false)?,
            max_rows,
            max_block_rows,
            last_batch: 0,
            graphs: HashMap::new(),
            graph_error: None,
            markov_events: None,
            last_markov_kernel: None,
            device,
            gemm,
            kernels,
            k,
            d,
            opts,
        };
        s.synchronize().map_err(gpu)?;
        Ok(out)
    }

    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.device
    }

    pub fn options(&self) -> &GpuDSparkOptions {
        &self.opts
    }

    /// Takes a free context slot.
    pub fn add_slot(&mut self) -> Result<usize, DraftError> {
        self.free_slots.pop().ok_or_else(|| {
            DraftError::Gpu(format!(
                "the GPU DSpark drafter holds at most {} sequences",
                self.opts.max_sequences
            ))
        })
    }

    /// Returns a slot (its rows are simply overwritten by the next owner).
    pub fn remove_slot(&mut self, slot: usize) {
        if slot < self.opts.max_sequences && !self.free_slots.contains(&slot) {
            self.free_slots.push(slot);
        }
    }

    /// The most context rows a sequence may hold (a block must still fit after them).
    pub fn context_capacity(&self) -> usize {
        self.opts.max_context - self.d.g
    }

    /// Projects `features` (`[n, feature_width]`, the target positions `start .. start + n` of the
    /// sequence in `slot`) into every layer's context K/V, as `DSparkModel::append_context`.
    pub fn append_context(
        &mut self,
        slot: usize,
        start: usize,
        features: &[f32],
    ) -> Result<(), DraftError> {
        let d = self.d;
        let w = d.feature_width;
        if !features.len().is_multiple_of(w) {
            return Err(DraftError::Config(format!(
                "context features of length {} are not rows of {w}",
                features.len()
            )));
        }
        let n = features.len() / w;
        if slot >= self.opts.max_sequences {
            return Err(DraftError::Gpu(format!("no context slot {slot}")));
        }
        if start + n > self.context_capacity() {
            return Err(DraftError::Gpu(format!(
                "context of {} positions exceeds the GPU DSpark drafter's capacity of {} \
                 (GpuDSparkOptions::max_context {} minus a block of {})",
                start + n,
                self.context_capacity(),
                self.opts.max_context,
                d.g
            )));
        }
        let mut done = 0;
        while done < n {
            let rows = (n - done).min(self.opts.max_append_rows);
            self.append_chunk(
                slot,
                start + done,
                &features[done * w..(done + rows) * w],
                rows,
            )?;
            done += rows;
        }
        Ok(())
    }

    fn append_chunk(
        &mut self,
        slot: usize,
        start: usize,
        features: &[f32],
        n: usize,
    ) -> Result<(), DraftError> {
        let s = self.device.stream.clone();
        let mr = self.max_rows;
        {
            // Waits for the previous upload from this buffer (an event, not a stream sync).
            let h = self.host_inputs.write()?;
            for i in 0..n {
                let pos = start + i;
                h[IN_POSITIONS * mr + i] = int(pos)?;
                h[IN_SLOTS * mr + i] = int(slot * self.opts.max_context + pos)?;
            }
        }
        self.host_inputs.upload(&s, &mut self.inputs)?;
        // Pageable: the driver has taken the data when the call returns (staged for DMA), so the
        // caller's slice is free at once; only the small per-row inputs go through pinned staging.
        s.memcpy_htod(features, &mut self.features.slice_mut(..features.len()))
            .map_err(gpu)?;
        let key = (n <= MAX_GRAPH_APPEND_ROWS).then_some(GraphKey::Append(n));
        self.launch(key, Self::encode_append, n)
    }

    /// The launches of a context append of `n` rows whose positions, slot rows and features are
    /// already on the device (reads only device buffers, so it can be captured).
    fn encode_append(&mut self, n: usize) -> Result<(), DraftError> {
        let d = self.d;
        let s = self.device.stream.clone();
        let mr = self.max_rows;
        let (h_i, eps) = (int(d.h)?, d.eps);
        let null: u64 = 0;
        let n_feat = int(n * d.feature_width)?;
        let positions = self.inputs.slice(IN_POSITIONS * mr..IN_POSITIONS * mr + n);
        let slots = self.inputs.slice(IN_SLOTS * mr..IN_SLOTS * mr + n);
        // SAFETY (every launch below): buffers were allocated for max_rows rows (n <= max_append_rows
        // <= max_rows) and the slot rows start .. start + n lie inside the sequence's context slot
        // (checked by append_context); arguments follow decoder.cu's signatures.
        unsafe {
            let mut b = s.launch_builder(&self.k.f32_to_bf16_rows);
            b.arg(&self.features).arg(&mut self.act16).arg(&n_feat);
            b.launch(LaunchConfig::for_num_elems((n * d.feature_width) as u32))
                .map_err(gpu)?;
        }
        self.gemm
            .linear(&self.fc, &self.act16, &mut self.x, d.h, d.feature_width, n)
            .map_err(gpu)?;
        unsafe {
            let mut b = s.launch_builder(&self.k.rms_norm_bf16);
            b.arg(&self.x)
                .arg(&null)
                .arg(&self.hidden_norm)
                .arg(&mut self.act16)
                .arg(&h_i)
                .arg(&eps);
            b.launch(rows_cfg(n, 128)).map_err(gpu)?;
        }
        for l in &mut self.layers {
            self.gemm
                .linear(&l.wkv, &self.act16, &mut self.qkv, 2 * d.kvd, d.h, n)
                .map_err(gpu)?;
            // No query heads: rows are [k | v]; k heads are normed, rotated and stored, v heads
            // copied, at the slot rows of positions start .. start + n.
            self.kernels
                .qk_norm_rope_append(QkNormRopeAppend {
                    rows: n,
                    qkv: &mut self.qkv,
                    row_stride: 2 * d.kvd,
                    n_heads: 0,
                    n_kv_heads: d.nkv,
                    head_dim: d.hd,
                    q_norm: &l.q_norm,
                    k_norm: &l.k_norm,
                    eps,
                    positions: &positions,
                    inv_freq: &self.inv_freq,
                    slots: &slots,
                    k_ctx: &mut l.k_ctx,
                    v_ctx: &mut l.v_ctx,
                })
                .map_err(gpu)?;
        }
        Ok(())
    }

    /// One non-causal pass over the blocks `[anchor, mask x (g - 1)]` of several sequences, as
    /// `DSparkModel::block_forward`; the outputs stay on the device for [`Self::markov_loop`] (and
    /// [`Self::read_block_outputs`]).
    pub fn block_pass(&mut self, blocks: &[GpuBlock]) -> Result<(), DraftError> {
        let d = self.d;
        let g = d.g;
        let n = blocks.len() * g;
        self.last_batch = 0;
        if blocks.is_empty() {
            return Ok(());
        }
        if n > self.max_block_rows {
            return Err(DraftError::Gpu(format!(
                "{} blocks in one pass; the GPU DSpark drafter was built for {}",
                blocks.len(),
                self.opts.max_sequences
            )));
        }
        let mr = self.max_rows;
        let (cap, max_seqs, max_ctx) = (
            self.context_capacity(),
            self.opts.max_sequences,
            self.opts.max_context,
        );
        for blk in blocks {
            if blk.anchor as usize >= d.vocab {
                return Err(specula_model::ModelError::TokenOutOfRange {
                    id: blk.anchor,
                    vocab_size: d.vocab,
                }
                .into());
            }
            if blk.slot >= max_seqs || blk.ctx_len > cap {
                return Err(DraftError::Gpu(format!(
                    "block of slot {} after {} context rows is outside the drafter's capacity",
                    blk.slot, blk.ctx_len
                )));
            }
        }
        {
            // Waits for the previous upload from this buffer (an event, not a stream sync).
            let h = self.host_inputs.write()?;
            for (i, blk) in blocks.iter().enumerate() {
                for j in 0..g {
                    let row = i * g + j;
                    let pos = blk.ctx_len + j;
                    h[IN_IDS * mr + row] = if j == 0 { blk.anchor } else { d.mask } as i32;
                    h[IN_POSITIONS * mr + row] = int(pos)?;
                    h[IN_SLOTS * mr + row] = int(blk.slot * max_ctx + pos)?;
                    h[IN_KEY_COUNTS * mr + row] = int(blk.ctx_len + g)?;
                    h[IN_SEQ_OF_ROW * mr + row] = int(blk.slot)?;
                }
            }
        }
        let s = self.device.stream.clone();
        self.host_inputs.upload(&s, &mut self.inputs)?;
        self.launch(Some(GraphKey::Block(blocks.len())), Self::encode_block, n)?;
        self.last_batch = blocks.len();
        Ok(())
    }

    /// The launches of a block pass over `n` block rows whose ids, positions, slot rows, key counts
    /// and sequence indices are already on the device (reads only device buffers, so it can be
    /// captured).
    fn encode_block(&mut self, n: usize) -> Result<(), DraftError> {
        let d = self.d;
        let mr = self.max_rows;
        let s = self.device.stream.clone();
        let width = d.qd + 2 * d.kvd;
        let (h_i, eps) = (int(d.h)?, d.eps);
        let (n_i, ffn_i, nh_all) = (int(n)?, int(d.ffn)?, int(n * d.h)?);
        let null: u64 = 0;
        let scale = 1.0 / (d.hd as f32).sqrt();
        let section = |k: usize| k * mr..k * mr + n;
        let ids = self.inputs.slice(section(IN_IDS));
        let positions = self.inputs.slice(section(IN_POSITIONS));
        let slots = self.inputs.slice(section(IN_SLOTS));
        let key_counts = self.inputs.slice(section(IN_KEY_COUNTS));
        let seq_of_row = self.inputs.slice(section(IN_SEQ_OF_ROW));
        // SAFETY (every launch below): buffers were allocated for max_block_rows >= n rows, token ids
        // are inside the embedding (checked above), slot rows and key counts lie inside each
        // sequence's context slot (ctx_len + g <= max_context, checked above); arguments follow
        // decoder.cu's signatures.
        unsafe {
            let mut b = s.launch_builder(&self.k.embed_rows);
            b.arg(&self.embed).arg(&ids).arg(&mut self.x).arg(&h_i);
            b.launch(rows_cfg(n, 128)).map_err(gpu)?;
        }
        for l in &mut self.layers {
            unsafe {
                let mut b = s.launch_builder(&self.k.rms_norm_bf16);
                b.arg(&self.x)
                    .arg(&null)
                    .arg(&l.input_norm)
                    .arg(&mut self.act16)
                    .arg(&h_i)
                    .arg(&eps);
                b.launch(rows_cfg(n, 128)).map_err(gpu)?;
            }
            self.gemm
                .linear(&l.wqkv, &self.act16, &mut self.qkv, width, d.h, n)
                .map_err(gpu)?;
            // q/k head norms; q rotated in place; the block's k (rotated) and v stored after the
            // context.
            self.kernels
                .qk_norm_rope_append(QkNormRopeAppend {
                    rows: n,
                    qkv: &mut self.qkv,
                    row_stride: width,
                    n_heads: d.nh,
                    n_kv_heads: d.nkv,
                    head_dim: d.hd,
                    q_norm: &l.q_norm,
                    k_norm: &l.k_norm,
                    eps,
                    positions: &positions,
                    inv_freq: &self.inv_freq,
                    slots: &slots,
                    k_ctx: &mut l.k_ctx,
                    v_ctx: &mut l.v_ctx,
                })
                .map_err(gpu)?;
            self.kernels
                .block_attention(BlockAttention {
                    rows: n,
                    qkv: &self.qkv,
                    row_stride: width,
                    n_heads: d.nh,
                    n_kv_heads: d.nkv,
                    head_dim: d.hd,
                    key_counts: &key_counts,
                    seq_of_row: &seq_of_row,
                    max_ctx: self.opts.max_context,
                    k_ctx: &l.k_ctx,
                    v_ctx: &l.v_ctx,
                    out: &mut self.act16,
                    scale,
                })
                .map_err(gpu)?;
            self.gemm
                .linear_acc(&l.wo, &self.act16, &mut self.x, d.h, d.qd, n, true)
                .map_err(gpu)?;
            unsafe {
                let mut b = s.launch_builder(&self.k.rms_norm_bf16);
                b.arg(&self.x)
                    .arg(&null)
                    .arg(&l.post_norm)
                    .arg(&mut self.act16)
                    .arg(&h_i)
                    .arg(&eps);
                b.launch(rows_cfg(n, 128)).map_err(gpu)?;
            }
            let ffn_act = if self.paired_gate_up {
                self.gemm
                    .linear_swiglu(
                        &l.w_gate_up,
                        &self.act16,
                        &mut self.gate_up,
                        &mut self.ffn_act16,
                        2 * d.ffn,
                        d.h,
                        n,
                    )
                    .map_err(gpu)?;
                &self.ffn_act16
            } else {
                self.gemm
                    .linear(
                        &l.w_gate_up,
                        &self.act16,
                        &mut self.gate_up,
                        2 * d.ffn,
                        d.h,
                        n,
                    )
                    .map_err(gpu)?;
                unsafe {
                    let mut b = s.launch_builder(&self.k.swiglu_bf16);
                    b.arg(&self.gate_up)
                        .arg(&mut self.act16)
                        .arg(&n_i)
                        .arg(&ffn_i);
                    b.launch(LaunchConfig::for_num_elems((n * d.ffn) as u32))
                        .map_err(gpu)?;
                }
                &self.act16
            };
            self.gemm
                .linear_acc(&l.w_down, ffn_act, &mut self.x, d.h, d.ffn, n, true)
                .map_err(gpu)?;
        }
        // Final norm in f32 (the hidden states the confidence head reads), then as bf16 into the LM
        // head.
        unsafe {
            let mut b = s.launch_builder(&self.k.rms_norm);
            b.arg(&self.x)
                .arg(&self.norm)
                .arg(&mut self.hidden)
                .arg(&h_i)
                .arg(&eps);
            b.launch(rows_cfg(n, 128)).map_err(gpu)?;
        }
        unsafe {
            let mut b = s.launch_builder(&self.k.f32_to_bf16_rows);
            b.arg(&self.hidden).arg(&mut self.act16).arg(&nh_all);
            b.launch(LaunchConfig::for_num_elems((n * d.h) as u32))
                .map_err(gpu)?;
        }
        self.gemm
            .linear(&self.lm_head, &self.act16, &mut self.logits, d.vd, d.h, n)
            .map_err(gpu)?;
        Ok(())
    }

    /// Runs `encode(self, n)`: replays the graph of `key` when one was captured; otherwise runs it
    /// directly (this call's result) and, with graphs on and a key, captures the same launches for
    /// the next call of that shape. A failed capture switches graphs off (`graph_error` says why)
    /// and the drafter goes on launching directly.
    fn launch(
        &mut self,
        key: Option<GraphKey>,
        encode: fn(&mut GpuDSpark, usize) -> Result<(), DraftError>,
        n: usize,
    ) -> Result<(), DraftError> {
        let key = key.filter(|_| self.opts.graphs && self.graph_error.is_none());
        if let Some(OwnedGraph(g)) = key.and_then(|k| self.graphs.get(&k)) {
            return g.launch().map_err(gpu);
        }
        encode(self, n)?;
        if let Some(key) = key {
            let s = self.device.stream.clone();
            match capture_graph(&s, || encode(self, n)) {
                Ok(g) => {
                    self.graphs.insert(key, g);
                }
                Err(e) => self.graph_error = Some(e.to_string()),
            }
        }
        Ok(())
    }

    /// Why graphs were switched off (a failed capture), if they were.
    pub fn graph_error(&self) -> Option<&str> {
        self.graph_error.as_deref()
    }

    /// Graphs captured so far (block passes and context appends).
    pub fn graph_count(&self) -> usize {
        self.graphs.len()
    }

    /// Records CUDA events around every Markov kernel launch from now on (`last_markov_kernel_ms`
    /// reads them); for benchmarks, which need the kernel's device time apart from its transfers.
    pub fn set_kernel_timing(&mut self, on: bool) -> Result<(), DraftError> {
        self.markov_events = if on {
            let ctx = self.device.stream.context();
            let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
            Some((
                ctx.new_event(flags).map_err(gpu)?,
                ctx.new_event(flags).map_err(gpu)?,
            ))
        } else {
            None
        };
        Ok(())
    }

    /// Device time of the last Markov kernel in ms, when kernel timing is on.
    pub fn last_markov_kernel_ms(&self) -> Result<Option<f32>, DraftError> {
        match &self.markov_events {
            Some((a, b)) => Ok(Some(a.elapsed_ms(b).map_err(gpu)?)),
            None => Ok(None),
        }
    }

    /// The kernel the last Markov loop ran on (None before the first).
    pub fn last_markov_kernel(&self) -> Option<MarkovKernel> {
        self.last_markov_kernel
    }

    /// The last block pass's hidden states and base logits on the host, per sequence (parity checks,
    /// and the host Markov loop for confidence-truncated sampling).
    pub fn read_block_outputs(&self) -> Result<Vec<BlockOutput>, DraftError> {
        let (b, g, h, vd) = (self.last_batch, self.d.g, self.d.h, self.d.vd);
        let s = &self.device.stream;
        let hidden = s.clone_dtoh(&self.hidden.slice(..b * g * h)).map_err(gpu)?;
        let logits = s
            .clone_dtoh(&self.logits.slice(..b * g * vd))
            .map_err(gpu)?;
        Ok((0..b)
            .map(|i| BlockOutput {
                hidden: hidden[i * g * h..(i + 1) * g * h].to_vec(),
                base_logits: logits[i * g * vd..(i + 1) * g * vd].to_vec(),
            })
            .collect())
    }

    /// The Markov-corrected logits `[batch, g, draft vocab]` of the last Markov loop (slots past a
    /// sequence's drafted count hold stale values).
    pub fn read_corrected_logits(&self) -> Result<Vec<f32>, DraftError> {
        let n = self.last_batch * self.d.g * self.d.vd;
        self.device
            .stream
            .clone_dtoh(&self.corrected.slice(..n))
            .map_err(gpu)
    }

    /// Runs the fused Markov loop over the last block pass's outputs, one parameter set per block in
    /// the pass's order; `uniforms` is `[batch, g]` (slot j of sequence b at b * g + j; read only for
    /// sampled sequences). Returns each sequence's result, or why the device refused it.
    pub fn markov_loop(
        &mut self,
        params: &[MarkovSeqParams],
        uniforms: &[f64],
    ) -> Result<Vec<Result<MarkovResult, MarkovFailure>>, DraftError> {
        let (b, g, vd) = (self.last_batch, self.d.g, self.d.vd);
        if params.len() != b || uniforms.len() != b * g {
            return Err(DraftError::Gpu(format!(
                "Markov loop for {} sequences with {} uniforms after a block pass of {b}",
                params.len(),
                uniforms.len()
            )));
        }
        if b == 0 {
            return Ok(Vec::new());
        }
        for p in params {
            if p.slots > g || p.anchor as usize >= self.d.vocab {
                return Err(DraftError::Gpu(format!(
                    "Markov loop of {} slots from anchor {} (block {g}, vocabulary {})",
                    p.slots, p.anchor, self.d.vocab
                )));
            }
            let n = if self.draft_to_target.is_some() {
                vd
            } else {
                p.limit
            };
            if n == 0 || n > vd {
                return Err(DraftError::Gpu(format!(
                    "Markov loop row of {n} entries over a draft vocabulary of {vd}"
                )));
            }
        }
        let (ints, floats) = pack_markov_params(params)?;
        // The cluster kernel serves rows without top-k / top-p.
        let plain = params.iter().all(|p| {
            p.plain_row(if self.draft_to_target.is_some() {
                vd
            } else {
                p.limit
            })
        });
        let kernel = self.kernels.choose_markov(
            vd,
            self.d.rank,
            plain,
            self.opts.markov_cluster,
            self.opts.markov_w2_shared,
        );
        self.last_markov_kernel = Some(kernel);
        let s = self.device.stream.clone();
        // Page-locked staging: the uploads and readbacks below are queued without waiting, and the
        // host synchronises once, after the last readback (the stream sync is what makes the pinned
        // results readable: cudarc's own per-buffer events are off with event tracking).
        self.host_seq_i.write()?[..ints.len()].copy_from_slice(&ints);
        self.host_seq_f.write()?[..floats.len()].copy_from_slice(&floats);
        self.host_uniforms.write()?[..uniforms.len()].copy_from_slice(uniforms);
        self.host_seq_i.upload(&s, &mut self.seq_i)?;
        self.host_seq_f.upload(&s, &mut self.seq_f)?;
        self.host_uniforms.upload(&s, &mut self.uniforms)?;
        if let Some((start, _)) = &self.markov_events {
            start.record(&s).map_err(gpu)?;
        }
        self.kernels
            .markov_loop(MarkovLoop {
                kernel,
                batch: b,
                g,
                vd,
                vocab: self.d.vocab,
                hidden_dim: self.d.h,
                rank: self.d.rank,
                base_logits: &self.logits,
                hidden: &self.hidden,
                w1: &self.w1,
                w1_row_of_token: self.w1_row_of_token.as_ref(),
                w2: &self.w2,
                confidence: self.confidence.as_ref().map(|(w, b)| (w, *b)),
                draft_to_target: self.draft_to_target.as_ref(),
                seq_i: &self.seq_i,
                seq_f: &self.seq_f,
                uniforms: &self.uniforms,
                corrected: &mut self.corrected,
                masked: &mut self.masked,
                probs: &mut self.probs,
                conf_out: &mut self.conf,
                tokens: &mut self.tokens,
                status: &mut self.status,
            })
            .map_err(gpu)?;
        if let Some((_, end)) = &self.markov_events {
            end.record(&s).map_err(gpu)?;
        }
        let rows = b * g;
        s.memcpy_dtoh(&self.status.slice(..b * STATUS_INTS), &mut self.host_status)
            .map_err(gpu)?;
        s.memcpy_dtoh(&self.tokens.slice(..rows), &mut self.host_tokens)
            .map_err(gpu)?;
        s.memcpy_dtoh(&self.conf.slice(..rows), &mut self.host_conf)
            .map_err(gpu)?;
        // Greedy rows are one-hot at the drafted token (the kernel writes exactly that): built here
        // instead of copied, so greedy proposals move no vocabulary-sized rows.
        let any_sampled = params.iter().any(|p| !p.sampling.is_greedy());
        if any_sampled {
            s.memcpy_dtoh(&self.probs.slice(..rows * vd), &mut self.host_probs)
                .map_err(gpu)?;
        }
        s.synchronize().map_err(gpu)?;
        let status = self.host_status.as_slice().map_err(gpu)?;
        let tokens = self.host_tokens.as_slice().map_err(gpu)?;
        let conf = self.host_conf.as_slice().map_err(gpu)?;
        let probs = self.host_probs.as_slice().map_err(gpu)?;
        let has_conf = self.confidence.is_some();
        let map = self.host_draft_to_target.as_deref();
        let mut out = Vec::with_capacity(b);
        for (i, p) in params.iter().enumerate() {
            let drafted = match decode_markov_status(&status[i * STATUS_INTS..]) {
                Ok(n) if n <= p.slots => n,
                Ok(n) => {
                    out.push(Err(MarkovFailure::Unknown {
                        code: 0,
                        detail: n as i32,
                    }));
                    continue;
                }
                Err(e) => {
                    out.push(Err(e));
                    continue;
                }
            };
            // Length of q as the CPU drafter builds it: min(vocab_limit, vocab) target ids (`limit`
            // is already that without a pruned vocabulary).
            let q_len = p.limit.min(self.d.vocab);
            let mut r = MarkovResult::default();
            for j in 0..drafted {
                let row = i * g + j;
                let t = tokens[row];
                if t < 0 || t as usize >= q_len {
                    return Err(DraftError::Gpu(format!(
                        "the Markov loop drafted token {t}, outside the request's {q_len} ids"
                    )));
                }
                r.tokens.push(t as u32);
                if has_conf {
                    r.confidence_logits.push(conf[row]);
                }
                let mut q = vec![0f32; q_len];
                if p.sampling.is_greedy() {
                    q[t as usize] = 1.0;
                } else {
                    let src = &probs[row * vd..(row + 1) * vd];
                    match map {
                        None => q.copy_from_slice(&src[..q_len]),
                        Some(map) => {
                            // Draft ids outside the request's vocabulary hold 0 and map past q_len.
                            for (&tid, &v) in map.iter().zip(src) {
                                if (tid as usize) < q_len {
                                    q[tid as usize] = v;
                                }
                            }
                        }
                    }
                }
                r.probs.push(q);
            }
            out.push(Ok(r));
        }
        Ok(out)
    }
}
