//! Corrupt, truncated and hostile GGUF files give clear errors naming the file, never panics or
//! allocations sized by unchecked counts.

use std::path::PathBuf;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specula_model::gguf::{
    encode_gguf, GgmlType, GgufError, GgufFile, GgufTensorToWrite, GgufValue,
};

fn scratch_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("gguf_robustness_{name}.gguf"))
}

/// Builds GGUF bytes field by field, so tests can write anything, including nonsense.
#[derive(Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, tensor_count: u64, kv_count: u64) -> Raw {
        let mut raw = Raw(b"GGUF".to_vec());
        raw.u32(version).u64(tensor_count).u64(kv_count);
        raw
    }
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend(b);
        self
    }
    fn string(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.string(key).u32(4).u32(v)
    }
    fn kv_string(&mut self, key: &str, v: &str) -> &mut Self {
        self.string(key).u32(8).string(v)
    }
    fn tensor_info(&mut self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> &mut Self {
        self.string(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(type_id).u64(offset)
    }
    fn pad_to(&mut self, alignment: usize) -> &mut Self {
        while !self.0.len().is_multiple_of(alignment) {
            self.0.push(0);
        }
        self
    }
    fn zeros(&mut self, n: usize) -> &mut Self {
        self.0.resize(self.0.len() + n, 0);
        self
    }
}

/// Writes `bytes` to a scratch file named after the case and opens it.
fn open_bytes(case: &str, bytes: &[u8]) -> (PathBuf, Result<GgufFile, GgufError>) {
    let path = scratch_path(case);
    std::fs::write(&path, bytes).expect("write scratch file");
    let result = GgufFile::open(&path);
    (path, result)
}

/// Asserts that opening fails with a message naming the file and containing every fragment.
fn assert_open_fails(case: &str, bytes: &[u8], fragments: &[&str]) -> GgufError {
    let (path, result) = open_bytes(case, bytes);
    let err = match result {
        Ok(_) => panic!("{case}: opened successfully, expected an error"),
        Err(err) => err,
    };
    let message = err.to_string();
    assert!(
        message.contains(&path.display().to_string()),
        "{case}: message does not name the file: {message}"
    );
    for fragment in fragments {
        assert!(
            message.contains(fragment),
            "{case}: message lacks {fragment:?}: {message}"
        );
    }
    err
}

/// One F32 tensor of 4 elements at offset 0, with the data that goes with it.
fn one_tensor_file(dims: &[u64], type_id: u32, offset: u64, data_len: usize) -> Vec<u8> {
    let mut raw = Raw::header(3, 1, 0);
    raw.tensor_info("blk.0.attn_q.weight", dims, type_id, offset)
        .pad_to(32)
        .zeros(data_len);
    raw.0
}

#[test]
fn short_files_and_bad_magic() {
    assert_open_fails("empty", b"", &["0 bytes long, too short"]);
    assert_open_fails("three_bytes", b"GGU", &["3 bytes long"]);
    let err = assert_open_fails(
        "bad_magic",
        b"GGML\x03\x00\x00\x00",
        &[
            "not a GGUF file: it starts with 47 47 4d 4c (\"GGML\")",
            "47 47 55 46",
        ],
    );
    assert!(matches!(err, GgufError::BadMagic { .. }));
    assert_open_fails(
        "header_truncated",
        b"GGUF\x03\x00\x00\x00\x01\x00",
        &["header", "unexpected end of file"],
    );
}

#[test]
fn missing_file_is_an_io_error_naming_the_path() {
    let path = scratch_path("does_not_exist");
    let _ = std::fs::remove_file(&path);
    let err = GgufFile::open(&path).unwrap_err();
    assert!(matches!(err, GgufError::Io { .. }));
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "{err}"
    );
}

#[test]
fn unsupported_versions() {
    let err = assert_open_fails(
        "v1",
        &Raw::header(1, 0, 0).0,
        &["unsupported GGUF version 1"],
    );
    assert!(matches!(
        err,
        GgufError::UnsupportedVersion { version: 1, .. }
    ));
    assert_open_fails(
        "v4",
        &Raw::header(4, 0, 0).0,
        &["unsupported GGUF version 4", "supports versions 2 and 3"],
    );
    assert_open_fails(
        "big_endian",
        &Raw::header(3u32.swap_bytes(), 0, 0).0,
        &["big-endian"],
    );
}

