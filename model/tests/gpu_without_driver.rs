//! Without an NVIDIA driver the GPU model is a clear error that names the CPU fallback, never a panic
//! (cudarc would panic on a missing library if it were touched).
#![cfg(feature = "cuda")]

use specula_model::gpu::{GpuOptions, GpuTransformer};
use specula_model::random::{preset, random_transformer};

#[test]
fn no_driver_is_a_clear_error_naming_the_cpu_backend() {
    if specula_kernels::cuda::driver_available() {
        eprintln!("SKIPPED: this machine has a CUDA driver");
        return;
    }
    let mut config = preset("llama3.2-1b").unwrap();
    config.num_layers = 1;
    config.hidden_size = 64;
    config.num_heads = 2;
    config.num_kv_heads = 1;
    config.head_dim = 32;
    config.intermediate_size = 96;
    config.vocab_size = 128;
    let err = GpuTransformer::random(config.clone(), 1, GpuOptions::default())
        .err()
        .expect("no driver, so no GPU model");
    assert!(err.to_string().contains("CPU"), "{err}");
    let cpu = random_transformer(config, 1).unwrap();
    let err = GpuTransformer::upload(&cpu, GpuOptions::default())
        .err()
        .expect("no driver, so no GPU model");
    assert!(err.to_string().contains("CPU"), "{err}");
}
