//! Everything a rule, the synthetic configuration or the counter can reject.

/// Which family of rows a probability problem was found in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowKind {
    /// `VerifyInput::target_probs` (P_1..P_{k+1}).
    Target,
    /// `DraftProbs::Full` (Q_1..Q_k).
    Draft,
}

impl std::fmt::Display for RowKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RowKind::Target => "target",
            RowKind::Draft => "draft",
        })
    }
}

/// Row and slot indices in errors are 0-based positions in the slices the caller passed
/// (`draft_tokens[slot]`, `target_probs[row]`), not the 1-based slot numbers of the papers.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum VerifyError {
    #[error("{drafts} draft tokens need {expected} target rows (one per slot plus the bonus), got {got}")]
    TargetRowCount {
        drafts: usize,
        expected: usize,
        got: usize,
    },
    #[error("{drafts} draft tokens need {drafts} draft rows, got {got}")]
    DraftRowCount { drafts: usize, got: usize },
    #[error("empty vocabulary: target row 0 has no entries")]
    EmptyVocabulary,
    #[error("{kind} row {row} has {len} entries but the vocabulary (target row 0) has {vocab}")]
    RowLength {
        kind: RowKind,
        row: usize,
        len: usize,
        vocab: usize,
    },
    #[error("{kind} row {row} entry {index} is {value}: probabilities must be finite and >= 0")]
    InvalidProbability {
        kind: RowKind,
        row: usize,
        index: usize,
        value: f32,
    },
    #[error("{kind} row {row} sums to {sum}, not 1 (tolerance {tolerance}): pass processed probabilities, not logits")]
    RowNotNormalised {
        kind: RowKind,
        row: usize,
        sum: f64,
        tolerance: f64,
    },
    #[error("draft token {token} at slot {slot} is outside the vocabulary of {vocab}")]
    TokenOutOfVocabulary {
        slot: usize,
        token: u32,
        vocab: usize,
    },
    #[error("draft token {token} at slot {slot} has draft probability 0: the drafter cannot have drawn it")]
    ZeroDraftProbability { slot: usize, token: u32 },
    #[error("uniform source gave {0}, expected a finite value in [0, 1) (exhausted script?)")]
    BadUniform(f64),
    #[error("mean acceptance length {length} must be in [1, {max}] for {k} draft slots")]
    InvalidMeanLength { length: f64, k: usize, max: usize },
    #[error("acceptance rate {value} at slot {slot} must be finite and in [0, 1]")]
    InvalidRate { slot: usize, value: f64 },
    #[error("unconditional acceptance rates must be non-increasing: slot {slot} has {value} > {previous}")]
    IncreasingRates {
        slot: usize,
        previous: f64,
        value: f64,
    },
    #[error(
        "synthetic acceptance is configured for {configured} slots but the step drafted {drafts}"
    )]
    TooFewSyntheticRates { configured: usize, drafts: usize },
    #[error("a verify step cannot accept {accepted} of {drafts} drafts")]
    AcceptedExceedsDrafted { accepted: usize, drafts: usize },
}