#[test]
fn absurd_counts_are_rejected_before_allocating() {
    assert_open_fails(
        "kv_count",
        &Raw::header(3, 0, 1 << 60).0,
        &["metadata key/value count 1152921504606846976 cannot fit"],
    );
    assert_open_fails(
        "tensor_count",
        &Raw::header(3, u64::MAX, 0).0,
        &["tensor count 18446744073709551615 cannot fit"],
    );
    let mut raw = Raw::header(3, 0, 1);
    raw.u64(1 << 60).bytes(b"key").zeros(32);
    assert_open_fails(
        "key_length",
        &raw.0,
        &[
            "string length 1152921504606846976 exceeds the 35 bytes left",
            "metadata entry 0",
        ],
    );
    let mut raw = Raw::header(3, 0, 1);
    raw.string("general.name").u32(8).u64(u64::MAX);
    assert_open_fails(
        "value_length",
        &raw.0,
        &[
            "metadata key \"general.name\"",
            "string length 18446744073709551615",
        ],
    );
    let mut raw = Raw::header(3, 0, 1);
    raw.string("tokenizer.ggml.tokens")
        .u32(9)
        .u32(8)
        .u64(1 << 40)
        .zeros(64);
    assert_open_fails(
        "array_count",
        &raw.0,
        &[
            "\"tokenizer.ggml.tokens\"",
            "array element count 1099511627776 cannot fit",
        ],
    );
    // Many tensors claimed, only room for one info.
    let mut raw = Raw::header(3, 1000, 0);
    raw.tensor_info("t", &[4], 0, 0);
    assert_open_fails("tensor_count_vs_size", &raw.0, &["tensor count 1000"]);
}

#[test]
fn malformed_metadata_values() {
    let mut raw = Raw::header(3, 0, 1);
    raw.string("k").u32(13).u32(0);
    assert_open_fails(
        "value_type",
        &raw.0,
        &["\"k\"", "unknown metadata value type id 13"],
    );

    let mut raw = Raw::header(3, 0, 1);
    raw.string("k").u32(9).u32(99).u64(1).u32(0);
    assert_open_fails("array_type", &raw.0, &["unknown array element type id 99"]);

    let mut raw = Raw::header(3, 0, 1);
    raw.string("k").u32(7).u8(2);
    assert_open_fails("bool", &raw.0, &["bool value 2 is neither 0 nor 1"]);

    let mut raw = Raw::header(3, 0, 1);
    raw.u64(2).bytes(&[0xC3, 0x28]).u32(4).u32(0);
    assert_open_fails("utf8", &raw.0, &["not valid UTF-8"]);

    let mut raw = Raw::header(3, 0, 2);
    raw.kv_u32("dup", 1).kv_u32("dup", 2);
    assert_open_fails("duplicate_key", &raw.0, &["duplicate metadata key \"dup\""]);

    // Arrays of arrays nested 20 deep: refused instead of recursing without bound.
    let mut raw = Raw::header(3, 0, 1);
    raw.string("deep").u32(9);
    for _ in 0..20 {
        raw.u32(9).u64(1);
    }
    raw.u32(0).u64(0);
    assert_open_fails(
        "nesting",
        &raw.0,
        &["metadata key \"deep\": array element 0: metadata arrays nested more than 16 deep"],
    );

    // A value cut off mid-way.
    let mut raw = Raw::header(3, 0, 1);
    raw.string("k").u32(10).bytes(&[1, 2, 3]);
    assert_open_fails(
        "cut_value",
        &raw.0,
        &["\"k\"", "needed 8 bytes, only 3 left"],
    );
}

