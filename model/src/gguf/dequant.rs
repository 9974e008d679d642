//! Dequantisation of ggml tensor data to f32, bit-for-bit equal to the reference numpy
//! implementation in the `gguf` Python package (`gguf.quants.dequantize`).
//!
//! Bit-exactness comes from doing the same f32 operations in the same order as the numpy code:
//! scales are converted f16 -> f32 exactly (NaN payloads kept, as numpy does), quant values are
//! small integers converted exactly, and products/sums are evaluated in f32 in numpy's order
//! (e.g. for Q4_K `(d * sc) * q - (dmin * m)`). For the supported formats every intermediate
//! product fits in f32's 24-bit significand (an 11-bit f16 significand times at most 6+5 bits of
//! integers), so only the final add/subtract rounds; Rust never contracts `a * b + c` into an FMA
//! on its own, and even an FMA would round the same way here.

use rayon::prelude::*;

use super::{GgmlType, GgufError};

/// Target number of output elements per rayon task: large enough to amortise scheduling,
/// small enough to balance across cores on mid-sized tensors.
const ELEMENTS_PER_TASK: usize = 1 << 15;

/// Dequantises `n_elements` values of type `ty` from `bytes` into `out` (ggml memory order).
///
/// `bytes` must hold exactly the blocks for `n_elements` values and `out` exactly `n_elements`
/// slots; anything else is an error, as is a type outside [`GgmlType::DEQUANTIZE_SUPPORTED`].
pub fn dequantize(
    ty: GgmlType,
    bytes: &[u8],
    n_elements: usize,
    out: &mut [f32],
) -> Result<(), GgufError> {
    if !ty.is_dequantize_supported() {
        return Err(GgufError::UnsupportedType { ggml_type: ty });
    }
    let invalid = |reason: String| GgufError::InvalidDequantInput {
        ggml_type: ty,
        reason,
    };
    // Block and type sizes are small constants (<= 256 and <= 292), so these casts are lossless.
    let block_size = ty.block_size() as usize;
    let type_size = ty.type_size() as usize;
    if !n_elements.is_multiple_of(block_size) {
        return Err(invalid(format!(
            "{n_elements} elements is not a whole number of {block_size}-element blocks"
        )));
    }
    let expected_bytes = (n_elements / block_size)
        .checked_mul(type_size)
        .ok_or_else(|| invalid(format!("byte size of {n_elements} elements overflows")))?;
    if bytes.len() != expected_bytes {
        return Err(invalid(format!(
            "{n_elements} elements need {expected_bytes} bytes of data, got {}",
            bytes.len()
        )));
    }
    if out.len() != n_elements {
        return Err(invalid(format!(
            "output buffer has {} slots for {n_elements} elements",
            out.len()
        )));
    }

    match ty {
        GgmlType::F32 => par_blocks(bytes, out, 1, 4, |b, o| {
            o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }),
        GgmlType::F16 => par_blocks(bytes, out, 1, 2, |b, o| {
            o[0] = f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
        }),
        GgmlType::BF16 => par_blocks(bytes, out, 1, 2, |b, o| {
            o[0] = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
        }),
        GgmlType::Q8_0 => par_blocks(bytes, out, block_size, type_size, dequantize_q8_0),
        GgmlType::Q4_0 => par_blocks(bytes, out, block_size, type_size, dequantize_q4_0),
        GgmlType::Q4_1 => par_blocks(bytes, out, block_size, type_size, dequantize_q4_1),
        GgmlType::Q5_0 => par_blocks(bytes, out, block_size, type_size, dequantize_q5_0),
        GgmlType::Q5_1 => par_blocks(bytes, out, block_size, type_size, dequantize_q5_1),
        GgmlType::Q4_K => par_blocks(bytes, out, block_size, type_size, dequantize_q4_k),
        GgmlType::Q5_K => par_blocks(bytes, out, block_size, type_size, dequantize_q5_k),
        GgmlType::Q6_K => par_blocks(bytes, out, block_size, type_size, dequantize_q6_k),
        _ => return Err(GgufError::UnsupportedType { ggml_type: ty }),
    }
    Ok(())
}

