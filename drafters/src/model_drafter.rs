//! An independent draft model: a small transformer sharing the target's tokenizer drafts
//! autoregressively, one batched forward per draft position, with its own paged KV cache.

use crate::{DraftError, DraftProposal, DraftRequest, Drafter, SeqKey};
use specula_kernels::sampling;
use specula_model::tokenizer::Tokenizer;
use specula_model::{PagedKvCache, SeqId, SeqInput, Transformer};
use std::collections::HashMap;

struct SeqState {
    cache_seq: SeqId,
    /// Tokens whose keys/values are in the draft cache (committed tokens plus drafted ones).
    cached: Vec<u32>,
    /// Tokens the engine committed.
    committed: Vec<u32>,
}

pub struct ModelDrafter {
    model: Transformer,
    cache: PagedKvCache,
    seqs: HashMap<SeqKey, SeqState>,
}

/// Refuses a draft model whose vocabulary differs from the target's: drafted ids would mean different
/// text to the target. Compares embedding sizes, and every token string when both tokenizers exist.
pub fn check_shared_vocabulary(
    draft_vocab: usize,
    target_vocab: usize,
    draft_tokenizer: Option<&Tokenizer>,
    target_tokenizer: Option<&Tokenizer>,
) -> Result<(), DraftError> {
    if draft_vocab != target_vocab {
        return Err(DraftError::VocabularyMismatch(format!(
            "the draft model has {draft_vocab} vocabulary rows, the target {target_vocab}"
        )));
    }
    if let (Some(d), Some(t)) = (draft_tokenizer, target_tokenizer) {
        if d.vocab_size() != t.vocab_size() {
            return Err(DraftError::VocabularyMismatch(format!(
                "the draft tokenizer has {} tokens, the target's {}",
                d.vocab_size(),
                t.vocab_size()
            )));
        }
        for id in 0..t.vocab_size() as u32 {
            if d.id_to_token(id) != t.id_to_token(id) {
                return Err(DraftError::VocabularyMismatch(format!(
                    "token {id} is {:?} for the draft model but {:?} for the target",
                    d.id_to_token(id),
                    t.id_to_token(id)
                )));
            }
        }
    }
    Ok(())
}

impl ModelDrafter {
    pub fn new(model: Transformer) -> ModelDrafter {
        // The cache grows lazily; this only caps it.
        let cache = model.new_cache(model.config.max_position_embeddings.saturating_mul(16));
        ModelDrafter {
            model,
            cache,
            seqs: HashMap::new(),
        }
    }

    pub fn model(&self) -> &Transformer {
        &self.model
    }

    /// The draft cache's tokens for a sequence (tests compare it with a fresh forward).
    pub fn cached_tokens(&self, seq: SeqKey) -> Option<&[u32]> {
        self.seqs.get(&seq).map(|s| s.cached.as_slice())
    }

    pub fn cache(&self) -> &PagedKvCache {
        &self.cache
    }

    pub fn cache_seq(&self, seq: SeqKey) -> Option<SeqId> {
        self.seqs.get(&seq).map(|s| s.cache_seq)
    }
}

impl Drafter for ModelDrafter {
    fn name(&self) -> &str {
        "draft_model"
    }

    fn add_sequence(&mut self, seq: SeqKey, tokens: &[u32]) -> Result<(), DraftError> {
        if self.seqs.contains_key(&seq) {
            return Err(DraftError::DuplicateSequence(seq));
        }
        let cache_seq = self.cache.add_sequence();
        self.seqs.insert(
            seq,
            SeqState {
                cache_seq,
                cached: Vec::new(),
                committed: tokens.to_vec(),
            },
        );
        Ok(())
    }

    fn remove_sequence(&mut self, seq: SeqKey) -> Result<(), DraftError> {
        let s = self
            .seqs
            .remove(&seq)
            .ok_or(DraftError::UnknownSequence(seq))?;
        self.cache
            .remove_sequence(s.cache_seq)
            .map_err(specula_model::ModelError::from)?;
        Ok(())
    }

    fn propose(
        &mut self,
        requests: &mut [DraftRequest<'_>],
    ) -> Result<Vec<DraftProposal>, DraftError> {
        let mut proposals = vec![
            DraftProposal {
                tokens: Vec::new(),
                probs: Some(Vec::new())
            };
            requests.len()
        ];
        // Roll each cache back to what is still committed, and collect the tokens to feed first.
        let mut feeds: Vec<Vec<u32>> = Vec::with_capacity(requests.len());
        for r in requests.iter() {
            let s = self
                .seqs
                .get_mut(&r.seq)
                .ok_or(DraftError::UnknownSequence(r.seq))?;
            if r.max_tokens == 0 {
                feeds.push(Vec::new());
                continue;
            }
            let mut keep = s
                .cached
                .iter()
                .zip(&s.committed)
                .take_while(|(a, b)| a == b)
                .count();
            // The last committed token must be fed to get logits for the next position.
            keep = keep.min(s.committed.len().saturating_sub(1));
            self.cache
                .truncate(s.cache_seq, keep)
                .map_err(specula_model::ModelError::from)?;
            s.cached.truncate(keep);
            feeds.push(s.committed[keep..].to_vec());
        }
        let max_k = requests.iter().map(|r| r.max_tokens).max().unwrap_or(0);
        for step in 0..max_k {
            let active: Vec<usize> = (0..requests.len())
                .filter(|&i| requests[i].max_tokens > step && !feeds[i].is_empty())
                .collect();
            if active.is_empty() {
                break;
            }
            let inputs: Vec<SeqInput> = active
                .iter()
                .map(|&i| SeqInput {
                    seq: self.seqs[&requests[i].seq].cache_seq,
                    tokens: &feeds[i],
                    num_logits: 1,
                })
                .collect();
            let out = self.model.forward(&mut self.cache, &inputs, &[])?;
            for (row, &i) in active.iter().enumerate() {
                let r = &mut requests[i];
                let limit = r.vocab_limit.min(out.vocab_size);
                let logits = &out.row(row, 0)[..limit];
                let q = sampling::probabilities(logits, &r.sampling)?;
                let token = if r.sampling.is_greedy() {
                    sampling::argmax(logits)?
                } else {
                    sampling::sample_from(&q, r.uniforms.next_uniform())
                };
                let s = self.seqs.get_mut(&r.seq).expect("checked above");
                s.cached.extend_from_slice(&feeds[i]);
                proposals[i].tokens.push(token);
                proposals[i].probs.as_mut().expect("set above").push(q);
                // The last draft is not fed: its logits would only matter for a draft k+1.
                feeds[i] = if step + 1 < r.max_tokens {
                    vec![token]
                } else {
                    Vec::new()
                };
            }
        }
        Ok(proposals)
    }

    fn commit(&mut self, seq: SeqKey, tokens: &[u32]) -> Result<(), DraftError> {
        self.seqs
            .get_mut(&seq)
            .ok_or(DraftError::UnknownSequence(seq))?
            .committed
            .extend_from_slice(tokens);
        Ok(())
    }
}
