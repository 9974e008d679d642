//! Runs each CUDA decoder kernel on fresh random inputs and compares it with the CPU reference kernel
//! (the oracle). Prints one line per kernel and exits non-zero on a mismatch. Needs a GPU:
//! cargo build --release -p specula-experiments --features cuda --bin gpu_kernel_check

use anyhow::{bail, Context, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specula_experiments::max_relative_error as max_rel;
use specula_kernels::cpu::{self, KvSource};
use specula_kernels::cuda::{Gemm, GpuDevice};
use specula_kernels::Matrix;
use std::time::Instant;

fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

struct Contiguous<'a> {
    k: &'a [f32],
    v: &'a [f32],
    kv_dim: usize,
}
impl KvSource for Contiguous<'_> {
    fn key(&self, p: usize) -> &[f32] {
        &self.k[p * self.kv_dim..(p + 1) * self.kv_dim]
    }
    fn value(&self, p: usize) -> &[f32] {
        &self.v[p * self.kv_dim..(p + 1) * self.kv_dim]
    }
}

fn main() -> Result<()> {
    let t = Instant::now();
    let dev = GpuDevice::new(0).context("opening the GPU")?;
    println!(
        "device {} ({}), NVRTC compile + load {:.2} s",
        dev.name,
        dev.arch,
        t.elapsed().as_secs_f64()
    );
    let s = &dev.stream;
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let mut failures = Vec::new();
    let mut report = |name: &str, err: f64, limit: f64| {
        let ok = err <= limit;
        println!(
            "{name:<14} max relative error {err:.3e} (limit {limit:.0e}) {}",
            if ok { "ok" } else { "FAIL" }
        );
        if !ok {
            failures.push(name.to_string());
        }
    };

    // rms_norm
    let (rows, dim) = (33usize, 1536usize);
    let x = random(&mut rng, rows * dim);
    let w = random(&mut rng, dim);
    let mut want = vec![0f32; rows * dim];
    cpu::rms_norm(&x, &w, 1e-6, &mut want);
    let (dx, dw) = (s.clone_htod(&x)?, s.clone_htod(&w)?);
    let mut dout = s.alloc_zeros::<f32>(rows * dim)?;
    let f = dev.function("rms_norm")?;
    let (dim_i, eps) = (dim as i32, 1e-6f32);
    let mut b = s.launch_builder(&f);
    b.arg(&dx).arg(&dw).arg(&mut dout).arg(&dim_i).arg(&eps);
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        })
    }?;
    report("rms_norm", max_rel(&s.clone_dtoh(&dout)?, &want), 1e-5);

    // embed_rows (bf16 table): exact
    let (vocab, h) = (1000usize, 256usize);
    let table = Matrix::from_f32_as_bf16(vocab, h, &random(&mut rng, vocab * h));
    let ids: Vec<u32> = (0..17).map(|_| rng.random_range(0..vocab as u32)).collect();
    let bits: Vec<u16> = match &table.data {
        specula_kernels::MatrixData::Bf16(v) => v.iter().map(|x| x.to_bits()).collect(),
        _ => unreachable!(),
    };
    let mut want = vec![0f32; ids.len() * h];
    for (i, &id) in ids.iter().enumerate() {
        table.row_to_f32(id as usize, &mut want[i * h..(i + 1) * h]);
    }
    let (dt, di) = (s.clone_htod(&bits)?, s.clone_htod(&ids)?);
    let mut dout = s.alloc_zeros::<f32>(ids.len() * h)?;
    let f = dev.function("embed_rows")?;
    let h_i = h as i32;
    let mut b = s.launch_builder(&f);
    b.arg(&dt).arg(&di).arg(&mut dout).arg(&h_i);
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (ids.len() as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        })
    }?;
    report("embed_rows", max_rel(&s.clone_dtoh(&dout)?, &want), 0.0);

    // swiglu
    let (rows, ffn) = (9usize, 4864usize);
    let gu = random(&mut rng, rows * 2 * ffn);
    let mut want = vec![0f32; rows * ffn];
    cpu::swiglu_rows(&gu, ffn, &mut want);
    let dgu = s.clone_htod(&gu)?;
    let mut dout = s.alloc_zeros::<f32>(rows * ffn)?;
    let f = dev.function("swiglu")?;
    let (r_i, f_i) = (rows as i32, ffn as i32);
    let mut b = s.launch_builder(&f);
    b.arg(&dgu).arg(&mut dout).arg(&r_i).arg(&f_i);
    unsafe { b.launch(LaunchConfig::for_num_elems((rows * ffn) as u32)) }?;
    report("swiglu", max_rel(&s.clone_dtoh(&dout)?, &want), 1e-5);

    // argmax_rows over a Qwen-sized vocabulary: exact
    let (rows, vocab) = (8usize, 151936usize);
    let logits = random(&mut rng, rows * vocab);
    let dl = s.clone_htod(&logits)?;
    let mut dout = s.alloc_zeros::<u32>(rows)?;
    let f = dev.function("argmax_rows")?;
    let v_i = vocab as i32;
    let mut b = s.launch_builder(&f);
    b.arg(&dl).arg(&v_i).arg(&mut dout);
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        })
    }?;
    let got = s.clone_dtoh(&dout)?;
    let want: Vec<u32> = (0..rows)
        .map(|r| specula_kernels::sampling::argmax(&logits[r * vocab..(r + 1) * vocab]).unwrap())
        .collect();
    report("argmax_rows", if got == want { 0.0 } else { 1.0 }, 0.0);

    // rope + attention of 8 new tokens (verify step) at positions 40..48 over a paged cache
    let (n_heads, n_kv, hd, ctx, new) = (12usize, 2usize, 128usize, 48usize, 8usize);
    let kv_dim = n_kv * hd;
    let width = n_heads * hd + 2 * kv_dim;
    let qkv = random(&mut rng, new * width);
    let kcache = random(&mut rng, ctx * kv_dim);
    let vcache = random(&mut rng, ctx * kv_dim);
    let positions: Vec<i32> = (ctx - new..ctx).map(|p| p as i32).collect();
    let inv_freq: Vec<f64> = (0..hd / 2)
        .map(|i| 1.0 / 1e6f64.powf(2.0 * i as f64 / hd as f64))
        .collect();
    // CPU: rope on q, then attention over the contiguous cache.
    let mut q: Vec<f32> = (0..new)
        .flat_map(|t| qkv[t * width..t * width + n_heads * hd].to_vec())
        .collect();
    let pos_us: Vec<usize> = positions.iter().map(|&p| p as usize).collect();
    cpu::apply_rope(
        &mut q,
        &pos_us,
        n_heads,
        hd,
        &inv_freq,
        cpu::RopeLayout::Neox,
    );
    let mut want = vec![0f32; new * n_heads * hd];
    let src = Contiguous {
        k: &kcache,
        v: &vcache,
        kv_dim,
    };
    cpu::attention(
        &q,
        &src,
        ctx - new,
        n_heads,
        n_kv,
        hd,
        1.0 / (hd as f32).sqrt(),
        &mut want,
    );
    // GPU: the cache is paged in blocks of 16 whose physical order is reversed, to exercise the table.
    let bs = 16usize;
    let nblocks = ctx / bs;
    let table: Vec<i32> = (0..nblocks).map(|b| (nblocks - 1 - b) as i32).collect();
    let mut kp = vec![0f32; ctx * kv_dim];
    let mut vp = vec![0f32; ctx * kv_dim];
    for p in 0..ctx {
        let slot = table[p / bs] as usize * bs + p % bs;
        kp[slot * kv_dim..(slot + 1) * kv_dim]
            .copy_from_slice(&kcache[p * kv_dim..(p + 1) * kv_dim]);
        vp[slot * kv_dim..(slot + 1) * kv_dim]
            .copy_from_slice(&vcache[p * kv_dim..(p + 1) * kv_dim]);
    }
    let mut dqkv = s.clone_htod(&qkv)?;
    let dpos = s.clone_htod(&positions)?;
    let dinv = s.clone_htod(&inv_freq)?;
    let f = dev.function("rope_neox")?;
    let (w_i, zero, hd_i) = (width as i32, 0i32, hd as i32);
    let mut b = s.launch_builder(&f);
    b.arg(&mut dqkv)
        .arg(&w_i)
        .arg(&zero)
        .arg(&dpos)
        .arg(&dinv)
        .arg(&hd_i);
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (new as u32, n_heads as u32, 1),
            block_dim: ((hd / 2) as u32, 1, 1),
            shared_mem_bytes: 0,
        })
    }?;
    let (dk, dv) = (s.clone_htod(&kp)?, s.clone_htod(&vp)?);
    let dtable = s.clone_htod(&table)?;
    let row_table = s.clone_htod(&vec![0i32; new])?;
    let mut dout = s.alloc_zeros::<f32>(new * n_heads * hd)?;
    let f = dev.function("attention")?;
    let (nh_i, nkv_i, mb_i, bs_i, scale) = (
        n_heads as i32,
        n_kv as i32,
        nblocks as i32,
        bs as i32,
        1.0 / (hd as f32).sqrt(),
    );
    let mut b = s.launch_builder(&f);
    b.arg(&dqkv)
        .arg(&w_i)
        .arg(&nh_i)
        .arg(&nkv_i)
        .arg(&hd_i)
        .arg(&dpos)
        .arg(&row_table)
        .arg(&mb_i)
        .arg(&dtable)
        .arg(&bs_i)
        .arg(&dk)
        .arg(&dv)
        .arg(&mut dout)
        .arg(&scale);
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (new as u32, n_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: (ctx * 4) as u32,
        })
    }?;
    report(
        "rope+attention",
        max_rel(&s.clone_dtoh(&dout)?, &want),
        1e-5,
    );

    // cuBLAS linear layer: bf16 weights x bf16 activations, f32 accumulate and output.
    let gemm = Gemm::new(&dev)?;
    let (rows, cols, n) = (4864usize, 1536usize, 8usize);
    let wf = random(&mut rng, rows * cols);
    let w = Matrix::from_f32_as_bf16(rows, cols, &wf);
    let x = random(&mut rng, n * cols);
    let xb: Vec<u16> = x
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect();
    let x_rounded: Vec<f32> = xb
        .iter()
        .map(|&b| half::bf16::from_bits(b).to_f32())
        .collect();
    let wbits: Vec<u16> = match &w.data {
        specula_kernels::MatrixData::Bf16(v) => v.iter().map(|x| x.to_bits()).collect(),
        _ => unreachable!(),
    };
    let (dw, dx) = (s.clone_htod(&wbits)?, s.clone_htod(&xb)?);
    let mut dout = s.alloc_zeros::<f32>(n * rows)?;
    gemm.linear(&dw, &dx, &mut dout, rows, cols, n)?;
    let got = s.clone_dtoh(&dout)?;
    let mut want_rounded = vec![0f32; n * rows];
    cpu::matmul(&x_rounded, n, &w, &mut want_rounded);
    let mut want_f32 = vec![0f32; n * rows];
    cpu::matmul(&x, n, &w, &mut want_f32);
    report("gemm_bf16", max_rel(&got, &want_rounded), 1e-4);
    report("gemm vs f32 x", max_rel(&got, &want_f32), 1e-2);

    if !failures.is_empty() {
        bail!("kernels differ from the CPU reference: {failures:?}");
    }
    println!("all kernels match the CPU reference");

    // Timings (CUDA events, warm-up, median of repeats): copy bandwidth, then cuBLAS linear layers of
    // the Llama-3.2-1B shapes at 1 and 8 tokens, as the fraction of bandwidth their weight bytes reach.
    let timing = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
    let median_ms = |f: &mut dyn FnMut() -> Result<()>, reps: usize| -> Result<f64> {
        for _ in 0..5 {
            f()?;
        }
        let mut t = Vec::with_capacity(reps);
        for _ in 0..reps {
            let a = s.record_event(Some(timing))?;
            f()?;
            let b = s.record_event(Some(timing))?;
            t.push(a.elapsed_ms(&b)? as f64);
        }
        t.sort_by(f64::total_cmp);
        Ok(t[t.len() / 2])
    };
    let bytes = 1usize << 30;
    let src = s.alloc_zeros::<u8>(bytes)?;
    let mut dst = s.alloc_zeros::<u8>(bytes)?;
    let copy_ms = median_ms(&mut || Ok(s.memcpy_dtod(&src, &mut dst)?), 20)?;
    // A copy reads and writes every byte.
    let bw = 2.0 * bytes as f64 / (copy_ms * 1e-3) / 1e12;
    println!("\ncopy bandwidth {bw:.3} TB/s (1 GiB device-to-device, median of 20)");
    println!("| linear (rows x cols) | tokens | median us | weight GB/s | % of copy bandwidth |");
    println!("|---|---|---|---|---|");
    for (name, rows, cols) in [
        ("qkv", 3072usize, 2048usize),
        ("o", 2048, 2048),
        ("gate_up", 16384, 2048),
        ("down", 2048, 8192),
        ("lm_head", 128256, 2048),
    ] {
        let w = s.alloc_zeros::<u16>(rows * cols)?;
        for n in [1usize, 8] {
            let x = s.alloc_zeros::<u16>(n * cols)?;
            let mut out = s.alloc_zeros::<f32>(n * rows)?;
            let ms = median_ms(
                &mut || Ok(gemm.linear(&w, &x, &mut out, rows, cols, n)?),
                50,
            )?;
            let gbs = (rows * cols * 2) as f64 / (ms * 1e-3) / 1e9;
            println!(
                "| {name} ({rows} x {cols}) | {n} | {:.1} | {gbs:.0} | {:.0}% |",
                ms * 1e3,
                gbs / (bw * 1e3) * 100.0
            );
        }
    }
    Ok(())
}
