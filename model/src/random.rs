//! Random-weight models of real shapes (`--random-weights SHAPE`): the exact HF `config.json` of a
//! published checkpoint (`model/presets/*.json`, also read by the HF peer script) and seeded weights.
//!
//! Weights are counter-based: element `i` of tensor `tag` is `random_unit(seed, tag, i) * scale`, a
//! pure function, so the CPU builder here and the GPU fill kernel (`fill_random_bf16` in decoder.cu)
//! give bit-identical models — the GPU can build an 8B model in place without staging 16 GB on the
//! host, and a tiny random model can still be checked against the CPU oracle.

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::transformer::{Layer, Transformer};
use half::bf16;
use rayon::prelude::*;
use specula_kernels::{Matrix, MatrixData};

/// Shape presets: name and the HF `config.json` of the checkpoint whose shape it copies.
pub const PRESETS: &[(&str, &str)] = &[
    ("llama3.2-1b", include_str!("../presets/llama3.2-1b.json")),
    ("llama3.1-8b", include_str!("../presets/llama3.1-8b.json")),
    (
        "qwen2.5-coder-1.5b",
        include_str!("../presets/qwen2.5-coder-1.5b.json"),
    ),
];

/// The config of a preset, parsed by the same code as a real checkpoint's `config.json`.
pub fn preset(name: &str) -> Result<ModelConfig, ModelError> {
    let (_, json) = PRESETS.iter().find(|(n, _)| *n == name).ok_or_else(|| {
        let names: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
        ModelError::Config(format!(
            "unknown random-weight shape {name:?} (known: {})",
            names.join(", ")
        ))
    })?;
    ModelConfig::from_hf_json(json)
}

/// Uniform in [-1, 1) with 24 random bits; must stay identical to `random_unit` in decoder.cu.
pub fn random_unit(seed: u64, tag: u64, index: u64) -> f32 {
    let mut z = seed ^ tag.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = z.wrapping_add(index.wrapping_mul(0xD1B5_4A32_D192_ED03));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    ((z >> 40) as u32) as f32 * 1.192_092_9e-7 - 1.0
}

/// Half-width of the uniform distribution of matrix weights: std 0.02 (HF's `initializer_range`).
pub const MATRIX_SCALE: f32 = 0.034_641_016;
/// Norm weights: 1 + 0.1 u (not all ones, so a wrong norm weight shows in a parity check).
pub const NORM_SCALE: f32 = 0.1;
/// Biases: 0.02 u.
pub const BIAS_SCALE: f32 = 0.02;

/// What a tensor is; with the layer it gives the tensor's tag in the random stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorKind {
    Embed,
    LmHead,
    FinalNorm,
    AttnNorm,
    Wqkv,
    Bqkv,
    QNorm,
    KNorm,
    Wo,
    Bo,
    FfnNorm,
    WGateUp,
    WDown,
}

/// The tensor's tag (distinct for every tensor of a model).
pub fn tensor_tag(layer: Option<usize>, kind: TensorKind) -> u64 {
    let k = kind as u64;
    match layer {
        None => k + 1,
        Some(l) => 16 * (l as u64 + 1) + k,
    }
}

/// `n` bf16 weights of a matrix (host, rayon).
pub fn random_bf16(seed: u64, tag: u64, n: usize) -> Vec<bf16> {
    (0..n)
        .into_par_iter()
        .map(|i| bf16::from_f32(random_unit(seed, tag, i as u64) * MATRIX_SCALE))
        .collect()
}

/// `n` f32 values `offset + scale * u`.
pub fn random_f32(seed: u64, tag: u64, n: usize, scale: f32, offset: f32) -> Vec<f32> {
    (0..n)
        .map(|i| offset + random_unit(seed, tag, i as u64) * scale)
        .collect()
}

