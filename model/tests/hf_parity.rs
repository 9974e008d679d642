//! Parity with HF transformers on tiny random checkpoints written by transformers itself
//! (`tests/fixtures/hf_parity/make_fixtures.py`, and the DSpark fixture's Qwen3 target), in f32.

use safetensors::SafeTensors;
use specula_model::{ModelConfig, SafetensorsSource, SeqInput, Transformer, WeightDtype};
use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn read_f32(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn read_ids(st: &SafeTensors, name: &str) -> Vec<u32> {
    let t = st.tensor(name).unwrap();
    match t.dtype() {
        safetensors::Dtype::I64 => t
            .data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect(),
        safetensors::Dtype::I32 => t
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect(),
        d => panic!("{name}: unexpected dtype {d:?}"),
    }
}

/// max |ours - ref| / max |ref|: relative to the scale of the whole tensor, so near-zero entries do
/// not turn rounding noise into huge ratios.
fn rel_err(ours: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(ours.len(), reference.len());
    let scale = reference.iter().fold(0f64, |m, &v| m.max(v.abs() as f64));
    let diff = ours
        .iter()
        .zip(reference)
        .fold(0f64, |m, (&a, &b)| m.max((a as f64 - b as f64).abs()));
    diff / scale
}

fn load(config: &Path, weights: &Path) -> Transformer {
    let cfg = ModelConfig::from_hf_json(&std::fs::read_to_string(config).unwrap()).unwrap();
    let src = SafetensorsSource::open(&[weights.to_path_buf()]).unwrap();
    Transformer::load(cfg, &src, WeightDtype::F32).unwrap()
}

fn check(name: &str, model: Transformer, expected: &Path, hidden_name: Option<&str>) {
    let bytes = std::fs::read(expected).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids = read_ids(
        &st,
        if hidden_name.is_some() {
            "input_ids"
        } else {
            "prompt_ids"
        },
    );
    let want = read_f32(
        &st,
        if hidden_name.is_some() {
            "logits"
        } else {
            "target_logits"
        },
    );
    let nl = model.config.num_layers;
    let mut cache = model.new_cache(1024);
    let seq = cache.add_sequence();
    let layers: Vec<usize> = (0..nl).collect();
    let out = model
        .forward(
            &mut cache,
            &[SeqInput {
                seq,
                tokens: &ids,
                num_logits: ids.len(),
            }],
            &layers,
        )
        .unwrap();
    let err = rel_err(&out.logits, &want);
    println!(
        "{name}: logits max relative error {err:.3e} over {} values",
        want.len()
    );
    assert!(err <= 1e-4, "{name}: logits relative error {err:e} > 1e-4");
    if let Some(hn) = hidden_name {
        let hs = read_f32(&st, hn);
        let per = ids.len() * model.config.hidden_size;
        // HF hidden_states[l + 1] is the output of layer l; the last entry is after the final norm,
        // so compare the intermediate layers.
        for l in 0..nl - 1 {
            let e = rel_err(&out.hidden[l], &hs[(l + 1) * per..(l + 2) * per]);
            assert!(
                e <= 1e-4,
                "{name}: hidden state of layer {l} relative error {e:e}"
            );
        }
    }
}

#[test]
fn llama_qwen2_qwen3_logits_match_transformers() {
    for arch in ["llama", "llama3_rope", "qwen2", "qwen3"] {
        let dir = repo_root().join("tests/fixtures/hf_parity").join(arch);
        let model = load(&dir.join("config.json"), &dir.join("model.safetensors"));
        check(
            arch,
            model,
            &dir.join("expected.safetensors"),
            Some("hidden_states"),
        );
    }
}

#[test]
fn dspark_fixture_qwen3_target_matches_transformers() {
    let dir = repo_root().join("../shared/fixtures/dspark-deepspec");
    if !dir.exists() {
        panic!(
            "{} is missing: the shared fixtures must sit beside the repository",
            dir.display()
        );
    }
    let model = load(
        &dir.join("target_config.json"),
        &dir.join("target.safetensors"),
    );
    check(
        "dspark target",
        model,
        &dir.join("expected.safetensors"),
        None,
    );
}