/// Runs `dequantize_block(block_bytes, block_out)` over every block, in parallel over groups of
/// blocks. Lengths were validated by the caller, so the chunks pair up exactly.
fn par_blocks<F>(bytes: &[u8], out: &mut [f32], block_size: usize, type_size: usize, f: F)
where
    F: Fn(&[u8], &mut [f32]) + Sync,
{
    let blocks_per_task = (ELEMENTS_PER_TASK / block_size).max(1);
    out.par_chunks_mut(blocks_per_task * block_size)
        .zip(bytes.par_chunks(blocks_per_task * type_size))
        .for_each(|(out_group, byte_group)| {
            for (block_out, block_bytes) in out_group
                .chunks_exact_mut(block_size)
                .zip(byte_group.chunks_exact(type_size))
            {
                f(block_bytes, block_out);
            }
        });
}

/// Exact IEEE binary16 -> binary32 conversion, as numpy's `astype(np.float32)` does it:
/// subnormals become normal f32 values, and NaN payloads are kept as they are (shifted into the
/// f32 mantissa, without setting the quiet bit — unlike the `half` crate's software fallback).
#[inline]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exponent = ((h >> 10) & 0x1F) as u32;
    let mantissa = (h & 0x03FF) as u32;
    let magnitude = match exponent {
        // Zero or subnormal: mantissa * 2^-24, exact in f32.
        0 => (mantissa as f32 * (1.0 / 16_777_216.0)).to_bits(),
        // Infinity or NaN.
        0x1F => 0x7F80_0000 | (mantissa << 13),
        // Normal: rebias the exponent from 15 to 127.
        _ => ((exponent + 112) << 23) | (mantissa << 13),
    };
    f32::from_bits(sign | magnitude)
}

#[inline]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// Q8_0: f16 scale d, 32 × i8. numpy: `x * d`.
fn dequantize_q8_0(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    let qs = &block[2..34];
    for (o, &q) in out[..32].iter_mut().zip(qs) {
        *o = (q as i8) as f32 * d;
    }
}

/// Q4_0: f16 scale d, 16 bytes of nibbles (low nibbles = elements 0..16, high = 16..32),
/// value = d * (nibble - 8).
fn dequantize_q4_0(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    let qs = &block[2..18];
    let (low, high) = out[..32].split_at_mut(16);
    for j in 0..16 {
        low[j] = d * ((qs[j] & 0x0F) as i32 - 8) as f32;
        high[j] = d * ((qs[j] >> 4) as i32 - 8) as f32;
    }
}

/// Q4_1: f16 scale d, f16 min m, 16 bytes of nibbles; value = (d * nibble) + m.
fn dequantize_q4_1(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    let m = f16_at(block, 2);
    let qs = &block[4..20];
    let (low, high) = out[..32].split_at_mut(16);
    for j in 0..16 {
        low[j] = d * (qs[j] & 0x0F) as f32 + m;
        high[j] = d * (qs[j] >> 4) as f32 + m;
    }
}

