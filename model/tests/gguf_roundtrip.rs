//! GGUF files written by our writer and by the reference `gguf.GGUFWriter` read back correctly.

use std::path::PathBuf;

use proptest::prelude::*;
use serde_json::Value as Json;
use specula_model::gguf::{
    dequantize, write_gguf, GgmlType, GgufError, GgufFile, GgufTensorToWrite, GgufValue,
};

/// A fresh path in cargo's per-test-target scratch directory.
fn scratch_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("gguf_roundtrip_{name}.gguf"))
}

fn f16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
        .collect()
}

/// Deterministic pseudo-random bytes (no need for a real RNG here).
fn pattern_bytes(n: usize, seed: u32) -> Vec<u8> {
    let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state >> 24) as u8
        })
        .collect()
}

fn sample_metadata() -> Vec<(String, GgufValue)> {
    let entries = vec![
        ("general.architecture", GgufValue::String("llama".into())),
        ("general.name", GgufValue::String("tiny ✓ test".into())),
        ("general.alignment", GgufValue::U32(32)),
        ("test.u8", GgufValue::U8(255)),
        ("test.i8", GgufValue::I8(-128)),
        ("test.u16", GgufValue::U16(65535)),
        ("test.i16", GgufValue::I16(-32768)),
        ("test.u32", GgufValue::U32(4_000_000_000)),
        ("test.i32", GgufValue::I32(-2_000_000_000)),
        ("test.u64", GgufValue::U64(u64::MAX)),
        ("test.i64", GgufValue::I64(i64::MIN)),
        ("test.f32", GgufValue::F32(-1.5e-7)),
        ("test.f64", GgufValue::F64(std::f64::consts::E)),
        ("test.true", GgufValue::Bool(true)),
        ("test.false", GgufValue::Bool(false)),
        ("test.empty_string", GgufValue::String(String::new())),
        (
            "tokenizer.ggml.tokens",
            GgufValue::Array(
                ["<unk>", "<s>", "</s>", "▁hello", "wörld", "🦀", ""]
                    .iter()
                    .map(|s| GgufValue::String(s.to_string()))
                    .collect(),
            ),
        ),
        (
            "tokenizer.ggml.scores",
            GgufValue::Array(vec![GgufValue::F32(0.0), GgufValue::F32(-2.5)]),
        ),
        (
            "test.nested",
            GgufValue::Array(vec![
                GgufValue::Array(vec![GgufValue::U32(1), GgufValue::U32(2)]),
                GgufValue::Array(vec![]),
            ]),
        ),
        ("test.empty_array", GgufValue::Array(vec![])),
    ];
    entries
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

fn sample_tensors() -> Vec<GgufTensorToWrite> {
    let f32_values: Vec<f32> = (0..6).map(|i| i as f32 * 0.25 - 1.0).collect();
    let mut q8_0 = Vec::new();
    for block in 0..2 {
        q8_0.extend(half::f16::from_f32(0.5 * (block + 1) as f32).to_le_bytes());
        q8_0.extend((0..32).map(|i| (i as i8 - 16) as u8));
    }
    let tensor = |name: &str, dims: &[u64], ggml_type, data| GgufTensorToWrite {
        name: name.to_string(),
        dims: dims.to_vec(),
        ggml_type,
        data,
    };
    vec![
        tensor(
            "f32.matrix",
            &[3, 2],
            GgmlType::F32,
            f32_values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        tensor(
            "f16.vector",
            &[5],
            GgmlType::F16,
            f16_bytes(&[1.0, -2.0, 0.5, 65504.0, -0.0]),
        ),
        tensor("bf16.matrix", &[2, 2], GgmlType::BF16, pattern_bytes(8, 1)),
        tensor("q8_0.matrix", &[32, 2], GgmlType::Q8_0, q8_0),
        tensor(
            "q4_k.3d",
            &[256, 1, 2],
            GgmlType::Q4_K,
            pattern_bytes(288, 2),
        ),
        tensor("q2_k.vector", &[256], GgmlType::Q2_K, pattern_bytes(84, 3)),
        tensor("i32.vector", &[3], GgmlType::I32, pattern_bytes(12, 4)),
        tensor(
            "f32.scalar",
            &[],
            GgmlType::F32,
            7.0f32.to_le_bytes().to_vec(),
        ),
        tensor("f32.empty", &[0, 4], GgmlType::F32, Vec::new()),
    ]
}

#[test]
fn writer_output_reads_back_identically() {
    let path = scratch_path("identical");
    let metadata = sample_metadata();
    let tensors = sample_tensors();
    write_gguf(&path, &metadata, &tensors).expect("write");
    let file = GgufFile::open(&path).expect("open");

    assert_eq!(file.version, 3);
    assert_eq!(file.alignment, 32);
    assert_eq!(file.data_offset % 32, 0);
    assert_eq!(file.metadata.len(), metadata.len());
    for (key, value) in &metadata {
        assert_eq!(file.get(key).expect(key), value, "{key}");
    }

    assert_eq!(file.tensors.len(), tensors.len());
    for (info, written) in file.tensors.iter().zip(&tensors) {
        assert_eq!(info.name, written.name);
        assert_eq!(info.dims, written.dims);
        assert_eq!(info.ggml_type, written.ggml_type);
        assert_eq!(info.offset % 32, 0, "{}", info.name);
        assert_eq!(info.n_bytes(), written.data.len() as u64);
        assert_eq!(file.tensor_bytes(info), &written.data[..], "{}", info.name);
        assert_eq!(file.tensor_info(&info.name).expect("by name"), info);
    }
    assert_eq!(
        file.tensor_info("q4_k.3d").unwrap().shape_outermost_first(),
        vec![2, 1, 256]
    );
    assert_eq!(file.tensor_info("q4_k.3d").unwrap().n_elements(), 512);
    assert_eq!(file.tensor_info("f32.scalar").unwrap().n_elements(), 1);
    assert_eq!(file.tensor_info("f32.empty").unwrap().n_elements(), 0);
}

#[test]
fn dequantize_f32_returns_values_in_ggml_order() {
    let path = scratch_path("dequantize");
    let tensors = sample_tensors();
    write_gguf(&path, &sample_metadata(), &tensors).expect("write");
    let file = GgufFile::open(&path).expect("open");

    let expected: Vec<f32> = (0..6).map(|i| i as f32 * 0.25 - 1.0).collect();
    assert_eq!(file.dequantize_f32("f32.matrix").unwrap(), expected);
    assert_eq!(
        file.dequantize_f32("f16.vector").unwrap(),
        vec![1.0, -2.0, 0.5, 65504.0, -0.0]
    );
    let q8 = file.dequantize_f32("q8_0.matrix").unwrap();
    assert_eq!(q8.len(), 64);
    assert_eq!(q8[0], -8.0); // -16 * 0.5
    assert_eq!(q8[31], 7.5); // 15 * 0.5
    assert_eq!(q8[32], -16.0); // second block, d = 1.0
    assert_eq!(file.dequantize_f32("f32.scalar").unwrap(), vec![7.0]);
    assert!(file.dequantize_f32("f32.empty").unwrap().is_empty());

    // Same as the free function on the raw bytes.
    let info = file.tensor_info("q4_k.3d").unwrap();
    let mut direct = vec![0f32; 512];
    dequantize(GgmlType::Q4_K, file.tensor_bytes(info), 512, &mut direct).unwrap();
    let via_file = file.dequantize_f32("q4_k.3d").unwrap();
    assert!(direct
        .iter()
        .zip(&via_file)
        .all(|(a, b)| a.to_bits() == b.to_bits()));

    // A known type without dequantisation support is metadata-only.
    let err = file.dequantize_f32("q2_k.vector").unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("unsupported quantisation type Q2_K in tensor q2_k.vector; supported: F32, F16, BF16, Q8_0"),
        "{message}"
    );
    assert!(message.contains(&path.display().to_string()), "{message}");
    assert!(file
        .dequantize_f32("i32.vector")
        .unwrap_err()
        .to_string()
        .contains("unsupported quantisation type I32 in tensor i32.vector"));

    let err = file.dequantize_f32("no.such.tensor").unwrap_err();
    assert!(matches!(err, GgufError::MissingTensor { .. }));
    assert!(err.to_string().contains("\"no.such.tensor\""), "{err}");
}

#[test]
fn metadata_helpers_convert_and_explain_mismatches() {
    let path = scratch_path("helpers");
    write_gguf(&path, &sample_metadata(), &[]).expect("write");
    let file = GgufFile::open(&path).expect("open");

    assert_eq!(file.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(file.get_u64("test.u8").unwrap(), 255);
    assert_eq!(file.get_u64("test.u64").unwrap(), u64::MAX);
    assert_eq!(file.get_i64("test.i8").unwrap(), -128);
    assert_eq!(file.get_f64("test.f32").unwrap(), -1.5e-7f32 as f64);
    assert_eq!(file.get_f64("test.u32").unwrap(), 4e9);
    assert!(file.get_bool("test.true").unwrap());
    assert_eq!(file.get_array("tokenizer.ggml.scores").unwrap().len(), 2);
    assert_eq!(
        file.get_str_array("tokenizer.ggml.tokens").unwrap()[3],
        "▁hello"
    );

    let message = file.get_u64("missing.key").unwrap_err().to_string();
    assert!(
        message.contains("metadata key \"missing.key\" is missing")
            && message.contains(&path.display().to_string()),
        "{message}"
    );
    let message = file.get_u64("test.i8").unwrap_err().to_string();
    assert!(
        message.contains("\"test.i8\" has type i8 (value -128), expected non-negative integer"),
        "{message}"
    );
    let message = file.get_str("test.u32").unwrap_err().to_string();
    assert!(message.contains("has type u32"), "{message}");
    assert!(message.contains("expected string"), "{message}");
    let message = file.get_f64("general.name").unwrap_err().to_string();
    assert!(
        message.contains("has type string (value \"tiny ✓ test\"), expected number"),
        "{message}"
    );
    let message = file.get_u64("test.true").unwrap_err().to_string();
    assert!(message.contains("has type bool"), "{message}");
    let message = file
        .get_str_array("tokenizer.ggml.scores")
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("has type array of 2 f32, expected array of string"),
        "{message}"
    );
}

#[test]
fn version_2_files_are_read_and_version_1_is_refused_clearly() {
    let path = scratch_path("versions");
    write_gguf(&path, &sample_metadata(), &sample_tensors()).expect("write");
    let mut bytes = std::fs::read(&path).unwrap();

    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let file = GgufFile::open(&path).expect("v2 opens");
    assert_eq!(file.version, 2);
    assert_eq!(file.dequantize_f32("f16.vector").unwrap()[1], -2.0);

    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let message = GgufFile::open(&path).unwrap_err().to_string();
    assert!(message.contains("unsupported GGUF version 1"), "{message}");
    assert!(message.contains(&path.display().to_string()), "{message}");
}

#[test]
fn writer_rejects_inconsistent_input() {
    let path = scratch_path("rejects");
    let tensor = |dims: Vec<u64>, ggml_type, len| GgufTensorToWrite {
        name: "t".into(),
        dims,
        ggml_type,
        data: vec![0; len],
    };
    type Metadata = Vec<(String, GgufValue)>;
    let cases: Vec<(Metadata, Vec<GgufTensorToWrite>, &str)> = vec![
        (
            vec![],
            vec![tensor(vec![4], GgmlType::F32, 15)],
            "need 16 bytes",
        ),
        (
            vec![],
            vec![tensor(vec![33], GgmlType::Q8_0, 34)],
            "not a multiple",
        ),
        (
            vec![],
            vec![tensor(vec![1; 5], GgmlType::F32, 4)],
            "at most 4",
        ),
        (
            vec![],
            vec![
                tensor(vec![4], GgmlType::F32, 16),
                tensor(vec![4], GgmlType::F32, 16),
            ],
            "duplicate tensor name",
        ),
        (
            vec![
                ("a".into(), GgufValue::U8(1)),
                ("a".into(), GgufValue::U8(2)),
            ],
            vec![],
            "duplicate metadata key",
        ),
        (
            vec![(
                "mixed".into(),
                GgufValue::Array(vec![GgufValue::U8(1), GgufValue::I8(1)]),
            )],
            vec![],
            "one type",
        ),
        (
            vec![("general.alignment".into(), GgufValue::U32(64))],
            vec![],
            "aligns to 32",
        ),
    ];
    for (metadata, tensors, expected) in cases {
        let message = write_gguf(&path, &metadata, &tensors)
            .unwrap_err()
            .to_string();
        assert!(
            message.contains(expected),
            "{message} (expected {expected:?})"
        );
    }
}

const PYTHON_GGUF: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/gguf/python_writer.gguf"
);
const PYTHON_JSON: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/gguf/python_writer.json"
);

