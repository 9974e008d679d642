//! DSpark: a parallel block drafter (DeepSeek's DSpark, public DeepSpec reference). It conditions on
//! hidden states tapped from several target layers, proposes a whole block in one non-causal pass,
//! restores intra-block dependency with a low-rank Markov logit bias applied in a short loop on
//! logits only, and predicts per-slot acceptance with a confidence head.
//!
//! State per sequence: the context keys/values of every draft layer, one row per position the target
//! has committed to its cache. Context rows are only ever appended for committed positions, so a
//! rejection needs no rollback here: the block's own keys/values are never cached.
//!
//! Two backends run the same network: the CPU reference kernels (`model.rs`, the default) and, with
//! the crate feature `cuda`, the GPU (`gpu.rs`, [`DSparkDrafter::to_gpu`]): context K/V on the device,
//! the block pass on the device, and the Markov loop fused into one launch. Both consume the request's
//! uniforms in the same order, so given the same uniforms they propose the same tokens (up to the
//! bf16 rounding of the GPU's weights and activations, which `gpu_dspark_check` measures).

pub mod config;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod model;

pub use config::{DSparkConfig, MarkovHeadType};
pub use model::{BlockOutput, ContextCache, DSparkModel};

use crate::{DraftError, DraftProposal, DraftRequest, Drafter, SeqKey};
use specula_kernels::sampling;
use std::collections::HashMap;

/// Where a sequence's context keys/values live.
enum SeqContext {
    Cpu(ContextCache),
    /// A slot of the GPU backend's context buffers holding `len` rows.
    #[cfg(feature = "cuda")]
    Gpu {
        slot: usize,
        len: usize,
    },
}

impl SeqContext {
    fn len(&self) -> usize {
        match self {
            SeqContext::Cpu(c) => c.len(),
            #[cfg(feature = "cuda")]
            SeqContext::Gpu { len, .. } => *len,
        }
    }
}

struct SeqState {
    context: SeqContext,
    /// Tokens the engine committed; the last one (the target's newest token, the next anchor) is
    /// not in the target cache yet, so `context.len() == committed.len() - 1` before drafting.
    committed: Vec<u32>,
}

/// Which device runs the block pass and the Markov loop.
enum Backend {
    Cpu,
    #[cfg(feature = "cuda")]
    Gpu(Box<gpu::GpuDSpark>),
}

/// Per-slot details of the last proposal of a sequence (reports and tests).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SlotTrace {
    /// Pre-sigmoid confidence logits of the proposed slots (empty without a confidence head).
    pub confidence_logits: Vec<f32>,
}

pub struct DSparkDrafter {
    model: DSparkModel,
    backend: Backend,
    seqs: HashMap<SeqKey, SeqState>,
    /// Confidence-truncated drafting: stop before the first slot whose predicted acceptance
    /// (sigmoid of the confidence logit) is below this. `None` (the default, and what fixed-DL7
    /// benchmarks use) drafts every slot asked for.
    confidence_threshold: Option<f32>,
    last_trace: HashMap<SeqKey, SlotTrace>,
}

impl DSparkDrafter {
    pub fn new(model: DSparkModel) -> DSparkDrafter {
        DSparkDrafter {
            model,
            backend: Backend::Cpu,
            seqs: HashMap::new(),
            confidence_threshold: None,
            last_trace: HashMap::new(),
        }
    }

    /// Enables confidence-truncated drafting (see the field). Needs a confidence head.
    pub fn with_confidence_threshold(mut self, threshold: f32) -> Result<Self, DraftError> {
        if !self.model.config.enable_confidence_head {
            return Err(DraftError::Config(
                "confidence-truncated drafting needs a checkpoint with a confidence head".into(),
            ));
        }
        if !(0.0..=1.0).contains(&threshold) {
            return Err(DraftError::Config(format!(
                "confidence threshold must be in [0, 1], got {threshold}"
            )));
        }
        self.confidence_threshold = Some(threshold);
        Ok(self)
    }

    pub fn model(&self) -> &DSparkModel {
        &self.model
    }

    pub fn block_size(&self) -> usize {
        self.model.config.block_size
    }

    /// Context rows held for a sequence.
    pub fn context_len(&self, seq: SeqKey) -> Option<usize> {
        self.seqs.get(&seq).map(|s| s.context.len())
    }

    pub fn last_trace(&self, seq: SeqKey) -> Option<&SlotTrace> {
        self.last_trace.get(&seq)
    }

    /// Whether the block pass and Markov loop run on the GPU.
    pub fn is_gpu(&self) -> bool {
        !matches!(self.backend, Backend::Cpu)
    }

