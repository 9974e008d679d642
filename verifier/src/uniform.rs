//! Where the rules get their randomness: plain uniforms, so a run can be reproduced from a seed
//! and a GPU kernel with its own generator can be checked against the same decisions.

use rand::Rng;

/// A stream of uniforms in `[0, 1)`. A value outside that range (or NaN) makes `verify` fail with
/// [`crate::VerifyError::BadUniform`] instead of silently biasing a decision.
pub trait UniformSource {
    fn next_uniform(&mut self) -> f64;
}

impl UniformSource for rand_chacha::ChaCha8Rng {
    fn next_uniform(&mut self) -> f64 {
        self.random::<f64>()
    }
}

impl UniformSource for rand_chacha::ChaCha20Rng {
    fn next_uniform(&mut self) -> f64 {
        self.random::<f64>()
    }
}

/// Any other `rand` generator, wrapped: `RngUniforms(StdRng::seed_from_u64(1))`.
#[derive(Debug, Clone)]
pub struct RngUniforms<R>(pub R);

impl<R: rand::RngCore> UniformSource for RngUniforms<R> {
    fn next_uniform(&mut self) -> f64 {
        self.0.random::<f64>()
    }
}

/// A fixed list of uniforms, for tests that need to steer every decision. Once the list is used
/// up it yields NaN, which `verify` reports as an error rather than inventing values.
#[derive(Debug, Clone, Default)]
pub struct ScriptedUniforms {
    values: Vec<f64>,
    next: usize,
}

impl ScriptedUniforms {
    pub fn new(values: impl Into<Vec<f64>>) -> Self {
        ScriptedUniforms {
            values: values.into(),
            next: 0,
        }
    }

    /// How many uniforms have been handed out (including a NaN past the end).
    pub fn consumed(&self) -> usize {
        self.next
    }

    pub fn remaining(&self) -> usize {
        self.values.len().saturating_sub(self.next)
    }
}

impl UniformSource for ScriptedUniforms {
    fn next_uniform(&mut self) -> f64 {
        let value = self.values.get(self.next).copied().unwrap_or(f64::NAN);
        self.next += 1;
        value
    }
}
