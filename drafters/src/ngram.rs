//! Prompt-lookup drafting: find the most recent earlier occurrence of the sequence's last n tokens
//! (longest n first) and propose the tokens that followed it. No model, no distributions (the
//! verifier treats q as one-hot on the proposed token).

use crate::{DraftError, DraftProposal, DraftRequest, Drafter, SeqKey};
use std::collections::HashMap;

pub struct NgramDrafter {
    /// Longest and shortest suffix lengths tried.
    pub max_ngram: usize,
    pub min_ngram: usize,
    histories: HashMap<SeqKey, Vec<u32>>,
}

impl NgramDrafter {
    pub fn new(min_ngram: usize, max_ngram: usize) -> NgramDrafter {
        let min_ngram = min_ngram.max(1);
        NgramDrafter {
            max_ngram: max_ngram.max(min_ngram),
            min_ngram,
            histories: HashMap::new(),
        }
    }

    /// Tokens following the latest earlier match of the longest matching suffix.
    pub fn lookup(
        history: &[u32],
        min_ngram: usize,
        max_ngram: usize,
        k: usize,
        vocab_limit: usize,
    ) -> Vec<u32> {
        if k == 0 {
            return Vec::new();
        }
        let len = history.len();
        for n in (min_ngram..=max_ngram.min(len.saturating_sub(1))).rev() {
            let suffix = &history[len - n..];
            // Latest match first: recent context predicts best.
            for start in (0..len - n).rev() {
                if &history[start..start + n] == suffix {
                    let follow = &history[start + n..(start + n + k).min(len)];
                    let proposal: Vec<u32> = follow
                        .iter()
                        .copied()
                        .take_while(|&t| (t as usize) < vocab_limit)
                        .collect();
                    if !proposal.is_empty() {
                        return proposal;
                    }
                }
            }
        }
        Vec::new()
    }
}

impl Default for NgramDrafter {
    fn default() -> Self {
        NgramDrafter::new(1, 4)
    }
}

impl Drafter for NgramDrafter {
    fn name(&self) -> &str {
        "ngram"
    }

    fn add_sequence(&mut self, seq: SeqKey, tokens: &[u32]) -> Result<(), DraftError> {
        if self.histories.insert(seq, tokens.to_vec()).is_some() {
            return Err(DraftError::DuplicateSequence(seq));
        }
        Ok(())
    }

    fn remove_sequence(&mut self, seq: SeqKey) -> Result<(), DraftError> {
        self.histories
            .remove(&seq)
            .map(|_| ())
            .ok_or(DraftError::UnknownSequence(seq))
    }

    fn propose(
        &mut self,
        requests: &mut [DraftRequest<'_>],
    ) -> Result<Vec<DraftProposal>, DraftError> {
        requests
            .iter()
            .map(|r| {
                let h = self
                    .histories
                    .get(&r.seq)
                    .ok_or(DraftError::UnknownSequence(r.seq))?;
                let tokens = Self::lookup(
                    h,
                    self.min_ngram,
                    self.max_ngram,
                    r.max_tokens,
                    r.vocab_limit,
                );
                Ok(DraftProposal {
                    tokens,
                    probs: None,
                })
            })
            .collect()
    }

    fn commit(&mut self, seq: SeqKey, tokens: &[u32]) -> Result<(), DraftError> {
        self.histories
            .get_mut(&seq)
            .ok_or(DraftError::UnknownSequence(seq))?
            .extend_from_slice(tokens);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_continuation_of_latest_longest_match() {
        // ... 1 2 3 [9 9] ... 1 2 3 [7 8] ... 1 2 3 -> the latest match of "1 2 3" continues with 7 8.
        let h = [1, 2, 3, 9, 9, 5, 1, 2, 3, 7, 8, 6, 1, 2, 3];
        assert_eq!(NgramDrafter::lookup(&h, 1, 3, 2, 100), vec![7, 8]);
        assert_eq!(NgramDrafter::lookup(&h, 1, 3, 5, 100), vec![7, 8, 6, 1, 2]);
        assert_eq!(
            NgramDrafter::lookup(&[4, 5, 6], 1, 3, 3, 100),
            Vec::<u32>::new()
        );
        assert_eq!(NgramDrafter::lookup(&h, 1, 3, 0, 100), Vec::<u32>::new());
        // Ids at or past the limit are never proposed.
        assert_eq!(NgramDrafter::lookup(&h, 1, 3, 2, 8), vec![7]);
    }
}