/// The JSON sidecar's description of one metadata value, as a GgufValue.
fn json_to_value(ty: &str, value: &Json) -> GgufValue {
    let int = || value.as_i64().unwrap_or_else(|| panic!("{ty}: {value}"));
    let uint = || value.as_u64().unwrap_or_else(|| panic!("{ty}: {value}"));
    match ty {
        "string" => GgufValue::String(value.as_str().unwrap().to_string()),
        "u8" => GgufValue::U8(uint() as u8),
        "i8" => GgufValue::I8(int() as i8),
        "u16" => GgufValue::U16(uint() as u16),
        "i16" => GgufValue::I16(int() as i16),
        "u32" => GgufValue::U32(uint() as u32),
        "i32" => GgufValue::I32(int() as i32),
        "u64" => GgufValue::U64(uint()),
        "i64" => GgufValue::I64(int()),
        "f32" => GgufValue::F32(f32::from_bits(uint() as u32)), // stored as IEEE bits
        "f64" => GgufValue::F64(f64::from_bits(uint())),
        "bool" => GgufValue::Bool(value.as_bool().unwrap()),
        array if array.starts_with("array<") => {
            let element = &array["array<".len()..array.len() - 1];
            GgufValue::Array(
                value
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| json_to_value(element, v))
                    .collect(),
            )
        }
        other => panic!("unknown sidecar type {other}"),
    }
}

