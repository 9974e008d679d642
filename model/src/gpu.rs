//! The decoder forward on the CUDA backend (feature `cuda`): weights uploaded once as bf16, activations
//! f32, linear layers on cuBLAS, everything else in `kernels/cuda/decoder.cu`, KV cache f32 in paged
//! blocks on the device. One sequence per call for now; checked against the CPU forward (the oracle) by
//! `gpu_forward_check`. Not yet: batching several sequences, sampling kernels, CUDA graphs.

use crate::transformer::Transformer;
use crate::ModelError;
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use specula_kernels::cuda::{CudaError, Gemm, GpuDevice};
use specula_kernels::{Matrix, MatrixData};

fn gpu(e: impl Into<CudaError>) -> ModelError {
    ModelError::Gpu(e.into().to_string())
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
    rms_norm: CudaFunction,
    head_rms_norm: CudaFunction,
    to_bf16: CudaFunction,
    add_bias_rows: CudaFunction,
    add_in_place: CudaFunction,
    rope: CudaFunction,
    kv_append: CudaFunction,
    attention: CudaFunction,
    swiglu: CudaFunction,
}

/// A model resident on the GPU with a KV cache for one sequence of up to `max_positions` positions.
pub struct GpuTransformer {
    pub device: GpuDevice,
    gemm: Gemm,
    k: Kernels,
    config: crate::ModelConfig,
    embed: CudaSlice<u16>,
    layers: Vec<GpuLayer>,
    final_norm: CudaSlice<f32>,
    lm_head: Option<CudaSlice<u16>>,
    inv_freq: CudaSlice<f64>,
    block_size: usize,
    max_blocks: usize,
    block_table: CudaSlice<i32>,
    len: usize,
}

