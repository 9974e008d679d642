//! An independent draft model: a small transformer sharing the target's tokenizer drafts
//! autoregressively, one batched forward per draft position, with its own paged KV cache — on the
//! CPU, or (feature `cuda`, [`ModelDrafter::to_gpu`]) as a `GpuTransformer` with its device KV pool.
//! Sampling and the draft distributions stay on the host either way: each draft position's logits
//! rows come back (one readback per position), because the `Drafter` interface hands q to the
//! engine as host rows.

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

/// Where the draft model's forward and KV cache live.
enum Backend {
    Cpu(PagedKvCache),
    #[cfg(feature = "cuda")]
    Gpu(Box<specula_model::gpu::GpuTransformer>),
}

pub struct ModelDrafter {
    model: Transformer,
    backend: Backend,
    seqs: HashMap<SeqKey, SeqState>,
    /// Most input rows one forward may take (`None`: unbounded). The GPU backend's launches hold at
    /// most `GpuOptions::max_rows` rows, so a first proposal after a long prompt prefills the prompt
    /// in chunks before drafting (`prefill_to_fit`).
    max_launch_rows: Option<usize>,
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
            backend: Backend::Cpu(cache),
            seqs: HashMap::new(),
            max_launch_rows: None,
        }
    }

    /// Caps the input rows of one forward (at least 1; the GPU backend also keeps its own launch
    /// limit). Prompts longer than the cap are prefilled in chunks; the drafts do not change, since
    /// the forward is batch-invariant.
    pub fn with_max_launch_rows(mut self, rows: usize) -> ModelDrafter {
        let rows = rows.max(1);
        self.max_launch_rows = Some(self.max_launch_rows.map_or(rows, |r| r.min(rows)));
        self
    }

    /// The same drafter with its forward and cache on GPU 0 (`GpuTransformer::upload`, sized by
    /// `opts`). Must be called before any sequence is added: CPU cache rows are not migrated. A
    /// machine without a CUDA driver gets an error, never a panic.
    #[cfg(feature = "cuda")]
    pub fn to_gpu(self, opts: specula_model::gpu::GpuOptions) -> Result<ModelDrafter, DraftError> {
        if !self.seqs.is_empty() {
            return Err(DraftError::Config(
                "move the draft model to the GPU before adding sequences".into(),
            ));
        }
        if !specula_kernels::cuda::driver_available() {
            return Err(DraftError::Gpu(
                specula_kernels::cuda::CudaError::NoDriver.to_string(),
            ));
        }
        let rows = opts.max_rows;
        let gpu = specula_model::gpu::GpuTransformer::upload(&self.model, opts)
            .map_err(|e| DraftError::Gpu(format!("uploading the draft model: {e}")))?;
        Ok(ModelDrafter {
            backend: Backend::Gpu(Box::new(gpu)),
            ..self
        }
        .with_max_launch_rows(rows))
    }

    /// Whether the forward runs on the GPU.
    pub fn is_gpu(&self) -> bool {
        !matches!(self.backend, Backend::Cpu(_))
    }

    fn add_cache_sequence(&mut self) -> Result<SeqId, DraftError> {
        match &mut self.backend {
            Backend::Cpu(cache) => Ok(cache.add_sequence()),
            #[cfg(feature = "cuda")]
            Backend::Gpu(g) => Ok(g.add_sequence()? as SeqId),
        }
    }

    fn remove_cache_sequence(&mut self, seq: SeqId) -> Result<(), DraftError> {
        match &mut self.backend {
            Backend::Cpu(cache) => cache
                .remove_sequence(seq)
                .map_err(|e| specula_model::ModelError::from(e).into()),
            #[cfg(feature = "cuda")]
            Backend::Gpu(g) => Ok(g.remove_sequence(seq as usize)?),
        }
    }

    fn truncate_cache(&mut self, seq: SeqId, len: usize) -> Result<(), DraftError> {
        match &mut self.backend {
            Backend::Cpu(cache) => cache
                .truncate(seq, len)
                .map_err(|e| specula_model::ModelError::from(e).into()),
            #[cfg(feature = "cuda")]
            Backend::Gpu(g) => Ok(g.truncate(seq as usize, len)?),
        }
    }

    /// Refuses a forward over more rows than `max_launch_rows`, on either backend, so the cap holds
    /// on the CPU as it must on the GPU (the caller chunks first: `prefill_to_fit`).
    fn check_launch_rows(&self, inputs: &[(SeqId, &[u32])]) -> Result<(), DraftError> {
        let rows: usize = inputs.iter().map(|(_, t)| t.len()).sum();
        match self.max_launch_rows {
            Some(limit) if rows > limit => Err(DraftError::Config(format!(
                "internal: a draft-model forward of {rows} rows, over its limit of {limit}"
            ))),
            _ => Ok(()),
        }
    }

    /// Feeds the leading tokens of the first draft position's inputs (`feeds[i]` for the requests in
    /// `active`) in forwards of at most `max_launch_rows` rows, until the rest fits in one: each feed
    /// keeps at least its last token, whose logits the first draft needs. Without it, the first
    /// proposal after a prompt longer than the launch limit failed on the GPU (session 19: a 4000-token
    /// prompt against 512 rows per launch).
    fn prefill_to_fit(
        &mut self,
        requests: &[DraftRequest<'_>],
        active: &[usize],
        feeds: &mut [Vec<u32>],
    ) -> Result<(), DraftError> {
        let Some(limit) = self.max_launch_rows else {
            return Ok(());
        };
        loop {
            let total: usize = active.iter().map(|&i| feeds[i].len()).sum();
            if total <= limit {
                return Ok(());
            }
            let mut budget = limit;
            let mut chunks: Vec<(usize, usize)> = Vec::new();
            for &i in active {
                let take = feeds[i].len().saturating_sub(1).min(budget);
                if take > 0 {
                    chunks.push((i, take));
                    budget -= take;
                }
                if budget == 0 {
                    break;
                }
            }
            if chunks.is_empty() {
                return Err(DraftError::Config(format!(
                    "{} sequences draft at once, more than the {limit} rows one draft-model forward takes",
                    active.len()
                )));
            }
            let inputs: Vec<(SeqId, &[u32])> = chunks
                .iter()
                .map(|&(i, take)| (self.seqs[&requests[i].seq].cache_seq, &feeds[i][..take]))
                .collect();
            self.forward_rows(&inputs, 0)?;
            for &(i, take) in &chunks {
                let fed: Vec<u32> = feeds[i].drain(..take).collect();
                self.seqs
                    .get_mut(&requests[i].seq)
                    .expect("checked by the caller")
                    .cached
                    .extend_from_slice(&fed);
            }
        }
    }

    /// One forward with the last `num_logits` (0 or 1) rows' logits per input: `[inputs x num_logits,
    /// vocab]` on the host, and the vocab.
    fn forward_rows(
        &mut self,
        inputs: &[(SeqId, &[u32])],
        num_logits: usize,
    ) -> Result<(Vec<f32>, usize), DraftError> {
        self.check_launch_rows(inputs)?;
        match &mut self.backend {
            Backend::Cpu(cache) => {
                let inputs: Vec<SeqInput> = inputs
                    .iter()
                    .map(|&(seq, tokens)| SeqInput {
                        seq,
                        tokens,
                        num_logits,
                    })
                    .collect();
                let out = self.model.forward(cache, &inputs, &[])?;
                Ok((out.logits, out.vocab_size))
            }
            #[cfg(feature = "cuda")]
            Backend::Gpu(g) => {
                let out = g.forward(&gpu_rows(inputs, num_logits))?;
                Ok((out.logits, out.vocab_size))
            }
        }
    }

    /// Whether `propose` may take the device-argmax path: a GPU backend, and every request that drafts
    /// is greedy and may use every id of the draft model's vocabulary.
    fn greedy_on_device(&self, requests: &[DraftRequest<'_>]) -> bool {
        #[cfg(not(feature = "cuda"))]
        let _ = requests;
        match &self.backend {
            Backend::Cpu(_) => false,
            #[cfg(feature = "cuda")]
            Backend::Gpu(g) => {
                let vocab = g.config().vocab_size;
                requests
                    .iter()
                    .filter(|r| r.max_tokens > 0)
                    .all(|r| r.sampling.is_greedy() && r.vocab_limit >= vocab)
            }
        }
    }

    /// One forward with one logits row per input, returning each row's argmax computed on the device
    /// (GPU backend only; `greedy_on_device` decides).
    fn argmax_last_rows(&mut self, inputs: &[(SeqId, &[u32])]) -> Result<Vec<u32>, DraftError> {
        self.check_launch_rows(inputs)?;
        match &mut self.backend {
            Backend::Cpu(_) => Err(DraftError::Gpu(
                "internal: device-argmax drafting asked of the CPU backend".into(),
            )),
            #[cfg(feature = "cuda")]
            Backend::Gpu(g) => Ok(g.step_argmax(&gpu_rows(inputs, 1))?),
        }
    }

    pub fn model(&self) -> &Transformer {
        &self.model
    }

    /// The draft cache's tokens for a sequence (tests compare it with a fresh forward).
    pub fn cached_tokens(&self, seq: SeqKey) -> Option<&[u32]> {
        self.seqs.get(&seq).map(|s| s.cached.as_slice())
    }

    /// The CPU cache (`None` on the GPU).
    pub fn cache(&self) -> Option<&PagedKvCache> {
        match &self.backend {
            Backend::Cpu(cache) => Some(cache),
            #[cfg(feature = "cuda")]
            Backend::Gpu(_) => None,
        }
    }

    pub fn cache_seq(&self, seq: SeqKey) -> Option<SeqId> {
        self.seqs.get(&seq).map(|s| s.cache_seq)
    }
}

/// The GPU forward's inputs for (cache sequence, tokens) pairs, logits for the last `num_logits` rows
/// of each.
#[cfg(feature = "cuda")]
fn gpu_rows<'t>(
    inputs: &[(SeqId, &'t [u32])],
    num_logits: usize,
) -> Vec<specula_model::gpu::GpuSeqInput<'t>> {
    inputs
        .iter()
        .map(|&(seq, tokens)| specula_model::gpu::GpuSeqInput {
            seq: seq as usize,
            tokens,
            num_logits,
        })
        .collect()
}

impl Drafter for ModelDrafter {
    fn name(&self) -> &str {
        "draft_model"
    }

    fn add_sequence(&mut self, seq: SeqKey, tokens: &[u32]) -> Result<(), DraftError> {
        if self.seqs.contains_key(&seq) {
            return Err(DraftError::DuplicateSequence(seq));
        }
        let cache_seq = self.add_cache_sequence()?;
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
        self.remove_cache_sequence(s.cache_seq)
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
                .get(&r.seq)
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
            let (cache_seq, feed) = (s.cache_seq, s.committed[keep..].to_vec());
            self.truncate_cache(cache_seq, keep)?;
            self.seqs
                .get_mut(&r.seq)
                .expect("checked above")
                .cached
                .truncate(keep);
            feeds.push(feed);
        }
        let max_k = requests.iter().map(|r| r.max_tokens).max().unwrap_or(0);
        // On the GPU, when every request drafts greedily over the whole vocabulary, the draft tokens are
        // the device argmax of each row: only the ids come back (not a row of logits per draft), and no
        // distributions are returned: a greedy q is one-hot at the argmax, which is what the verifier
        // assumes without one (`DraftProbs::OneHot`), so acceptance is unchanged.
        let device_argmax = self.greedy_on_device(requests);
        if device_argmax {
            for p in &mut proposals {
                p.probs = None;
            }
        }
        for step in 0..max_k {
            let active: Vec<usize> = (0..requests.len())
                .filter(|&i| requests[i].max_tokens > step && !feeds[i].is_empty())
                .collect();
            if active.is_empty() {
                break;
            }
            if step == 0 {
                self.prefill_to_fit(requests, &active, &mut feeds)?;
            }
            let inputs: Vec<(SeqId, &[u32])> = active
                .iter()
                .map(|&i| (self.seqs[&requests[i].seq].cache_seq, feeds[i].as_slice()))
                .collect();
            if device_argmax {
                let ids = self.argmax_last_rows(&inputs)?;
                for (&id, &i) in ids.iter().zip(&active) {
                    let r = &requests[i];
                    let s = self.seqs.get_mut(&r.seq).expect("checked above");
                    s.cached.extend_from_slice(&feeds[i]);
                    proposals[i].tokens.push(id);
                    feeds[i] = if step + 1 < r.max_tokens {
                        vec![id]
                    } else {
                        Vec::new()
                    };
                }
                continue;
            }
            let (rows, vocab) = self.forward_rows(&inputs, 1)?;
            for (row, &i) in active.iter().enumerate() {
                let r = &mut requests[i];
                let limit = r.vocab_limit.min(vocab);
                let logits = &rows[row * vocab..row * vocab + limit];
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
