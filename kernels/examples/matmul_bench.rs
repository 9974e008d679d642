//! Matmul-only speed of the CPU kernels, side by side in one process: each shape and token count
//! runs every kernel in turn (A B A B ...) so background load hits them alike; reports the median
//! and the minimum per kernel and the ratios first/last kernel (AVX2 / AVX-512 where both exist).
//! `RAYON_NUM_THREADS=1` leaves the other core to whatever else runs on the machine.
//!
//! cargo run --release -p specula-kernels --example matmul_bench [-- REPS]

use specula_kernels::cpu::{matmul_with, CpuKernel};
use specula_kernels::matrix::Matrix;
use std::time::Instant;

fn main() {
    let reps: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(9);
    let kernels: Vec<CpuKernel> = CpuKernel::available()
        .into_iter()
        .filter(|k| *k != CpuKernel::Portable)
        .collect();
    // Qwen2.5-Coder-1.5B shapes: down projection (1536 x 8960) and fused gate/up (17920 x 1536).
    for &(rows, cols) in &[(1536usize, 8960usize), (17920, 1536)] {
        let wf: Vec<f32> = (0..rows * cols)
            .map(|i| ((i as u64).wrapping_mul(2654435761) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let w = Matrix::from_f32_as_bf16(rows, cols, &wf);
        drop(wf);
        for &n in &[1usize, 8, 24, 40] {
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i % 97) as f32 - 48.0) / 50.0)
                .collect();
            let mut out = vec![0f32; n * rows];
            let mut times: Vec<Vec<f64>> = vec![Vec::new(); kernels.len()];
            for rep in 0..=reps {
                for (ki, &k) in kernels.iter().enumerate() {
                    let t = Instant::now();
                    matmul_with(k, &x, n, &w, &mut out);
                    if rep > 0 {
                        times[ki].push(t.elapsed().as_secs_f64() * 1e3);
                    }
                }
            }
            let mins: Vec<f64> = times
                .iter()
                .map(|v| v.iter().copied().fold(f64::INFINITY, f64::min))
                .collect();
            let med: Vec<f64> = times
                .iter_mut()
                .map(|v| {
                    v.sort_by(|a, b| a.total_cmp(b));
                    v[v.len() / 2]
                })
                .collect();
            let cells: Vec<String> = kernels
                .iter()
                .zip(&med)
                .zip(&mins)
                .map(|((k, m), mn)| format!("{} {:.2} ms (min {:.2})", k.name(), m, mn))
                .collect();
            println!(
                "bf16 {rows}x{cols}, {n:2} tokens: {} | median ratio first/last {:.2}x, min ratio {:.2}x",
                cells.join(", "),
                med[0] / med[med.len() - 1],
                mins[0] / mins[mins.len() - 1]
            );
        }
    }
}