#[test]
fn reads_the_file_written_by_the_reference_python_gguf_writer() {
    let file = GgufFile::open(PYTHON_GGUF.as_ref()).expect("open the gguf-py file");
    let sidecar: Json =
        serde_json::from_str(&std::fs::read_to_string(PYTHON_JSON).unwrap()).unwrap();

    assert_eq!(
        file.version as u64,
        sidecar["gguf_version"].as_u64().unwrap()
    );
    assert_eq!(file.alignment, sidecar["alignment"].as_u64().unwrap());
    let metadata = sidecar["metadata"].as_object().unwrap();
    assert_eq!(file.metadata.len(), metadata.len());
    for (key, described) in metadata {
        let expected = json_to_value(described["type"].as_str().unwrap(), &described["value"]);
        assert_eq!(file.get(key).expect(key), &expected, "{key}");
    }
    assert_eq!(file.get_u64("llama.context_length").unwrap(), 4096);
    assert_eq!(file.get_f64("llama.rope.freq_base").unwrap(), 10000.0);

    let tensors = sidecar["tensors"].as_array().unwrap();
    assert_eq!(file.tensors.len(), tensors.len());
    for (info, described) in file.tensors.iter().zip(tensors) {
        let name = described["name"].as_str().unwrap();
        assert_eq!(info.name, name);
        let dims: Vec<u64> = described["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(info.dims, dims, "{name}");
        assert_eq!(info.ggml_type.name(), described["type"].as_str().unwrap());
        assert_eq!(info.n_elements(), described["n_elements"].as_u64().unwrap());
        assert_eq!(info.n_bytes(), described["n_bytes"].as_u64().unwrap());
        assert_eq!(
            file.data_offset + info.offset,
            described["file_offset"].as_u64().unwrap(),
            "{name}"
        );
        let values = file.dequantize_f32(name).unwrap();
        let expected_bits: Vec<u32> = described["f32_bits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u32)
            .collect();
        let actual_bits: Vec<u32> = values.iter().map(|v| v.to_bits()).collect();
        assert_eq!(actual_bits, expected_bits, "{name}");
    }
    let types: Vec<GgmlType> = file.tensors.iter().map(|t| t.ggml_type).collect();
    assert_eq!(types, [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0]);
}

/// Any metadata value tree the writer accepts, floats without NaN (NaN != NaN).
fn arbitrary_value() -> impl Strategy<Value = GgufValue> {
    let leaf = prop_oneof![
        any::<u8>().prop_map(GgufValue::U8),
        any::<i8>().prop_map(GgufValue::I8),
        any::<u16>().prop_map(GgufValue::U16),
        any::<i16>().prop_map(GgufValue::I16),
        any::<u32>().prop_map(GgufValue::U32),
        any::<i32>().prop_map(GgufValue::I32),
        any::<u64>().prop_map(GgufValue::U64),
        any::<i64>().prop_map(GgufValue::I64),
        proptest::num::f32::ANY
            .prop_filter("not NaN", |v| !v.is_nan())
            .prop_map(GgufValue::F32),
        proptest::num::f64::ANY
            .prop_filter("not NaN", |v| !v.is_nan())
            .prop_map(GgufValue::F64),
        any::<bool>().prop_map(GgufValue::Bool),
        ".{0,12}".prop_map(GgufValue::String),
    ];
    leaf.prop_recursive(2, 24, 6, |inner| {
        // Arrays are homogeneous: repeat one generated element's variant.
        (inner, 0usize..6).prop_map(|(element, len)| GgufValue::Array(vec![element; len]))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_metadata_round_trips(values in proptest::collection::vec(arbitrary_value(), 0..8)) {
        let metadata: Vec<(String, GgufValue)> = values
            .into_iter()
            .enumerate()
            .map(|(i, v)| (format!("key.{i}"), v))
            .collect();
        let path = scratch_path("proptest");
        write_gguf(&path, &metadata, &[]).expect("write");
        let file = GgufFile::open(&path).expect("open");
        prop_assert_eq!(file.metadata.len(), metadata.len());
        for (key, value) in &metadata {
            prop_assert_eq!(file.get(key).unwrap(), value);
        }
    }
}