fn rows_cfg(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl GpuTransformer {
    pub fn upload(cpu: &Transformer, max_positions: usize) -> Result<GpuTransformer, ModelError> {
        let device = GpuDevice::new(0).map_err(|e| ModelError::Gpu(e.to_string()))?;
        let s = device.stream.clone();
        let gemm = Gemm::new(s.clone()).map_err(|e| ModelError::Gpu(e.to_string()))?;
        let f = |n: &str| {
            device
                .function(n)
                .map_err(|e| ModelError::Gpu(e.to_string()))
        };
        let k = Kernels {
            embed_rows: f("embed_rows")?,
            rms_norm: f("rms_norm")?,
            head_rms_norm: f("head_rms_norm")?,
            to_bf16: f("f32_to_bf16_rows")?,
            add_bias_rows: f("add_bias_rows")?,
            add_in_place: f("add_in_place")?,
            rope: f("rope_neox")?,
            kv_append: f("kv_append")?,
            attention: f("attention")?,
            swiglu: f("swiglu")?,
        };
        let c = cpu.config.clone();
        let block_size = 16;
        let max_blocks = max_positions.div_ceil(block_size);
        let cache_len = max_blocks * block_size * c.kv_dim();
        let up_f32 = |v: &[f32]| s.clone_htod(v).map_err(gpu);
        let up_bf16 = |m: &Matrix| s.clone_htod(&bf16_bits(m)).map_err(gpu);
        let mut layers = Vec::with_capacity(cpu.layers.len());
        for l in &cpu.layers {
            layers.push(GpuLayer {
                attn_norm: up_f32(&l.attn_norm)?,
                wqkv: up_bf16(&l.wqkv)?,
                bqkv: l.bqkv.as_deref().map(up_f32).transpose()?,
                q_norm: l.q_norm.as_deref().map(up_f32).transpose()?,
                k_norm: l.k_norm.as_deref().map(up_f32).transpose()?,
                wo: up_bf16(&l.wo)?,
                bo: l.bo.as_deref().map(up_f32).transpose()?,
                ffn_norm: up_f32(&l.ffn_norm)?,
                w_gate_up: up_bf16(&l.w_gate_up)?,
                w_down: up_bf16(&l.w_down)?,
                k_cache: s.alloc_zeros::<f32>(cache_len).map_err(gpu)?,
                v_cache: s.alloc_zeros::<f32>(cache_len).map_err(gpu)?,
            });
        }
        // One sequence: its blocks are simply 0..max_blocks (the kernels read them through the table).
        let table: Vec<i32> = (0..max_blocks as i32).collect();
        Ok(GpuTransformer {
            gemm,
            k,
            embed: up_bf16(&cpu.embed)?,
            final_norm: up_f32(&cpu.final_norm)?,
            lm_head: cpu.lm_head.as_ref().map(up_bf16).transpose()?,
            inv_freq: s.clone_htod(&cpu.inv_freq).map_err(gpu)?,
            block_table: s.clone_htod(&table).map_err(gpu)?,
            block_size,
            max_blocks,
            layers,
            config: c,
            len: 0,
            device,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rolls the sequence back to `len` positions (rejected drafts).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Appends `tokens` and returns the logits of every new position, `[tokens.len(), vocab]`, on the host.
    pub fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let c = self.config.clone();
        let n = tokens.len();
        if n == 0 || self.len + n > self.max_blocks * self.block_size {
            return Err(ModelError::InvalidRequest(format!(
                "GPU forward of {n} tokens at position {} exceeds its cache of {} positions",
                self.len,
                self.max_blocks * self.block_size
            )));
        }
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(ModelError::TokenOutOfRange {
                id,
                vocab_size: c.vocab_size,
            });
        }
        let s = self.device.stream.clone();
        let (h, qd, kvd, hd, ffn) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.head_dim,
            c.intermediate_size,
        );
        let width = qd + 2 * kvd;
        let positions: Vec<i32> = (self.len..self.len + n).map(|p| p as i32).collect();
        let slots: Vec<i32> = positions.clone(); // block i holds positions i*bs.., table is the identity
        let ctx = self.len + n;
        let dtok = s.clone_htod(tokens).map_err(gpu)?;
        let dpos = s.clone_htod(&positions).map_err(gpu)?;
        let dslots = s.clone_htod(&slots).map_err(gpu)?;
        let row_table = s.alloc_zeros::<i32>(n).map_err(gpu)?;
        let mut x = s.alloc_zeros::<f32>(n * h).map_err(gpu)?;
        let mut normed = s.alloc_zeros::<f32>(n * h).map_err(gpu)?;
        let mut act16 = s.alloc_zeros::<u16>(n * qd.max(h).max(ffn)).map_err(gpu)?;
        let mut qkv = s.alloc_zeros::<f32>(n * width).map_err(gpu)?;
        let mut attn = s.alloc_zeros::<f32>(n * qd).map_err(gpu)?;
        let mut proj = s.alloc_zeros::<f32>(n * h).map_err(gpu)?;
        let mut gate_up = s.alloc_zeros::<f32>(n * 2 * ffn).map_err(gpu)?;
        let mut act = s.alloc_zeros::<f32>(n * ffn).map_err(gpu)?;
        let (h_i, eps) = (h as i32, c.rms_norm_eps);
        let k = &self.k;
        // SAFETY (all launches below): every buffer was allocated above or at upload with the sizes the
        // kernels index, and arguments are passed in the order and types of decoder.cu's signatures.
        unsafe {
            let mut b = s.launch_builder(&k.embed_rows);
            b.arg(&self.embed).arg(&dtok).arg(&mut x).arg(&h_i);
            b.launch(rows_cfg(n, 128)).map_err(gpu)?;
        }
        let to_bf16 = |src: &CudaSlice<f32>,
                       dst: &mut CudaSlice<u16>,
                       count: usize|
         -> Result<(), ModelError> {
            let cnt = count as i32;
            let mut b = s.launch_builder(&k.to_bf16);
            b.arg(src).arg(dst).arg(&cnt);
            unsafe { b.launch(LaunchConfig::for_num_elems(count as u32)) }.map_err(gpu)?;
            Ok(())
        };
        let rms = |src: &CudaSlice<f32>,
                   w: &CudaSlice<f32>,
                   dst: &mut CudaSlice<f32>,
                   rows: usize|
         -> Result<(), ModelError> {
            let mut b = s.launch_builder(&k.rms_norm);
            b.arg(src).arg(w).arg(dst).arg(&h_i).arg(&eps);
            unsafe { b.launch(rows_cfg(rows, 128)) }.map_err(gpu)?;
            Ok(())
        };
        let add = |a: &mut CudaSlice<f32>,
                   bsrc: &CudaSlice<f32>,
                   count: usize|
         -> Result<(), ModelError> {
            let cnt = count as i32;
            let mut b = s.launch_builder(&k.add_in_place);
            b.arg(a).arg(bsrc).arg(&cnt);
            unsafe { b.launch(LaunchConfig::for_num_elems(count as u32)) }.map_err(gpu)?;
            Ok(())
        };
        let bias = |a: &mut CudaSlice<f32>,
                    bsrc: &CudaSlice<f32>,
                    rows: usize,
                    dim: usize|
         -> Result<(), ModelError> {
            let (r, d) = (rows as i32, dim as i32);
            let mut b = s.launch_builder(&k.add_bias_rows);
            b.arg(a).arg(bsrc).arg(&r).arg(&d);
            unsafe { b.launch(LaunchConfig::for_num_elems((rows * dim) as u32)) }.map_err(gpu)?;
            Ok(())
        };
        let (w_i, hd_i, qd_i, kvd_i) = (width as i32, hd as i32, qd as i32, kvd as i32);
        let (nh_i, nkv_i, mb_i, bs_i) = (
            c.num_heads as i32,
            c.num_kv_heads as i32,
            self.max_blocks as i32,
            self.block_size as i32,
        );
        let v_off = (qd + kvd) as i32;
        let scale = 1.0 / (hd as f32).sqrt();
        let zero = 0i32;
        let ffn_i = ffn as i32;
        let n_i = n as i32;
        for l in &mut self.layers {
            rms(&x, &l.attn_norm, &mut normed, n)?;
            to_bf16(&normed, &mut act16, n * h)?;
            self.gemm
                .linear(&l.wqkv, &act16, &mut qkv, width, h, n)
                .map_err(|e| ModelError::Gpu(e.to_string()))?;
            if let Some(bq) = &l.bqkv {
                bias(&mut qkv, bq, n, width)?;
            }
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                for (w, off, heads) in [(qn, 0i32, c.num_heads), (kn, qd_i, c.num_kv_heads)] {
                    let mut b = s.launch_builder(&k.head_rms_norm);
                    b.arg(&mut qkv)
                        .arg(&w_i)
                        .arg(&off)
                        .arg(w)
                        .arg(&hd_i)
                        .arg(&eps);
                    let cfg = LaunchConfig {
                        grid_dim: (n as u32, heads as u32, 1),
                        block_dim: (128, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    unsafe { b.launch(cfg) }.map_err(gpu)?;
                }
            }
            for (off, heads) in [(zero, c.num_heads), (qd_i, c.num_kv_heads)] {
                let mut b = s.launch_builder(&k.rope);
                b.arg(&mut qkv)
                    .arg(&w_i)
                    .arg(&off)
                    .arg(&dpos)
                    .arg(&self.inv_freq)
                    .arg(&hd_i);
                let cfg = LaunchConfig {
                    grid_dim: (n as u32, heads as u32, 1),
                    block_dim: ((hd / 2) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                unsafe { b.launch(cfg) }.map_err(gpu)?;
            }
            {
                let mut b = s.launch_builder(&k.kv_append);
                b.arg(&qkv)
                    .arg(&w_i)
                    .arg(&qd_i)
                    .arg(&v_off)
                    .arg(&kvd_i)
                    .arg(&dslots)
                    .arg(&mut l.k_cache)
                    .arg(&mut l.v_cache);
                unsafe { b.launch(rows_cfg(n, 128)) }.map_err(gpu)?;
            }
            {
                let mut b = s.launch_builder(&k.attention);
                b.arg(&qkv)
                    .arg(&w_i)
                    .arg(&nh_i)
                    .arg(&nkv_i)
                    .arg(&hd_i)
                    .arg(&dpos)
                    .arg(&row_table)
                    .arg(&mb_i)
                    .arg(&self.block_table)
                    .arg(&bs_i)
                    .arg(&l.k_cache)
                    .arg(&l.v_cache)
                    .arg(&mut attn)
                    .arg(&scale);
                let cfg = LaunchConfig {
                    grid_dim: (n as u32, c.num_heads as u32, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: (ctx * 4) as u32,
                };
                unsafe { b.launch(cfg) }.map_err(gpu)?;
            }
            to_bf16(&attn, &mut act16, n * qd)?;
            self.gemm
                .linear(&l.wo, &act16, &mut proj, h, qd, n)
                .map_err(|e| ModelError::Gpu(e.to_string()))?;
            if let Some(bo) = &l.bo {
                bias(&mut proj, bo, n, h)?;
            }
            add(&mut x, &proj, n * h)?;
            rms(&x, &l.ffn_norm, &mut normed, n)?;
            to_bf16(&normed, &mut act16, n * h)?;
            self.gemm
                .linear(&l.w_gate_up, &act16, &mut gate_up, 2 * ffn, h, n)
                .map_err(|e| ModelError::Gpu(e.to_string()))?;
            {
                let mut b = s.launch_builder(&k.swiglu);
                b.arg(&gate_up).arg(&mut act).arg(&n_i).arg(&ffn_i);
                unsafe { b.launch(LaunchConfig::for_num_elems((n * ffn) as u32)) }.map_err(gpu)?;
            }
            to_bf16(&act, &mut act16, n * ffn)?;
            self.gemm
                .linear(&l.w_down, &act16, &mut proj, h, ffn, n)
                .map_err(|e| ModelError::Gpu(e.to_string()))?;
            add(&mut x, &proj, n * h)?;
        }
        rms(&x, &self.final_norm, &mut normed, n)?;
        to_bf16(&normed, &mut act16, n * h)?;
        let mut logits = s.alloc_zeros::<f32>(n * c.vocab_size).map_err(gpu)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        self.gemm
            .linear(head, &act16, &mut logits, c.vocab_size, h, n)
            .map_err(|e| ModelError::Gpu(e.to_string()))?;
        let out = s.clone_dtoh(&logits).map_err(gpu)?;
        self.len += n;
        Ok(out)
    }
}