    /// The same drafter with its block pass and Markov loop on the GPU (`device`, weights uploaded
    /// from the loaded model). Must be called before any sequence is added: CPU context rows are not
    /// migrated.
    #[cfg(feature = "cuda")]
    pub fn to_gpu(
        self,
        device: std::sync::Arc<specula_kernels::cuda::GpuDevice>,
        opts: gpu::GpuDSparkOptions,
    ) -> Result<DSparkDrafter, DraftError> {
        if !self.seqs.is_empty() {
            return Err(DraftError::Config(
                "move the DSpark drafter to the GPU before adding sequences".into(),
            ));
        }
        let g = gpu::GpuDSpark::new(&self.model, device, opts)?;
        Ok(DSparkDrafter {
            backend: Backend::Gpu(Box::new(g)),
            ..self
        })
    }

    /// `to_gpu` on GPU 0, opened here; a machine without a CUDA driver gets an error (naming the CPU
    /// fallback), never a panic.
    #[cfg(feature = "cuda")]
    pub fn on_gpu(self, opts: gpu::GpuDSparkOptions) -> Result<DSparkDrafter, DraftError> {
        if !specula_kernels::cuda::driver_available() {
            return Err(DraftError::Gpu(
                specula_kernels::cuda::CudaError::NoDriver.to_string(),
            ));
        }
        let device =
            specula_kernels::cuda::GpuDevice::new(0).map_err(|e| DraftError::Gpu(e.to_string()))?;
        self.to_gpu(std::sync::Arc::new(device), opts)
    }

    /// The GPU backend, for checks that compare its intermediate outputs with the CPU's.
    #[cfg(feature = "cuda")]
    pub fn gpu(&mut self) -> Option<&mut gpu::GpuDSpark> {
        match &mut self.backend {
            Backend::Gpu(g) => Some(g),
            Backend::Cpu => None,
        }
    }

    /// Where a sequence's next block would run on the GPU backend (its context slot, context rows
    /// and anchor), for checks that drive the backend directly; `None` on the CPU.
    #[cfg(feature = "cuda")]
    pub fn gpu_block_of(&self, seq: SeqKey) -> Option<gpu::GpuBlock> {
        let s = self.seqs.get(&seq)?;
        match s.context {
            SeqContext::Gpu { slot, len } => Some(gpu::GpuBlock {
                slot,
                ctx_len: len,
                anchor: *s.committed.last()?,
            }),
            SeqContext::Cpu(_) => None,
        }
    }

    /// The CPU drafter's Markov loop over one sequence's block outputs: slot by slot, the confidence
    /// head (stopping below the threshold), the Markov bias, and the draft distribution and token
    /// under the request's sampling settings and vocabulary (uniforms drawn from the request's stream
    /// in slot order). The GPU backend's fused loop follows it step for step, and falls back to it
    /// where it cannot (confidence-truncated sampling: how many uniforms to draw depends on the
    /// outcome).
    pub fn host_markov_loop(
        model: &DSparkModel,
        threshold: Option<f32>,
        out: &BlockOutput,
        anchor: u32,
        r: &mut DraftRequest<'_>,
    ) -> Result<(DraftProposal, SlotTrace), DraftError> {
        let c = &model.config;
        let (g, h) = (c.block_size, c.hidden_size);
        let vocab = model.draft_vocab();
        let mut proposal = DraftProposal {
            tokens: Vec::new(),
            probs: Some(Vec::new()),
        };
        // Draft ids allowed under the request's vocabulary limit (all of them, in order, when
        // the draft vocabulary is the target's).
        let allowed: Option<Vec<usize>> = model.draft_to_target().map(|map| {
            (0..map.len())
                .filter(|&i| (map[i] as usize) < r.vocab_limit)
                .collect()
        });
        if allowed.as_ref().is_some_and(|a| a.is_empty()) {
            return Err(no_allowed_ids(r.vocab_limit));
        }
        let limit = r.vocab_limit.min(vocab);
        let mut prev = anchor;
        let mut trace = SlotTrace::default();
        for j in 0..r.max_tokens.min(g) {
            let e = model.markov_embedding(prev);
            let hidden = &out.hidden[j * h..(j + 1) * h];
            if let Some(cl) = model.confidence_logit(hidden, &e) {
                if let Some(threshold) = threshold {
                    if sigmoid(cl) < threshold {
                        break;
                    }
                }
                trace.confidence_logits.push(cl);
            }
            let mut logits = out.base_logits[j * vocab..(j + 1) * vocab].to_vec();
            model.add_markov_bias(&e, &mut logits);
            let (token, q) = match (&allowed, model.draft_to_target()) {
                (Some(allowed), Some(map)) => {
                    // Sample among the draft vocabulary, then place q on the target ids:
                    // target tokens outside the draft vocabulary get probability 0.
                    let sub: Vec<f32> = allowed.iter().map(|&i| logits[i]).collect();
                    let qs = sampling::probabilities(&sub, &r.sampling)?;
                    let j = if r.sampling.is_greedy() {
                        sampling::argmax(&sub)?
                    } else {
                        sampling::sample_from(&qs, r.uniforms.next_uniform())
                    } as usize;
                    let target_limit = r.vocab_limit.min(c.vocab_size);
                    let mut q = vec![0f32; target_limit];
                    for (&i, &p) in allowed.iter().zip(&qs) {
                        q[map[i] as usize] = p;
                    }
                    (map[allowed[j]], q)
                }
                _ => {
                    let logits = &logits[..limit];
                    let q = sampling::probabilities(logits, &r.sampling)?;
                    let token = if r.sampling.is_greedy() {
                        sampling::argmax(logits)?
                    } else {
                        sampling::sample_from(&q, r.uniforms.next_uniform())
                    };
                    (token, q)
                }
            };
            proposal.tokens.push(token);
            proposal.probs.as_mut().expect("set above").push(q);
            prev = token;
        }
        Ok((proposal, trace))
    }

