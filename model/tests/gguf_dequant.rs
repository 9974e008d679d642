//! Dequantisation checked bit-for-bit against the reference `gguf` Python package.
//!
//! The fixture `fixtures/gguf/dequant_reference.safetensors` is made by
//! `fixtures/gguf/make_dequant_fixtures.py`: raw ggml blocks and `gguf.quants.dequantize`'s f32
//! output for them, for every type the Rust dequantiser supports.

use std::collections::HashMap;

use safetensors::SafeTensors;
use specula_model::gguf::dequant::f16_bits_to_f32;
use specula_model::gguf::{dequantize, GgmlType, GgufError};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/gguf/dequant_reference.safetensors"
);

/// The fixture's cases: (type, source) -> (raw bytes, expected f32 values); plus its metadata.
struct Reference {
    cases: HashMap<(String, String), (Vec<u8>, Vec<f32>)>,
    metadata: HashMap<String, String>,
}

fn load_reference() -> Reference {
    let file = std::fs::read(FIXTURE).expect("read the dequantisation fixture");
    let (_, header) = SafeTensors::read_metadata(&file).expect("parse the fixture header");
    let metadata = header.metadata().clone().unwrap_or_default();
    let tensors = SafeTensors::deserialize(&file).expect("parse the fixture");
    let mut cases = HashMap::new();
    for (name, view) in tensors.tensors() {
        let Some(prefix) = name.strip_suffix(".bytes") else {
            continue;
        };
        let (ty, source) = prefix.split_once('.').expect("name is TYPE.source.bytes");
        let expected_view = tensors
            .tensor(&format!("{prefix}.expected"))
            .expect("every .bytes has an .expected");
        let expected = expected_view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        cases.insert(
            (ty.to_string(), source.to_string()),
            (view.data().to_vec(), expected),
        );
    }
    Reference { cases, metadata }
}

/// Panics naming the type, the case and the first differing index unless the bits are equal.
fn assert_bit_exact(label: &str, actual: &[f32], expected: &[f32]) {
    assert_eq!(actual.len(), expected.len(), "{label}: length");
    if let Some(index) = (0..actual.len()).find(|&i| actual[i].to_bits() != expected[i].to_bits()) {
        panic!(
            "{label}: first difference at element {index}: got {} ({:#010x}), reference {} ({:#010x})",
            actual[index],
            actual[index].to_bits(),
            expected[index],
            expected[index].to_bits()
        );
    }
}

fn dequantize_vec(ty: GgmlType, bytes: &[u8], n_elements: usize) -> Vec<f32> {
    let mut out = vec![0f32; n_elements];
    dequantize(ty, bytes, n_elements, &mut out)
        .unwrap_or_else(|e| panic!("{ty}: dequantize failed: {e}"));
    out
}

#[test]
fn dequantisation_matches_the_reference_gguf_python_package_bit_for_bit_on_every_supported_type() {
    let reference = load_reference();
    let package_version = reference
        .metadata
        .get("gguf_package_version")
        .expect("fixture records the gguf package version");
    let quantize_supported: Vec<&str> = reference
        .metadata
        .get("quantize_supported")
        .map(|s| s.split(',').collect())
        .unwrap_or_default();

    let mut checked_elements = 0usize;
    for &ty in GgmlType::DEQUANTIZE_SUPPORTED {
        let mut sources = vec!["random"];
        if quantize_supported.contains(&ty.name()) {
            sources.push("quantized");
        }
        if ty.block_size() == 1 {
            sources.push("special");
        }
        for source in sources {
            let (bytes, expected) = reference
                .cases
                .get(&(ty.name().to_string(), source.to_string()))
                .unwrap_or_else(|| panic!("fixture lacks the {ty} {source} case"));
            assert!(!expected.is_empty());
            let actual = dequantize_vec(ty, bytes, expected.len());
            let label = format!("{ty} ({source} blocks, reference gguf {package_version})");
            assert_bit_exact(&label, &actual, expected);
            checked_elements += expected.len();
        }
    }
    // Every case in the fixture belongs to a supported type (nothing silently skipped).
    for (ty, _) in reference.cases.keys() {
        assert!(
            GgmlType::DEQUANTIZE_SUPPORTED
                .iter()
                .any(|t| t.name() == ty.as_str()),
            "fixture has a case for {ty}, which the Rust side does not support"
        );
    }
    println!(
        "{} types, {checked_elements} elements bit-exact against gguf {package_version}",
        GgmlType::DEQUANTIZE_SUPPORTED.len()
    );
}

