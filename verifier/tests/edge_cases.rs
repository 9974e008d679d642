//! Edge cases and hostile inputs: clear errors, never a panic, never an out-of-range token.

use proptest::prelude::*;
use rand_chacha::{rand_core::SeedableRng, ChaCha8Rng};
use specula_kernels::sampling::sample_from;
use specula_verifier::{
    AcceptanceRule, DraftProbs, RowKind, ScriptedUniforms, SyntheticAcceptance, VerifyError,
    VerifyInput,
};

fn all_rules() -> Vec<AcceptanceRule> {
    vec![
        AcceptanceRule::Greedy,
        AcceptanceRule::Standard,
        AcceptanceRule::Block,
        AcceptanceRule::Synthetic(SyntheticAcceptance::from_mean_length(2.5, 4).unwrap()),
    ]
}

#[test]
fn k_zero_is_a_plain_sample_of_the_target() {
    let target = vec![vec![0.1f32, 0.0, 0.6, 0.3]];
    for rule in all_rules() {
        for draft_probs in [DraftProbs::OneHot, DraftProbs::Full(&[])] {
            let input = VerifyInput {
                draft_tokens: &[],
                draft_probs,
                target_probs: &target,
            };
            for u in [0.0, 0.05, 0.1, 0.5, 0.69, 0.7, 0.999] {
                let mut uniforms = ScriptedUniforms::new(vec![u]);
                let outcome = rule.verify(&input, &mut uniforms).unwrap();
                assert_eq!(outcome.num_accepted, 0);
                let expected = if rule == AcceptanceRule::Greedy {
                    2
                } else {
                    // The same token plain sampling picks from the same uniform.
                    sample_from(&target[0], u)
                };
                assert_eq!(outcome.emitted, vec![expected], "{} u={u}", rule.name());
                assert_eq!(outcome.target_token(), expected);
            }
        }
    }
}

fn error_of(input: &VerifyInput) -> Vec<VerifyError> {
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    all_rules()
        .iter()
        .map(|rule| rule.verify(input, &mut rng).unwrap_err())
        .collect()
}

fn assert_all(errors: Vec<VerifyError>, expected: VerifyError) {
    for error in errors {
        assert_eq!(error, expected);
        assert!(!error.to_string().is_empty());
    }
}

#[test]
fn draft_token_outside_the_vocabulary() {
    let target = vec![vec![0.5f32, 0.5]; 3];
    let input = VerifyInput {
        draft_tokens: &[1, 2],
        draft_probs: DraftProbs::OneHot,
        target_probs: &target,
    };
    assert_all(
        error_of(&input),
        VerifyError::TokenOutOfVocabulary {
            slot: 1,
            token: 2,
            vocab: 2,
        },
    );
    let huge = VerifyInput {
        draft_tokens: &[u32::MAX, 0],
        ..input
    };
    assert!(matches!(
        error_of(&huge)[0],
        VerifyError::TokenOutOfVocabulary { slot: 0, .. }
    ));
}

#[test]
fn bad_probabilities_in_target_or_draft_rows() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.25] {
        let mut target = vec![vec![0.5f32, 0.5]; 2];
        target[1] = vec![bad, 1.0];
        let input = VerifyInput {
            draft_tokens: &[0],
            draft_probs: DraftProbs::OneHot,
            target_probs: &target,
        };
        for error in error_of(&input) {
            assert!(
                matches!(
                    error,
                    VerifyError::InvalidProbability {
                        kind: RowKind::Target,
                        row: 1,
                        index: 0,
                        ..
                    }
                ),
                "{error:?}"
            );
        }
        let good_target = vec![vec![0.5f32, 0.5]; 2];
        let draft = vec![vec![1.0f32, bad]];
        let input = VerifyInput {
            draft_tokens: &[0],
            draft_probs: DraftProbs::Full(&draft),
            target_probs: &good_target,
        };
        for error in error_of(&input) {
            assert!(
                matches!(
                    error,
                    VerifyError::InvalidProbability {
                        kind: RowKind::Draft,
                        row: 0,
                        index: 1,
                        ..
                    }
                ),
                "{error:?}"
            );
        }
    }
}

