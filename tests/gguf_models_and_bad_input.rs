//! End-to-end loading through `load(path)`: GGUF models written the way llama.cpp's converter writes
//! them (including its Q/K row permutation for `llama`) give transformers' logits, and bad input of every
//! kind is a clear error from the library and from the CLI, never a panic.

use safetensors::SafeTensors;
use specula_model::gguf::{write_gguf, GgmlType, GgufTensorToWrite, GgufValue};
use specula_model::loader::load;
use specula_model::{SeqInput, WeightDtype};
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture_dir(arch: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf_parity")
        .join(arch)
}

struct TempDir(PathBuf);
impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("specula-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// llama.cpp's `permute`: rotate-half rows of each head reordered to interleaved pairs.
fn permute_rows(values: &[f32], n_heads: usize, row_len: usize) -> Vec<f32> {
    let rows = values.len() / row_len;
    let head_dim = rows / n_heads;
    let mut out = vec![0f32; values.len()];
    for h in 0..n_heads {
        for i in 0..head_dim / 2 {
            for j in 0..2 {
                let dst = h * head_dim + 2 * i + j;
                let src = h * head_dim + j * head_dim / 2 + i;
                out[dst * row_len..(dst + 1) * row_len]
                    .copy_from_slice(&values[src * row_len..(src + 1) * row_len]);
            }
        }
    }
    out
}

/// Converts an HF fixture to GGUF as llama.cpp's convert_hf_to_gguf.py would (f32 tensors).
/// `override_type` replaces the type of one tensor to test unsupported types.
fn write_fixture_gguf(arch: &str, path: &Path, override_type: Option<(&str, GgmlType)>) {
    let dir = fixture_dir(arch);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let model_type = cfg["model_type"].as_str().unwrap();
    let u = |k: &str| cfg[k].as_u64().unwrap() as u32;
    let (n_heads, n_kv) = (
        u("num_attention_heads") as usize,
        u("num_key_value_heads") as usize,
    );
    let rope_theta = cfg["rope_parameters"]["rope_theta"].as_f64().unwrap() as f32;
    let md = vec![
        (
            "general.architecture".to_string(),
            GgufValue::String(model_type.into()),
        ),
        (
            format!("{model_type}.context_length"),
            GgufValue::U32(u("max_position_embeddings")),
        ),
        (
            format!("{model_type}.embedding_length"),
            GgufValue::U32(u("hidden_size")),
        ),
        (
            format!("{model_type}.feed_forward_length"),
            GgufValue::U32(u("intermediate_size")),
        ),
        (
            format!("{model_type}.block_count"),
            GgufValue::U32(u("num_hidden_layers")),
        ),
        (
            format!("{model_type}.attention.head_count"),
            GgufValue::U32(n_heads as u32),
        ),
        (
            format!("{model_type}.attention.head_count_kv"),
            GgufValue::U32(n_kv as u32),
        ),
        (
            format!("{model_type}.attention.key_length"),
            GgufValue::U32(u("head_dim")),
        ),
        (
            format!("{model_type}.rope.freq_base"),
            GgufValue::F32(rope_theta),
        ),
        (
            format!("{model_type}.attention.layer_norm_rms_epsilon"),
            GgufValue::F32(cfg["rms_norm_eps"].as_f64().unwrap() as f32),
        ),
    ];
    let mut tensors = Vec::new();
    for (name, view) in st.tensors() {
        let shape = view.shape().to_vec();
        let mut values = f32s(view.data());
        let gname = name
            .replace("model.embed_tokens.weight", "token_embd.weight")
            .replace("model.norm.weight", "output_norm.weight")
            .replace("lm_head.weight", "output.weight")
            .replace("model.layers.", "blk.")
            .replace(".input_layernorm.", ".attn_norm.")
            .replace(".post_attention_layernorm.", ".ffn_norm.")
            .replace(".self_attn.q_proj.", ".attn_q.")
            .replace(".self_attn.k_proj.", ".attn_k.")
            .replace(".self_attn.v_proj.", ".attn_v.")
            .replace(".self_attn.o_proj.", ".attn_output.")
            .replace(".self_attn.q_norm.", ".attn_q_norm.")
            .replace(".self_attn.k_norm.", ".attn_k_norm.")
            .replace(".mlp.gate_proj.", ".ffn_gate.")
            .replace(".mlp.up_proj.", ".ffn_up.")
            .replace(".mlp.down_proj.", ".ffn_down.");
        if model_type == "llama" {
            let row_len = if shape.len() == 2 { shape[1] } else { 1 };
            if gname.contains(".attn_q.") {
                values = permute_rows(&values, n_heads, row_len);
            } else if gname.contains(".attn_k.") {
                values = permute_rows(&values, n_kv, row_len);
            }
        }
        let mut ggml_type = GgmlType::F32;
        let mut data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        if let Some((which, ty)) = override_type {
            if gname == which {
                ggml_type = ty;
                let n = values.len() as u64 / ty.block_size() * ty.type_size();
                data = vec![0u8; n as usize];
            }
        }
        tensors.push(GgufTensorToWrite {
            name: gname,
            dims: shape.iter().rev().map(|&d| d as u64).collect(),
            ggml_type,
            data,
        });
    }
    write_gguf(path, &md, &tensors).unwrap();
}

fn max_rel_err(ours: &[f32], reference: &[f32]) -> f64 {
    let scale = reference.iter().fold(0f64, |m, &v| m.max(v.abs() as f64));
    ours.iter()
        .zip(reference)
        .fold(0f64, |m, (&a, &b)| m.max((a as f64 - b as f64).abs()))
        / scale
}

#[test]
fn gguf_checkpoints_match_transformers_including_llama_permutation() {
    let tmp = TempDir::new("gguf-parity");
    for arch in ["llama", "qwen2", "qwen3"] {
        let path = tmp.0.join(format!("{arch}.gguf"));
        write_fixture_gguf(arch, &path, None);
        let loaded = load(&path, WeightDtype::F32).unwrap();
        let expected = std::fs::read(fixture_dir(arch).join("expected.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&expected).unwrap();
        let ids: Vec<u32> = st
            .tensor("input_ids")
            .unwrap()
            .data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect();
        let want = f32s(st.tensor("logits").unwrap().data());
        let model = &loaded.model;
        let mut cache = model.new_cache(256);
        let seq = cache.add_sequence();
        let out = model
            .forward(
                &mut cache,
                &[SeqInput {
                    seq,
                    tokens: &ids,
                    num_logits: ids.len(),
                }],
                &[],
            )
            .unwrap();
        let err = max_rel_err(&out.logits, &want);
        assert!(err <= 1e-4, "{arch} GGUF: relative error {err:e}");
        assert!(loaded.tokenizer.is_none());
        assert!(loaded
            .tokenizer()
            .unwrap_err()
            .to_string()
            .contains("no tokenizer"));
    }
}

fn err_string(path: &Path) -> String {
    match load(path, WeightDtype::Auto) {
        Ok(_) => panic!("{} loaded but should not have", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn corrupt_checkpoints_are_clear_errors() {
    let tmp = TempDir::new("corrupt");
    // Truncated GGUF.
    let good = tmp.0.join("good.gguf");
    write_fixture_gguf("qwen2", &good, None);
    let bytes = std::fs::read(&good).unwrap();
    for cut in [10, 200, bytes.len() / 2, bytes.len() - 1] {
        let p = tmp.0.join("truncated.gguf");
        std::fs::write(&p, &bytes[..cut]).unwrap();
        let e = err_string(&p);
        assert!(e.contains("truncated.gguf"), "{e}");
    }
    // Unknown quantisation type named in the message.
    let q2 = tmp.0.join("q2k.gguf");
    write_fixture_gguf("qwen2", &q2, Some(("blk.0.ffn_up.weight", GgmlType::Q8_1)));
    let e = err_string(&q2);
    assert!(
        e.contains("Q8_1") && e.contains("blk.0.ffn_up.weight"),
        "{e}"
    );
    // Truncated and corrupt safetensors.
    let dir = tmp.0.join("hf");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        fixture_dir("qwen2").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    let st = std::fs::read(fixture_dir("qwen2").join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &st[..st.len() - 100]).unwrap();
    let e = err_string(&dir);
    assert!(e.contains("corrupt or truncated"), "{e}");
    std::fs::write(
        dir.join("model.safetensors"),
        b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage",
    )
    .unwrap();
    assert!(err_string(&dir).contains("corrupt or truncated"));
    // Config / tensor shape mismatch.
    std::fs::write(dir.join("model.safetensors"), &st).unwrap();
    let cfg = std::fs::read_to_string(fixture_dir("qwen2").join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        cfg.replace("\"intermediate_size\": 176", "\"intermediate_size\": 200"),
    )
    .unwrap();
    let e = err_string(&dir);
    assert!(
        e.contains("mlp.gate_proj.weight") && e.contains("200"),
        "{e}"
    );
    // Broken config JSON, missing config.
    std::fs::write(dir.join("config.json"), "{ not json").unwrap();
    assert!(err_string(&dir).contains("config.json"));
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert!(err_string(&dir).contains("config.json"));
    // Not a model at all.
    let junk = tmp.0.join("junk.bin");
    std::fs::write(&junk, b"hello").unwrap();
    assert!(err_string(&junk).contains("not a GGUF"));
    assert!(err_string(&tmp.0.join("does-not-exist.gguf")).contains("does-not-exist.gguf"));
}

/// A tiny HF model directory with a byte-level tokenizer (256 byte tokens, no merges) and a short
/// context, so the CLI can be driven end to end.
fn model_dir_with_tokenizer(tmp: &Path, context: usize) -> PathBuf {
    model_dir_with_tokenizer_named(tmp, "tiny", context, false)
}

/// `shuffled` assigns the byte tokens in reverse order: the same size, a different vocabulary.
fn model_dir_with_tokenizer_named(
    tmp: &Path,
    name: &str,
    context: usize,
    shuffled: bool,
) -> PathBuf {
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    let dir = tmp.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = std::fs::read_to_string(fixture_dir("qwen2").join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        cfg.replace(
            "\"max_position_embeddings\": 512",
            &format!("\"max_position_embeddings\": {context}"),
        ),
    )
    .unwrap();
    std::fs::copy(
        fixture_dir("qwen2").join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort_unstable();
    if shuffled {
        alphabet.reverse();
    }
    let mut vocab = tokenizers::models::bpe::Vocab::default();
    for (id, c) in alphabet.into_iter().enumerate() {
        vocab.insert(c.to_string(), id as u32);
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, vec![])
        .build()
        .unwrap();
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.save(dir.join("tokenizer.json"), false).unwrap();
    dir
}

fn run_cli(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_specula"))
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "the CLI panicked: {stderr}");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr,
    )
}

#[test]
fn cli_generates_and_refuses_bad_requests_clearly() {
    let tmp = TempDir::new("cli");
    let dir = model_dir_with_tokenizer(&tmp.0, 32);
    let d = dir.to_str().unwrap();
    let (ok, stdout, stderr) = run_cli(&[
        "generate",
        "--model",
        d,
        "--prompt",
        "hello",
        "--max-tokens",
        "5",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["prompt_token_ids"].as_array().unwrap().len(), 5);
    assert_eq!(v["token_ids"].as_array().unwrap().len(), 5);
    assert_eq!(v["stats"]["generated_tokens"], 5);
    // Seeded sampling is reproducible.
    let sampled = |seed: &str| {
        let (ok, stdout, stderr) = run_cli(&[
            "generate",
            "--model",
            d,
            "--prompt",
            "hi",
            "--max-tokens",
            "8",
            "--temperature",
            "1",
            "--seed",
            seed,
            "--json",
        ]);
        assert!(ok, "{stderr}");
        stdout
    };
    let token_ids =
        |s: String| serde_json::from_str::<serde_json::Value>(&s).unwrap()["token_ids"].clone();
    assert_eq!(token_ids(sampled("3")), token_ids(sampled("3")));

    let (ok, _, stderr) = run_cli(&[
        "generate",
        "--model",
        d,
        "--prompt",
        "",
        "--max-tokens",
        "5",
    ]);
    assert!(!ok && stderr.contains("prompt is empty"), "{stderr}");
    let long = "x".repeat(40);
    let (ok, _, stderr) = run_cli(&[
        "generate",
        "--model",
        d,
        "--prompt",
        &long,
        "--max-tokens",
        "5",
    ]);
    assert!(
        !ok && stderr.contains("40 tokens") && stderr.contains("context is 32"),
        "{stderr}"
    );
    let (ok, _, stderr) = run_cli(&[
        "generate",
        "--model",
        d,
        "--prompt",
        "hi",
        "--temperature=-1",
    ]);
    assert!(!ok && stderr.contains("temperature"), "{stderr}");
    // A checkpoint without a tokenizer.
    let bare = fixture_dir("qwen2");
    let (ok, _, stderr) = run_cli(&[
        "generate",
        "--model",
        bare.to_str().unwrap(),
        "--prompt",
        "hi",
    ]);
    assert!(!ok && stderr.contains("no tokenizer"), "{stderr}");
    let (ok, _, stderr) = run_cli(&[
        "generate",
        "--model",
        "/nonexistent/model.gguf",
        "--prompt",
        "hi",
    ]);
    assert!(
        !ok && stderr.contains("/nonexistent/model.gguf"),
        "{stderr}"
    );
}

#[test]
fn cli_speculation_matches_plain_and_refuses_mismatched_vocabularies() {
    let tmp = TempDir::new("cli-spec");
    let dir = model_dir_with_tokenizer(&tmp.0, 64);
    let d = dir.to_str().unwrap();
    let ids = |args: &[&str]| -> serde_json::Value {
        let (ok, stdout, stderr) = run_cli(args);
        assert!(ok, "{stderr}");
        serde_json::from_str(&stdout).unwrap()
    };
    let base = [
        "generate",
        "--model",
        d,
        "--prompt",
        "abcabcabc",
        "--max-tokens",
        "12",
        "--json",
    ];
    let plain = ids(&base);
    assert!(plain["stats"].get("acceptance_length").is_some());
    for extra in [
        vec!["--draft", "ngram", "--num-draft-tokens", "3"],
        vec![
            "--draft",
            d,
            "--num-draft-tokens",
            "4",
            "--acceptance",
            "block",
        ],
        vec![
            "--speculative-config",
            r#"{"method": "ngram", "num_speculative_tokens": 2}"#,
        ],
    ] {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let spec = ids(&args);
        assert_eq!(spec["token_ids"], plain["token_ids"], "{extra:?}");
        assert_eq!(spec["stats"]["acceptance_mode"], "natural");
        assert!(spec["stats"]["num_verify_steps"].as_u64().unwrap() >= 1);
        assert!(spec["stats"]["per_position_acceptance"]["unconditional"].is_array());
    }
    // Synthetic acceptance is labelled as such.
    let args: Vec<&str> = base
        .iter()
        .copied()
        .chain([
            "--draft",
            d,
            "--num-draft-tokens",
            "7",
            "--synthetic-acceptance-length",
            "3.78",
        ])
        .collect();
    assert_eq!(ids(&args)["stats"]["acceptance_mode"], "synthetic");
    // Stop strings end generation and are cut from the text.
    let text = plain["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    if chars.len() >= 6 {
        let stop: String = chars[3..5].iter().collect();
        let args: Vec<&str> = base
            .iter()
            .copied()
            .chain(["--stop", stop.as_str()])
            .collect();
        let stopped = ids(&args);
        let cut = text.find(&stop).unwrap();
        assert_eq!(stopped["text"].as_str().unwrap(), &text[..cut]);
        assert_eq!(stopped["finish_reason"], "stop");
    }
    // A draft model with another vocabulary is refused.
    let other = model_dir_with_tokenizer_named(&tmp.0, "other", 64, true);
    let args: Vec<&str> = base
        .iter()
        .copied()
        .chain(["--draft", other.to_str().unwrap()])
        .collect();
    let (ok, _, stderr) = run_cli(&args);
    assert!(
        !ok && stderr.contains("do not share a vocabulary"),
        "{stderr}"
    );
    // Bad speculative settings are clear errors.
    for (extra, needle) in [
        (
            vec!["--draft", "ngram", "--num-draft-tokens", "17"],
            "1..=16",
        ),
        (
            vec![
                "--draft",
                "ngram",
                "--acceptance",
                "greedy",
                "--temperature",
                "0.7",
            ],
            "temperature 0",
        ),
        (
            vec!["--draft", "ngram", "--synthetic-acceptance-length", "9"],
            "acceptance length",
        ),
        (
            vec!["--speculative-config", "{\"method\": 1}"],
            "speculative-config",
        ),
    ] {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let (ok, _, stderr) = run_cli(&args);
        assert!(!ok && stderr.contains(needle), "{extra:?}: {stderr}");
    }
}