    /// The GPU backend's proposal for the active requests (`active[i]` indexes `requests`).
    #[cfg(feature = "cuda")]
    fn propose_gpu(
        &mut self,
        requests: &mut [DraftRequest<'_>],
        active: &[usize],
        proposals: &mut [DraftProposal],
    ) -> Result<(), DraftError> {
        use specula_kernels::cuda::dspark::MarkovSeqParams;
        let Backend::Gpu(g) = &mut self.backend else {
            return Err(DraftError::Gpu("internal: not on the GPU".into()));
        };
        let model = &self.model;
        let c = &model.config;
        let block = c.block_size;
        let mut blocks = Vec::with_capacity(active.len());
        for &i in active {
            let s = &self.seqs[&requests[i].seq];
            let SeqContext::Gpu { slot, len } = s.context else {
                return Err(DraftError::Gpu(format!(
                    "sequence {} has CPU context rows on the GPU drafter",
                    requests[i].seq
                )));
            };
            blocks.push(gpu::GpuBlock {
                slot,
                ctx_len: len,
                anchor: *s.committed.last().expect("checked non-empty"),
            });
        }
        g.block_pass(&blocks)?;
        let threshold = self.confidence_threshold;
        // Confidence-truncated sampling draws a uniform only for slots that pass the threshold,
        // which the host cannot know before the loop runs: those batches take the CPU drafter's
        // loop over the GPU's block outputs, so uniform consumption stays exactly the CPU's.
        if threshold.is_some() && active.iter().any(|&i| !requests[i].sampling.is_greedy()) {
            let outputs = g.read_block_outputs()?;
            for ((&i, out), b) in active.iter().zip(&outputs).zip(&blocks) {
                let (p, trace) =
                    Self::host_markov_loop(model, threshold, out, b.anchor, &mut requests[i])?;
                proposals[i] = p;
                self.last_trace.insert(requests[i].seq, trace);
            }
            return Ok(());
        }
        let vd = model.draft_vocab();
        let mut params = Vec::with_capacity(active.len());
        let mut uniforms = vec![0f64; active.len() * block];
        for (k, (&i, b)) in active.iter().zip(&blocks).enumerate() {
            let r = &mut requests[i];
            let limit = match model.draft_to_target() {
                Some(map) => {
                    if !map.iter().any(|&t| (t as usize) < r.vocab_limit) {
                        return Err(no_allowed_ids(r.vocab_limit));
                    }
                    r.vocab_limit
                }
                None => r.vocab_limit.min(vd),
            };
            if limit == 0 {
                return Err(sampling::SamplingError::Empty.into());
            }
            let slots = r.max_tokens.min(block);
            if !r.sampling.is_greedy() {
                // One uniform per slot in slot order: exactly the draws the CPU loop makes.
                r.sampling.validate()?;
                for u in &mut uniforms[k * block..k * block + slots] {
                    *u = r.uniforms.next_uniform();
                }
            }
            params.push(MarkovSeqParams {
                anchor: b.anchor,
                slots,
                sampling: r.sampling,
                limit,
                confidence_threshold: threshold,
            });
        }
        let results = g.markov_loop(&params, &uniforms)?;
        for (&i, res) in active.iter().zip(results) {
            let res = res.map_err(|e| {
                DraftError::Gpu(format!("sequence {}: Markov loop: {e}", requests[i].seq))
            })?;
            proposals[i] = DraftProposal {
                tokens: res.tokens,
                probs: Some(res.probs),
            };
            self.last_trace.insert(
                requests[i].seq,
                SlotTrace {
                    confidence_logits: res.confidence_logits,
                },
            );
        }
        Ok(())
    }
}

fn no_allowed_ids(vocab_limit: usize) -> DraftError {
    DraftError::Config(format!(
        "no token of the pruned draft vocabulary is below the vocabulary limit {vocab_limit}"
    ))
}

impl Drafter for DSparkDrafter {
    fn name(&self) -> &str {
        match self.backend {
            Backend::Cpu => "dspark",
            #[cfg(feature = "cuda")]
            Backend::Gpu(_) => "dspark-gpu",
        }
    }