#[test]
fn alignment_key_is_validated_and_honoured() {
    for (case, value) in [("align_zero", 0u32), ("align_three", 3)] {
        let mut raw = Raw::header(3, 0, 1);
        raw.kv_u32("general.alignment", value);
        assert_open_fails(case, &raw.0, &["general.alignment", "power-of-two"]);
    }
    let mut raw = Raw::header(3, 0, 1);
    raw.kv_string("general.alignment", "32");
    assert_open_fails(
        "align_string",
        &raw.0,
        &["general.alignment", "power-of-two"],
    );

    // Alignment 64: data section and offsets on 64-byte boundaries.
    let mut raw = Raw::header(3, 2, 1);
    raw.kv_u32("general.alignment", 64)
        .tensor_info("a", &[4], 0, 0)
        .tensor_info("b", &[4], 0, 64)
        .pad_to(64);
    let data_start = raw.0.len();
    raw.bytes(&[0, 0, 128, 63].repeat(4)) // 1.0f32 x 4
        .zeros(48)
        .bytes(&[0, 0, 0, 64].repeat(4)); // 2.0f32 x 4
    let (_, result) = open_bytes("align_64", &raw.0);
    let file = result.expect("alignment 64 file opens");
    assert_eq!(file.alignment, 64);
    assert_eq!(file.data_offset as usize, data_start);
    assert_eq!(file.dequantize_f32("b").unwrap(), vec![2.0; 4]);

    let mut raw = Raw::header(3, 1, 1);
    raw.kv_u32("general.alignment", 64)
        .tensor_info("a", &[4], 0, 32)
        .pad_to(64)
        .zeros(64);
    assert_open_fails(
        "align_64_misaligned",
        &raw.0,
        &["offset 32 is not a multiple of the alignment 64"],
    );
}

#[test]
fn malformed_tensor_infos() {
    assert_open_fails(
        "n_dims",
        &one_tensor_file(&[1, 1, 1, 1, 4], 0, 0, 16),
        &[
            "\"blk.0.attn_q.weight\"",
            "5 dimensions, ggml supports at most 4",
        ],
    );
    assert_open_fails(
        "huge_dim",
        &one_tensor_file(&[1 << 63], 0, 0, 0),
        &["dimension 9223372036854775808 is larger than 2^63 - 1"],
    );
    assert_open_fails(
        "dims_overflow",
        &one_tensor_file(&[1 << 32, 1 << 32, 1 << 32], 0, 0, 0),
        &["element count that overflows"],
    );
    assert_open_fails(
        "bytes_overflow",
        &one_tensor_file(&[1 << 62, 2], 0, 0, 0),
        &["byte size that overflows"],
    );
    let err = assert_open_fails(
        "unknown_type",
        &one_tensor_file(&[4], 99, 0, 16),
        &["tensor \"blk.0.attn_q.weight\"", "unknown ggml type id 99"],
    );
    assert!(matches!(err, GgufError::Malformed { .. }));
    assert_open_fails(
        "removed_type",
        &one_tensor_file(&[32], 31, 0, 18),
        &["unknown ggml type id 31 (Q4_0_4_4, which ggml has removed"],
    );
    assert_open_fails(
        "partial_block",
        &one_tensor_file(&[33], GgmlType::Q4_0.id(), 0, 36),
        &["type Q4_0 stores blocks of 32 elements", "ne0 = 33"],
    );
    assert_open_fails(
        "misaligned",
        &one_tensor_file(&[4], 0, 16, 32),
        &["data offset 16 is not a multiple of the alignment 32"],
    );
    assert_open_fails(
        "past_eof",
        &one_tensor_file(&[4, 4], 0, 0, 60),
        &[
            "data of tensor \"blk.0.attn_q.weight\" (64 bytes",
            "extends past the end of the file",
        ],
    );
    assert_open_fails(
        "offset_overflow",
        &one_tensor_file(&[4], 0, u64::MAX - 31, 16),
        &["extends past the end of the file"],
    );
    let mut raw = Raw::header(3, 2, 0);
    raw.tensor_info("t", &[4], 0, 0)
        .tensor_info("t", &[4], 0, 32)
        .pad_to(32)
        .zeros(64);
    assert_open_fails("duplicate_tensor", &raw.0, &["duplicate tensor name \"t\""]);

    // Every known-but-unsupported type loads as metadata and names itself when dequantised.
    let (path, result) = open_bytes("q2_k", &one_tensor_file(&[256], GgmlType::Q2_K.id(), 0, 84));
    let file = result.expect("Q2_K tensor opens");
    let message = file
        .dequantize_f32("blk.0.attn_q.weight")
        .unwrap_err()
        .to_string();
    assert_eq!(
        message,
        format!(
            "{}: unsupported quantisation type Q2_K in tensor blk.0.attn_q.weight; supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K",
            path.display()
        )
    );
}

