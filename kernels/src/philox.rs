//! Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3", SC'11;
//! the Random123 library), the counter-based generator the GPU sampling kernels draw their uniforms
//! from. This is the CPU reference: `kernels/cuda/sampling.cu` implements the same function, the
//! known-answer vectors of Random123 check this one, and `experiments` `gpu_sampling_check` checks the
//! GPU one against this one. With it the CPU verifier can replay exactly the decisions a GPU verify
//! step made (`PhiloxStream` yields the same uniforms in the same order).
//!
//! Stream layout (ours, shared with the kernel): a request owns a 64-bit `seed` (the key) and a
//! 64-bit step counter `offset`; the `draw`-th uniform of a step comes from the block with counter
//! words `[offset_lo, offset_hi, draw, 0]`, so steps and draws never share a counter.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// One Philox4x32 block with 10 rounds: the key is bumped before every round but the first, as in
/// Random123's `philox4x32_R`.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let p0 = (M0 as u64) * (c[0] as u64);
        let p1 = (M1 as u64) * (c[2] as u64);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The `draw`-th uniform of step `offset` of the stream keyed by `seed`: 53 random bits from the
/// first two output words, `((w0 >> 5) * 2^26 + (w1 >> 6)) / 2^53`, so it lies in [0, 1) like the
/// f64 uniforms the verifier expects (a value of exactly 1 would break `u < p` decisions).
pub fn uniform(seed: u64, offset: u64, draw: u32) -> f64 {
    let w = philox4x32_10(
        [offset as u32, (offset >> 32) as u32, draw, 0],
        [seed as u32, (seed >> 32) as u32],
    );
    ((w[0] >> 5) as f64 * 67_108_864.0 + (w[1] >> 6) as f64) * (1.0 / 9_007_199_254_740_992.0)
}

/// The uniforms of one verify step, in the order the GPU kernel consumes them (draw 0, 1, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PhiloxStream {
    pub seed: u64,
    pub offset: u64,
    next_draw: u32,
}

impl PhiloxStream {
    pub fn new(seed: u64, offset: u64) -> Self {
        PhiloxStream {
            seed,
            offset,
            next_draw: 0,
        }
    }

    /// How many uniforms have been drawn in this step.
    pub fn draws(&self) -> u32 {
        self.next_draw
    }

    pub fn next_uniform(&mut self) -> f64 {
        let u = uniform(self.seed, self.offset, self.next_draw);
        self.next_draw = self.next_draw.wrapping_add(1);
        u
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's `kat_vectors` for philox4x32 with 10 rounds: counter, key -> output.
    const KAT: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
        (
            [0, 0, 0, 0],
            [0, 0],
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8],
        ),
        (
            [u32::MAX; 4],
            [u32::MAX; 2],
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
        ),
        (
            [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
            [0xa4093822, 0x299f31d0],
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
        ),
    ];

    #[test]
    fn known_answer_vectors() {
        for (counter, key, want) in KAT {
            assert_eq!(philox4x32_10(counter, key), want, "counter {counter:08x?}");
        }
    }

    #[test]
    fn uniforms_are_in_the_unit_interval_and_look_uniform() {
        let n = 200_000u32;
        let mut sum = 0.0;
        let mut bins = [0u32; 10];
        for draw in 0..n {
            let u = uniform(7, 3, draw);
            assert!((0.0..1.0).contains(&u), "{u}");
            sum += u;
            bins[(u * 10.0) as usize] += 1;
        }
        // Mean of n uniforms: sd = sqrt(1/12 / n) = 6.5e-4; 5 sd.
        assert!((sum / n as f64 - 0.5).abs() < 3.3e-3);
        // Each decile: 20000 expected, sd ~134; 6 sd.
        for b in bins {
            assert!((b as i64 - 20_000).abs() < 800, "{bins:?}");
        }
        // The largest value the construction can give is below 1.
        let top = ((u32::MAX >> 5) as f64 * 67_108_864.0 + (u32::MAX >> 6) as f64)
            * (1.0 / 9_007_199_254_740_992.0);
        assert!(top < 1.0);
    }

    #[test]
    fn streams_differ_by_seed_offset_and_draw() {
        let a = uniform(1, 0, 0);
        assert_ne!(a, uniform(2, 0, 0));
        assert_ne!(a, uniform(1, 1, 0));
        assert_ne!(a, uniform(1, 0, 1));
        // The high words of seed and offset matter too.
        assert_ne!(a, uniform(1 | (1 << 40), 0, 0));
        assert_ne!(a, uniform(1, 1 << 40, 0));
        let mut s = PhiloxStream::new(9, 4);
        assert_eq!(s.next_uniform(), uniform(9, 4, 0));
        assert_eq!(s.next_uniform(), uniform(9, 4, 1));
        assert_eq!(s.draws(), 2);
    }
}