/// Repeats each type's random blocks until the tensor spans many rayon tasks, so block pairing
/// across task boundaries is checked too.
#[test]
fn large_tensors_dequantise_bit_exact_across_parallel_chunks() {
    let reference = load_reference();
    for &ty in GgmlType::DEQUANTIZE_SUPPORTED {
        let (bytes, expected) = &reference.cases[&(ty.name().to_string(), "random".to_string())];
        let repeats = (300_000 / expected.len()).max(2);
        let big_bytes = bytes.repeat(repeats);
        let big_expected = expected.repeat(repeats);
        let actual = dequantize_vec(ty, &big_bytes, big_expected.len());
        assert_bit_exact(&format!("{ty} x{repeats}"), &actual, &big_expected);
    }
}

#[test]
fn f16_dequantisation_is_exact_for_every_bit_pattern() {
    let bytes: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
    let out = dequantize_vec(GgmlType::F16, &bytes, 1 << 16);
    for (bits, value) in (0..=u16::MAX).zip(&out) {
        let reference = half::f16::from_bits(bits);
        if reference.is_nan() {
            // NaN payload kept, quiet bit untouched (numpy's conversion; `half` would quiet it).
            let expected =
                ((bits as u32 & 0x8000) << 16) | 0x7F80_0000 | ((bits as u32 & 0x3FF) << 13);
            assert_eq!(value.to_bits(), expected, "f16 NaN {bits:#06x}");
        } else {
            assert_eq!(
                value.to_bits(),
                reference.to_f32().to_bits(),
                "f16 {bits:#06x}"
            );
        }
        assert_eq!(value.to_bits(), f16_bits_to_f32(bits).to_bits());
    }
    assert_eq!(out[0x3C00], 1.0);
    assert_eq!(out[0x7C00], f32::INFINITY);
    assert_eq!(out[0xFC00], f32::NEG_INFINITY);
    assert_eq!(out[0x0001], 2f32.powi(-24)); // smallest subnormal
    assert_eq!(out[0x8000].to_bits(), (-0.0f32).to_bits());
}

#[test]
fn bf16_dequantisation_is_the_top_half_of_f32_for_every_bit_pattern() {
    let bytes: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
    let out = dequantize_vec(GgmlType::BF16, &bytes, 1 << 16);
    for (bits, value) in (0..=u16::MAX).zip(&out) {
        assert_eq!(value.to_bits(), (bits as u32) << 16, "bf16 {bits:#06x}");
    }
    assert_eq!(out[0x3F80], 1.0);
    assert_eq!(out[0xFF80], f32::NEG_INFINITY);
}

#[test]
fn f32_dequantisation_preserves_every_special_bit_pattern() {
    let patterns: [u32; 10] = [
        0,
        0x8000_0000,
        1,
        0x007F_FFFF,
        0x7F80_0000,
        0xFF80_0000,
        0x7FC0_0000,
        0x7F80_0001, // signalling NaN
        0xFFFF_FFFF,
        0x3F80_0000,
    ];
    let bytes: Vec<u8> = patterns.iter().flat_map(|p| p.to_le_bytes()).collect();
    let out = dequantize_vec(GgmlType::F32, &bytes, patterns.len());
    for (p, v) in patterns.iter().zip(&out) {
        assert_eq!(v.to_bits(), *p);
    }
}