/// A CPU model of `config`'s shape with seeded bf16 weights (the same values the GPU fill makes).
/// Meant for small shapes (parity checks); real shapes belong on the GPU (`GpuTransformer::random`).
pub fn random_transformer(config: ModelConfig, seed: u64) -> Result<Transformer, ModelError> {
    config.validate()?;
    let c = &config;
    let (h, q, kv, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let matrix = |layer, kind, rows: usize, cols: usize| {
        Matrix::new(
            rows,
            cols,
            MatrixData::Bf16(random_bf16(seed, tensor_tag(layer, kind), rows * cols)),
        )
    };
    let norm = |layer, kind, n| random_f32(seed, tensor_tag(layer, kind), n, NORM_SCALE, 1.0);
    let bias = |layer, kind, n| random_f32(seed, tensor_tag(layer, kind), n, BIAS_SCALE, 0.0);
    let layers = (0..c.num_layers)
        .map(|l| {
            let l = Some(l);
            Layer {
                attn_norm: norm(l, TensorKind::AttnNorm, h),
                wqkv: matrix(l, TensorKind::Wqkv, q + 2 * kv, h),
                bqkv: c.qkv_bias.then(|| bias(l, TensorKind::Bqkv, q + 2 * kv)),
                q_norm: c.qk_norm.then(|| norm(l, TensorKind::QNorm, c.head_dim)),
                k_norm: c.qk_norm.then(|| norm(l, TensorKind::KNorm, c.head_dim)),
                wo: matrix(l, TensorKind::Wo, h, q),
                bo: c.o_bias.then(|| bias(l, TensorKind::Bo, h)),
                ffn_norm: norm(l, TensorKind::FfnNorm, h),
                w_gate_up: matrix(l, TensorKind::WGateUp, 2 * f, h),
                w_down: matrix(l, TensorKind::WDown, h, f),
            }
        })
        .collect();
    Ok(Transformer {
        embed: matrix(None, TensorKind::Embed, c.vocab_size, h),
        layers,
        final_norm: norm(None, TensorKind::FinalNorm, h),
        lm_head: (!c.tie_word_embeddings)
            .then(|| matrix(None, TensorKind::LmHead, c.vocab_size, h)),
        inv_freq: c.rope_inv_freq(),
        config,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_parse_with_the_published_shapes() {
        let l1 = preset("llama3.2-1b").unwrap();
        assert_eq!(
            (
                l1.hidden_size,
                l1.num_layers,
                l1.num_heads,
                l1.num_kv_heads,
                l1.head_dim
            ),
            (2048, 16, 32, 8, 64)
        );
        assert_eq!((l1.intermediate_size, l1.vocab_size), (8192, 128256));
        assert!(l1.tie_word_embeddings && l1.rope_scaling.is_some() && !l1.qkv_bias);
        let l8 = preset("llama3.1-8b").unwrap();
        assert_eq!(
            (l8.hidden_size, l8.num_layers, l8.head_dim),
            (4096, 32, 128)
        );
        assert!(!l8.tie_word_embeddings);
        let q = preset("qwen2.5-coder-1.5b").unwrap();
        assert_eq!(
            (
                q.hidden_size,
                q.num_layers,
                q.num_heads,
                q.num_kv_heads,
                q.head_dim
            ),
            (1536, 28, 12, 2, 128)
        );
        assert!(q.qkv_bias && q.tie_word_embeddings && q.rope_scaling.is_none());
        assert!(preset("gpt-5").is_err());
        // Weight bytes of the 1B shape: the 0.60 ms floor of the issue is 2.47 GB at ~4.1 TB/s.
        let m = random_transformer(tiny(), 1).unwrap();
        assert!(m.weight_bytes() > 0);
    }

    fn tiny() -> ModelConfig {
        let mut c = preset("qwen2.5-coder-1.5b").unwrap();
        c.hidden_size = 64;
        c.num_layers = 2;
        c.num_heads = 4;
        c.num_kv_heads = 2;
        c.head_dim = 16;
        c.intermediate_size = 96;
        c.vocab_size = 300;
        c
    }

    #[test]
    fn the_generator_is_uniform_and_seeded() {
        let a: Vec<f32> = (0..10_000).map(|i| random_unit(7, 3, i)).collect();
        assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert_ne!(random_unit(7, 3, 0), random_unit(8, 3, 0));
        assert_ne!(random_unit(7, 3, 0), random_unit(7, 4, 0));
        let m1 = random_transformer(tiny(), 5).unwrap();
        let m2 = random_transformer(tiny(), 5).unwrap();
        assert_eq!(m1.final_norm, m2.final_norm);
    }
}