#[test]
fn wrong_shapes() {
    let two = vec![0.5f32, 0.5];
    // k + 1 target rows are required.
    let target = vec![two.clone(); 2];
    let input = VerifyInput {
        draft_tokens: &[0, 1],
        draft_probs: DraftProbs::OneHot,
        target_probs: &target,
    };
    assert_all(
        error_of(&input),
        VerifyError::TargetRowCount {
            drafts: 2,
            expected: 3,
            got: 2,
        },
    );
    let none: Vec<Vec<f32>> = vec![];
    let input = VerifyInput {
        draft_tokens: &[],
        draft_probs: DraftProbs::OneHot,
        target_probs: &none,
    };
    assert_all(
        error_of(&input),
        VerifyError::TargetRowCount {
            drafts: 0,
            expected: 1,
            got: 0,
        },
    );
    // Row of the wrong length.
    let ragged = vec![two.clone(), vec![0.2, 0.3, 0.5]];
    let input = VerifyInput {
        draft_tokens: &[0],
        draft_probs: DraftProbs::OneHot,
        target_probs: &ragged,
    };
    assert_all(
        error_of(&input),
        VerifyError::RowLength {
            kind: RowKind::Target,
            row: 1,
            len: 3,
            vocab: 2,
        },
    );
    let target = vec![two.clone(); 2];
    let draft = vec![vec![1.0f32]];
    let input = VerifyInput {
        draft_tokens: &[0],
        draft_probs: DraftProbs::Full(&draft),
        target_probs: &target,
    };
    assert_all(
        error_of(&input),
        VerifyError::RowLength {
            kind: RowKind::Draft,
            row: 0,
            len: 1,
            vocab: 2,
        },
    );
    // Wrong number of draft rows.
    let input = VerifyInput {
        draft_tokens: &[0],
        draft_probs: DraftProbs::Full(&[]),
        target_probs: &target,
    };
    assert_all(
        error_of(&input),
        VerifyError::DraftRowCount { drafts: 1, got: 0 },
    );
    // Empty vocabulary.
    let empty = vec![vec![]];
    let input = VerifyInput {
        draft_tokens: &[],
        draft_probs: DraftProbs::OneHot,
        target_probs: &empty,
    };
    assert_all(error_of(&input), VerifyError::EmptyVocabulary);
}

#[test]
fn rows_that_are_not_distributions() {
    // Logits, or an all-zero row, are caller bugs.
    for row in [vec![2.0f32, 1.0], vec![0.0, 0.0]] {
        let target = vec![vec![0.5f32, 0.5], row];
        let input = VerifyInput {
            draft_tokens: &[0],
            draft_probs: DraftProbs::OneHot,
            target_probs: &target,
        };
        for error in error_of(&input) {
            assert!(matches!(
                error,
                VerifyError::RowNotNormalised {
                    kind: RowKind::Target,
                    row: 1,
                    ..
                }
            ));
        }
    }
}

#[test]
fn drafted_token_with_zero_draft_probability_is_an_error() {
    let target = vec![vec![0.5f32, 0.5]; 2];
    let draft = vec![vec![1.0f32, 0.0]];
    let input = VerifyInput {
        draft_tokens: &[1],
        draft_probs: DraftProbs::Full(&draft),
        target_probs: &target,
    };
    assert_all(
        error_of(&input),
        VerifyError::ZeroDraftProbability { slot: 0, token: 1 },
    );
}

#[test]
fn drafted_token_the_target_rules_out_is_never_accepted() {
    // P_1(x_1) = 0: Standard and Block must reject and correct from the target's support.
    let target = vec![vec![0.0f32, 0.4, 0.6], vec![1.0, 0.0, 0.0]];
    let draft = vec![vec![0.9f32, 0.05, 0.05]];
    for rule in [AcceptanceRule::Standard, AcceptanceRule::Block] {
        for q in [DraftProbs::OneHot, DraftProbs::Full(&draft)] {
            let input = VerifyInput {
                draft_tokens: &[0],
                draft_probs: q,
                target_probs: &target,
            };
            let outcomes = rule.outcome_distribution(&input).unwrap();
            assert!(outcomes
                .iter()
                .all(|(o, _)| o.num_accepted == 0 && o.emitted[0] != 0));
        }
    }
}

/// A clean row: entries in [0, 1), some exactly zero, normalised (all-zero rows stay zero, which
/// validation must reject).
fn row_strategy(vocab: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(
        prop_oneof![3 => 0.0f32..1.0, 1 => Just(0.0f32)],
        vocab..=vocab,
    )
}

fn normalise(row: &mut [f32]) {
    let sum: f32 = row.iter().sum();
    if sum > 0.0 {
        for v in row.iter_mut() {
            *v /= sum;
        }
    }
}