/// Q5_0: f16 scale d, u32 of fifth bits (bit i for element i), 16 bytes of nibbles;
/// value = d * (5-bit value - 16).
fn dequantize_q5_0(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
    let qs = &block[6..22];
    let (low, high) = out[..32].split_at_mut(16);
    for j in 0..16 {
        let q_low = (qs[j] & 0x0F) as u32 | (((qh >> j) & 1) << 4);
        let q_high = (qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
        low[j] = d * (q_low as i32 - 16) as f32;
        high[j] = d * (q_high as i32 - 16) as f32;
    }
}

/// Q5_1: f16 scale d, f16 min m, u32 of fifth bits, 16 bytes of nibbles;
/// value = (d * 5-bit value) + m.
fn dequantize_q5_1(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    let m = f16_at(block, 2);
    let qh = u32::from_le_bytes([block[4], block[5], block[6], block[7]]);
    let qs = &block[8..24];
    let (low, high) = out[..32].split_at_mut(16);
    for j in 0..16 {
        let q_low = (qs[j] & 0x0F) as u32 | (((qh >> j) & 1) << 4);
        let q_high = (qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
        low[j] = d * q_low as f32 + m;
        high[j] = d * q_high as f32 + m;
    }
}

/// Unpacks the 8 six-bit (scale, min) pairs of a Q4_K/Q5_K super-block from 12 bytes:
/// bytes 0..4 hold scales 0..4 (low 6 bits) and the top 2 bits of scales 4..8, bytes 4..8 the
/// same for mins, bytes 8..12 the low 4 bits of scales 4..8 (low nibble) and mins 4..8 (high).
#[inline]
fn k_quant_scales_and_mins(packed: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut scales = [0u8; 8];
    let mut mins = [0u8; 8];
    for j in 0..4 {
        scales[j] = packed[j] & 0x3F;
        mins[j] = packed[j + 4] & 0x3F;
        scales[j + 4] = (packed[j + 8] & 0x0F) | ((packed[j] >> 2) & 0x30);
        mins[j + 4] = (packed[j + 8] >> 4) | ((packed[j + 4] >> 2) & 0x30);
    }
    (scales, mins)
}

/// Q4_K: 256 elements in 8 sub-blocks of 32. f16 d, f16 dmin, 12 bytes of packed 6-bit scales
/// and mins, 128 bytes of nibbles (sub-block 2k: low nibbles of bytes 32k..32k+32, sub-block
/// 2k+1: their high nibbles). value = (d * scale) * q - (dmin * min), as numpy evaluates it.
fn dequantize_q4_k(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    let dmin = f16_at(block, 2);
    let (scales, mins) = k_quant_scales_and_mins(&block[4..16]);
    let qs = &block[16..144];
    for (sub, sub_out) in out[..256].chunks_exact_mut(32).enumerate() {
        let scale = d * scales[sub] as f32;
        let min = dmin * mins[sub] as f32;
        let bytes = &qs[32 * (sub / 2)..32 * (sub / 2) + 32];
        let shift = 4 * (sub % 2);
        for (o, &byte) in sub_out.iter_mut().zip(bytes) {
            *o = scale * ((byte >> shift) & 0x0F) as f32 - min;
        }
    }
}

/// Q5_K: as Q4_K plus 32 bytes of fifth bits (bit `sub` of byte l is the high bit of element l
/// of sub-block `sub`), which come before the nibbles.
fn dequantize_q5_k(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    let dmin = f16_at(block, 2);
    let (scales, mins) = k_quant_scales_and_mins(&block[4..16]);
    let qh = &block[16..48];
    let qs = &block[48..176];
    for (sub, sub_out) in out[..256].chunks_exact_mut(32).enumerate() {
        let scale = d * scales[sub] as f32;
        let min = dmin * mins[sub] as f32;
        let bytes = &qs[32 * (sub / 2)..32 * (sub / 2) + 32];
        let shift = 4 * (sub % 2);
        for ((o, &byte), &high) in sub_out.iter_mut().zip(bytes).zip(qh) {
            let q = ((byte >> shift) & 0x0F) | (((high >> sub) & 1) << 4);
            *o = scale * q as f32 - min;
        }
    }
}

/// Q6_K: 256 elements, 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 i8 scales (one per
/// 16 elements), f16 d. value = (d * scale) * (6-bit value - 32).
///
/// Within each half of 128 elements, quarter `k` (32 elements) takes its low nibbles from bytes
/// `32 * (k % 2)..` of the half's 64 `ql` bytes (low nibble for k < 2, high for k >= 2) and its
/// high bits from bits `2k..2k+2` of the half's 32 `qh` bytes.
fn dequantize_q6_k(block: &[u8], out: &mut [f32]) {
    let ql = &block[0..128];
    let qh = &block[128..192];
    let scales = &block[192..208];
    let d = f16_at(block, 208);
    let mut sub_scales = [0f32; 16];
    for (s, &raw) in sub_scales.iter_mut().zip(scales) {
        *s = d * (raw as i8) as f32;
    }
    for (half, half_out) in out[..256].chunks_exact_mut(128).enumerate() {
        let half_ql = &ql[64 * half..64 * half + 64];
        let half_qh = &qh[32 * half..32 * half + 32];
        for (quarter, quarter_out) in half_out.chunks_exact_mut(32).enumerate() {
            let low_bytes = &half_ql[32 * (quarter % 2)..32 * (quarter % 2) + 32];
            let low_shift = 4 * (quarter / 2);
            let high_shift = 2 * quarter;
            for (l, ((o, &low), &high)) in quarter_out
                .iter_mut()
                .zip(low_bytes)
                .zip(half_qh)
                .enumerate()
            {
                let q = ((low >> low_shift) & 0x0F) | (((high >> high_shift) & 0x03) << 4);
                let sub = (128 * half + 32 * quarter + l) / 16;
                *o = sub_scales[sub] * (q as i32 - 32) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Every f16 pattern is checked against `half` in tests/gguf_dequant.rs.
    #[test]
    fn f16_nan_keeps_its_payload_unquieted() {
        assert_eq!(f16_bits_to_f32(0x7C01).to_bits(), 0x7F80_2000);
        assert_eq!(f16_bits_to_f32(0xFE00).to_bits(), 0xFFC0_0000);
    }
}