#[test]
fn hand_computed_blocks_dequantise_as_documented() {
    // Q8_0: d = 0.5 (f16 0x3800), qs = -128..=-97.
    let mut q8 = vec![0x00, 0x38];
    q8.extend((0..32i32).map(|i| (i - 128) as i8 as u8));
    let out = dequantize_vec(GgmlType::Q8_0, &q8, 32);
    assert_eq!(out[0], -64.0);
    assert_eq!(out[31], -48.5);

    // Q4_0: d = 2.0 (0x4000); byte j = low nibble j % 16, high nibble 15 - j % 16.
    let mut q4 = vec![0x00, 0x40];
    q4.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let out = dequantize_vec(GgmlType::Q4_0, &q4, 32);
    assert_eq!(out[0], -16.0); // (0 - 8) * 2
    assert_eq!(out[15], 14.0); // (15 - 8) * 2
    assert_eq!(out[16], 14.0); // high nibble of byte 0 = 15
    assert_eq!(out[31], -16.0);

    // Q4_1: d = 1.0 (0x3C00), m = -1.0 (0xBC00), all nibbles 3 -> 2.0.
    let mut q41 = vec![0x00, 0x3C, 0x00, 0xBC];
    q41.extend([0x33u8; 16]);
    assert!(dequantize_vec(GgmlType::Q4_1, &q41, 32)
        .iter()
        .all(|&v| v == 2.0));

    // Q5_0: d = 1.0, fifth bit set only for element 17, nibbles all 0 -> -16 except 17 -> 0.
    let mut q5 = vec![0x00, 0x3C];
    q5.extend((1u32 << 17).to_le_bytes());
    q5.extend([0u8; 16]);
    let out = dequantize_vec(GgmlType::Q5_0, &q5, 32);
    assert_eq!(out[17], 0.0);
    assert_eq!(out[16], -16.0);
    assert_eq!(out[0], -16.0);
}

#[test]
fn unsupported_types_and_bad_lengths_are_errors() {
    let mut out = vec![0f32; 256];
    let err = dequantize(GgmlType::Q2_K, &[0u8; 84], 256, &mut out).unwrap_err();
    assert!(matches!(
        err,
        GgufError::UnsupportedType {
            ggml_type: GgmlType::Q2_K
        }
    ));
    let message = err.to_string();
    assert!(
        message.contains("unsupported quantisation type Q2_K") && message.contains("Q6_K"),
        "{message}"
    );

    // 33 elements of Q8_0: not whole blocks.
    let err = dequantize(GgmlType::Q8_0, &[0u8; 34], 33, &mut out[..33]).unwrap_err();
    assert!(err.to_string().contains("not a whole number"), "{err}");
    // Too few bytes.
    let err = dequantize(GgmlType::Q8_0, &[0u8; 33], 32, &mut out[..32]).unwrap_err();
    assert!(err.to_string().contains("need 34 bytes"), "{err}");
    // Output of the wrong size.
    let err = dequantize(GgmlType::Q8_0, &[0u8; 34], 32, &mut out[..31]).unwrap_err();
    assert!(err.to_string().contains("output buffer"), "{err}");
    // Zero elements are fine.
    dequantize(GgmlType::Q4_K, &[], 0, &mut []).expect("empty tensor");
}

#[test]
fn type_table_matches_ggml() {
    let expected: [(u32, &str, u64, u64); 12] = [
        (0, "F32", 1, 4),
        (1, "F16", 1, 2),
        (2, "Q4_0", 32, 18),
        (3, "Q4_1", 32, 20),
        (6, "Q5_0", 32, 22),
        (7, "Q5_1", 32, 24),
        (8, "Q8_0", 32, 34),
        (12, "Q4_K", 256, 144),
        (13, "Q5_K", 256, 176),
        (14, "Q6_K", 256, 210),
        (30, "BF16", 1, 2),
        (39, "MXFP4", 32, 17),
    ];
    for (id, name, block, size) in expected {
        let ty = GgmlType::from_id(id).unwrap_or_else(|| panic!("id {id}"));
        assert_eq!(
            (ty.id(), ty.name(), ty.block_size(), ty.type_size()),
            (id, name, block, size)
        );
    }
    for &ty in GgmlType::ALL {
        assert_eq!(GgmlType::from_id(ty.id()), Some(ty));
    }
    // Ids ggml removed (Q4_2, Q4_0_4_4, ...) and ids past the end are unknown.
    for id in [4, 5, 31, 32, 33, 36, 37, 38, 42, 1000] {
        assert_eq!(GgmlType::from_id(id), None, "id {id}");
    }
}
