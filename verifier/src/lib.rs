//! Verifier: the acceptance rules of speculative decoding (issue 3), as pure CPU references.
//!
//! A verify step gets the k draft tokens, the target's distributions P_1..P_{k+1} given the drafted
//! prefix, the draft's distributions Q_1..Q_k (or "one-hot" for drafters without probabilities)
//! and a source of uniforms, and returns how many drafts were accepted plus the emitted tokens
//! (the accepted drafts and exactly one target token). Rules and formulas follow
//! `docs/reference.md` section 2; metrics (AL, per-position rates) follow section 3.
//!
//! Every rule is written against a small "decisions" interface, so [`AcceptanceRule::verify`]
//! (uniform-driven) and [`AcceptanceRule::outcome_distribution`] (exact enumeration of every
//! branch) run the same code; the exactness tests rest on that.
//!
//! ```
//! use rand_chacha::{rand_core::SeedableRng, ChaCha8Rng};
//! use specula_verifier::{AcceptanceRule, DraftProbs, VerifyInput};
//!
//! let target = vec![vec![0.25, 0.75], vec![0.5, 0.5]];
//! let draft = vec![vec![0.5, 0.5]];
//! let input = VerifyInput {
//!     draft_tokens: &[1],
//!     draft_probs: DraftProbs::Full(&draft),
//!     target_probs: &target,
//! };
//! let mut rng = ChaCha8Rng::seed_from_u64(7);
//! let outcome = AcceptanceRule::Standard.verify(&input, &mut rng).unwrap();
//! assert_eq!(outcome.emitted.len(), outcome.num_accepted + 1);
//! ```

mod decisions;
mod error;
mod input;
mod metrics;
mod rules;
mod synthetic;
mod uniform;

pub use error::{RowKind, VerifyError};
pub use input::{DraftProbs, VerifyInput, VerifyOutcome, NORMALISATION_TOLERANCE};
pub use metrics::AcceptanceCounter;
pub use rules::AcceptanceRule;
pub use synthetic::SyntheticAcceptance;
pub use uniform::{RngUniforms, ScriptedUniforms, UniformSource};