    fn tapped_target_layers(&self) -> &[usize] {
        &self.model.config.target_layer_ids
    }

    fn add_sequence(&mut self, seq: SeqKey, tokens: &[u32]) -> Result<(), DraftError> {
        if self.seqs.contains_key(&seq) {
            return Err(DraftError::DuplicateSequence(seq));
        }
        let context = match &mut self.backend {
            Backend::Cpu => SeqContext::Cpu(self.model.new_context()),
            #[cfg(feature = "cuda")]
            Backend::Gpu(g) => SeqContext::Gpu {
                slot: g.add_slot()?,
                len: 0,
            },
        };
        self.seqs.insert(
            seq,
            SeqState {
                context,
                committed: tokens.to_vec(),
            },
        );
        Ok(())
    }

    fn remove_sequence(&mut self, seq: SeqKey) -> Result<(), DraftError> {
        self.last_trace.remove(&seq);
        let s = self
            .seqs
            .remove(&seq)
            .ok_or(DraftError::UnknownSequence(seq))?;
        // A GPU sequence hands its context slot back (its rows are overwritten by the next owner).
        #[cfg(feature = "cuda")]
        if let (SeqContext::Gpu { slot, .. }, Backend::Gpu(g)) = (&s.context, &mut self.backend) {
            g.remove_slot(*slot);
        }
        drop(s);
        Ok(())
    }

    fn append_target_features(
        &mut self,
        seq: SeqKey,
        start: usize,
        features: &[f32],
    ) -> Result<(), DraftError> {
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or(DraftError::UnknownSequence(seq))?;
        if start != s.context.len() {
            return Err(DraftError::Config(format!(
                "sequence {seq}: target features start at position {start} but the drafter \
                 holds {} context rows",
                s.context.len()
            )));
        }
        match (&mut s.context, &mut self.backend) {
            (SeqContext::Cpu(ctx), _) => self.model.append_context(ctx, features),
            #[cfg(feature = "cuda")]
            (SeqContext::Gpu { slot, len }, Backend::Gpu(g)) => {
                g.append_context(*slot, *len, features)?;
                *len += features.len() / self.model.feature_width();
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (SeqContext::Gpu { .. }, Backend::Cpu) => Err(DraftError::Gpu(
                "internal: a GPU context on the CPU drafter".into(),
            )),
        }
    }

    fn propose(
        &mut self,
        requests: &mut [DraftRequest<'_>],
    ) -> Result<Vec<DraftProposal>, DraftError> {
        let mut proposals = vec![
            DraftProposal {
                tokens: Vec::new(),
                probs: Some(Vec::new()),
            };
            requests.len()
        ];
        let mut active = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            let s = self
                .seqs
                .get(&r.seq)
                .ok_or(DraftError::UnknownSequence(r.seq))?;
            if r.max_tokens == 0 {
                continue;
            }
            if s.context.len() + 1 != s.committed.len() {
                return Err(DraftError::Config(format!(
                    "sequence {}: {} committed tokens but {} context rows; the engine must pass \
                     the target's features of every committed position but the newest",
                    r.seq,
                    s.committed.len(),
                    s.context.len()
                )));
            }
            active.push(i);
        }
        #[cfg(feature = "cuda")]
        if let Backend::Gpu(_) = self.backend {
            self.propose_gpu(requests, &active, &mut proposals)?;
            return Ok(proposals);
        }
        let mut blocks: Vec<(&ContextCache, u32)> = Vec::with_capacity(active.len());
        for &i in &active {
            let s = &self.seqs[&requests[i].seq];
            match &s.context {
                SeqContext::Cpu(ctx) => {
                    blocks.push((ctx, *s.committed.last().expect("checked non-empty")))
                }
                #[cfg(feature = "cuda")]
                SeqContext::Gpu { .. } => {
                    return Err(DraftError::Gpu(
                        "internal: a GPU context on the CPU drafter".into(),
                    ))
                }
            }
        }
        let outputs = self.model.block_forward(&blocks)?;
        let anchors: Vec<u32> = blocks.iter().map(|b| b.1).collect();
        drop(blocks);
        for ((&i, out), anchor) in active.iter().zip(&outputs).zip(anchors) {
            let (p, trace) = Self::host_markov_loop(
                &self.model,
                self.confidence_threshold,
                out,
                anchor,
                &mut requests[i],
            )?;
            proposals[i] = p;
            self.last_trace.insert(requests[i].seq, trace);
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

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}