/// A valid file with several metadata kinds and tensor types, for the fuzz-style tests.
fn valid_file_bytes() -> Vec<u8> {
    let metadata = vec![
        (
            "general.architecture".to_string(),
            GgufValue::String("llama".into()),
        ),
        ("llama.block_count".to_string(), GgufValue::U32(2)),
        ("llama.rope.freq_base".to_string(), GgufValue::F32(10000.0)),
        (
            "tokenizer.ggml.tokens".to_string(),
            GgufValue::Array(
                ["a", "bc", "def"]
                    .map(|s| GgufValue::String(s.into()))
                    .to_vec(),
            ),
        ),
        (
            "test.nested".to_string(),
            GgufValue::Array(vec![GgufValue::Array(vec![GgufValue::I16(-3)])]),
        ),
    ];
    let tensor = |name: &str, dims: &[u64], ggml_type: GgmlType| {
        let n_bytes = dims.iter().product::<u64>() / ggml_type.block_size() * ggml_type.type_size();
        GgufTensorToWrite {
            name: name.into(),
            dims: dims.to_vec(),
            ggml_type,
            data: (0..n_bytes).map(|i| (i * 7 % 251) as u8).collect(),
        }
    };
    let tensors = vec![
        tensor("f32", &[4, 2], GgmlType::F32),
        tensor("f16", &[8], GgmlType::F16),
        tensor("q8_0", &[32, 2], GgmlType::Q8_0),
        tensor("q4_k", &[256], GgmlType::Q4_K),
        tensor("q6_k", &[256], GgmlType::Q6_K),
        tensor("q3_k", &[256], GgmlType::Q3_K),
    ];
    encode_gguf(&metadata, &tensors).expect("encode")
}

/// Uses everything an opened file offers; nothing here may panic, whatever the file held.
fn exercise(file: &GgufFile) {
    for info in &file.tensors {
        let _ = file.tensor_bytes(info);
        let _ = info.n_elements();
        let _ = info.n_bytes();
        let _ = file.dequantize_f32(&info.name);
    }
    for key in file.metadata.keys() {
        let _ = file.get_str(key);
        let _ = file.get_u64(key);
        let _ = file.get_f64(key);
        let _ = file.get_str_array(key);
        let _ = file.get(key).map(|v| v.to_string());
    }
}

#[test]
fn truncation_at_every_byte_is_an_error_until_the_data_is_complete() {
    let bytes = valid_file_bytes();
    let path = scratch_path("truncated");
    let (_, full) = open_bytes("truncated_full", &bytes);
    let full = full.expect("the untruncated file opens");
    let data_end = full
        .tensors
        .iter()
        .map(|t| full.data_offset + t.offset + t.n_bytes())
        .max()
        .unwrap() as usize;
    exercise(&full);

    for len in 0..bytes.len() {
        std::fs::write(&path, &bytes[..len]).unwrap();
        match GgufFile::open(&path) {
            Ok(file) => {
                assert!(len >= data_end, "truncated to {len} bytes but opened");
                exercise(&file);
            }
            Err(err) => {
                assert!(
                    len < data_end,
                    "truncated to {len} (data ends at {data_end}): {err}"
                );
                assert!(err.to_string().contains(&path.display().to_string()));
            }
        }
    }
}

#[test]
fn random_byte_corruption_never_panics() {
    let bytes = valid_file_bytes();
    let path = scratch_path("corrupted");
    let mut rng = ChaCha8Rng::seed_from_u64(0x6775_6766);
    let header_and_infos = {
        std::fs::write(&path, &bytes).unwrap();
        GgufFile::open(&path).unwrap().data_offset as usize
    };
    let (mut opened, mut failed) = (0, 0);
    for _ in 0..1500 {
        let mut corrupted = bytes.clone();
        for _ in 0..rng.random_range(1..=4) {
            // Mostly hit the parsed region; sometimes the data.
            let end = if rng.random_bool(0.9) {
                header_and_infos
            } else {
                corrupted.len()
            };
            let at = rng.random_range(0..end);
            corrupted[at] = match rng.random_range(0..4) {
                0 => 0,
                1 => 0xFF,
                2 => corrupted[at] ^ (1 << rng.random_range(0..8)),
                _ => rng.random(),
            };
        }
        std::fs::write(&path, &corrupted).unwrap();
        match GgufFile::open(&path) {
            Ok(file) => {
                exercise(&file);
                opened += 1;
            }
            Err(err) => {
                assert!(
                    err.to_string().contains(&path.display().to_string()),
                    "{err}"
                );
                failed += 1;
            }
        }
    }
    // Both outcomes occur, so the corruption is neither always fatal nor always harmless.
    assert!(opened > 0 && failed > 0, "opened {opened}, failed {failed}");
}