/// One thing wrong with an otherwise valid input (or nothing).
#[derive(Debug, Clone)]
enum Fault {
    None,
    ExtraTargetRow,
    MissingTargetRow,
    MissingDraftRow,
    RaggedRow {
        row: usize,
    },
    TokenOutOfVocabulary {
        slot: usize,
        excess: u32,
    },
    BadValue {
        draft: bool,
        row: usize,
        index: usize,
        value: f32,
    },
}

fn fault_strategy() -> impl Strategy<Value = Fault> {
    prop_oneof![
        6 => Just(Fault::None),
        1 => Just(Fault::ExtraTargetRow),
        1 => Just(Fault::MissingTargetRow),
        1 => Just(Fault::MissingDraftRow),
        1 => (0usize..6).prop_map(|row| Fault::RaggedRow { row }),
        1 => (0usize..5, 0u32..1000).prop_map(|(slot, excess)| Fault::TokenOutOfVocabulary { slot, excess }),
        2 => (any::<bool>(), 0usize..6, 0usize..6, prop_oneof![
                Just(f32::NAN), Just(f32::INFINITY), Just(-0.5f32), Just(3.0f32), Just(0.0f32)
            ])
            .prop_map(|(draft, row, index, value)| Fault::BadValue { draft, row, index, value }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    /// Whatever the input, `verify` returns an error or a well-formed outcome whose tokens the
    /// target can produce; it never panics.
    #[test]
    fn verify_never_panics_and_emits_valid_tokens(
        vocab in 1usize..6,
        k in 0usize..5,
        rows in prop::collection::vec(row_strategy(5), 11),
        raw_tokens in prop::collection::vec(0u32..5, 5),
        one_hot in any::<bool>(),
        fault in fault_strategy(),
        seed in any::<u64>(),
    ) {
        let row = |i: usize| -> Vec<f32> {
            let mut r = rows[i][..vocab].to_vec();
            normalise(&mut r);
            r
        };
        let mut drafts: Vec<u32> = raw_tokens[..k].iter().map(|&t| t % vocab as u32).collect();
        let mut target: Vec<Vec<f32>> = (0..=k).map(row).collect();
        let mut draft: Vec<Vec<f32>> = (0..k).map(|i| row(i + 6)).collect();
        // A drafter draws from its own distribution: point each draft at a token it gives mass.
        for (slot, q) in draft.iter().enumerate() {
            if let Some(t) = (0..vocab).map(|d| (drafts[slot] as usize + d) % vocab).find(|&t| q[t] > 0.0) {
                drafts[slot] = t as u32;
            }
        }
        match fault.clone() {
            Fault::None => {}
            Fault::ExtraTargetRow => target.push(row(5)),
            Fault::MissingTargetRow => { target.pop(); }
            Fault::MissingDraftRow => { draft.pop(); }
            Fault::RaggedRow { row } => {
                if let Some(r) = target.get_mut(row) { r.push(0.0); }
            }
            Fault::TokenOutOfVocabulary { slot, excess } => {
                if let Some(t) = drafts.get_mut(slot) { *t = vocab as u32 + excess; }
            }
            Fault::BadValue { draft: in_draft, row, index, value } => {
                let rows = if in_draft { &mut draft } else { &mut target };
                if let Some(v) = rows.get_mut(row).and_then(|r| r.get_mut(index)) { *v = value; }
            }
        }
        let input = VerifyInput {
            draft_tokens: &drafts,
            draft_probs: if one_hot { DraftProbs::OneHot } else { DraftProbs::Full(&draft) },
            target_probs: &target,
        };
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for rule in all_rules() {
            match rule.verify(&input, &mut rng) {
                Err(error) => prop_assert!(!error.to_string().is_empty()),
                Ok(outcome) => {
                    prop_assert!(outcome.num_accepted <= k);
                    prop_assert_eq!(outcome.emitted.len(), outcome.num_accepted + 1);
                    prop_assert_eq!(&outcome.emitted[..outcome.num_accepted], &drafts[..outcome.num_accepted]);
                    let last = outcome.target_token() as usize;
                    prop_assert!(last < vocab);
                    // The target token has mass in the target row it was drawn for.
                    prop_assert!(target[outcome.num_accepted][last] > 0.0, "{} emitted a zero-probability token", rule.name());
                    if rule.is_lossless() {
                        // Lossless rules only accept drafts the target can produce.
                        for (slot, &x) in drafts[..outcome.num_accepted].iter().enumerate() {
                            prop_assert!(target[slot][x as usize] > 0.0);
                        }
                    }
                }
            }
        }
    }
}
