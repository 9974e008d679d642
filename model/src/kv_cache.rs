//! Paged KV cache: fixed-size blocks of positions, a block table per sequence, and `truncate` to roll
//! rejected draft positions back. Values are f32 on the CPU reference path.

use specula_kernels::cpu::KvSource;
use std::collections::BTreeMap;

pub type SeqId = u64;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KvCacheError {
    #[error("unknown sequence {0}")]
    UnknownSequence(SeqId),
    #[error("KV cache full: sequence {seq} needs {needed} more blocks of {block_size} positions, {free} free of {max_blocks}")]
    OutOfBlocks {
        seq: SeqId,
        needed: usize,
        free: usize,
        block_size: usize,
        max_blocks: usize,
    },
    #[error("cannot truncate sequence {seq} to {len}: it only holds {current} positions")]
    TruncateBeyondEnd {
        seq: SeqId,
        len: usize,
        current: usize,
    },
}

#[derive(Debug, Clone)]
struct SeqEntry {
    blocks: Vec<usize>,
    len: usize,
}

#[derive(Debug, Clone)]
pub struct PagedKvCache {
    num_layers: usize,
    kv_dim: usize,
    block_size: usize,
    max_blocks: usize,
    /// Per layer: `[allocated_blocks * block_size * kv_dim]`, grown on demand up to `max_blocks`.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    allocated_blocks: usize,
    free_blocks: Vec<usize>,
    seqs: BTreeMap<SeqId, SeqEntry>,
    next_id: SeqId,
}

impl PagedKvCache {
    pub const DEFAULT_BLOCK_SIZE: usize = 16;

    /// `max_positions` bounds the memory the cache may take over all sequences together.
    pub fn new(num_layers: usize, kv_dim: usize, block_size: usize, max_positions: usize) -> Self {
        assert!(block_size > 0);
        PagedKvCache {
            num_layers,
            kv_dim,
            block_size,
            max_blocks: max_positions.div_ceil(block_size),
            keys: vec![Vec::new(); num_layers],
            values: vec![Vec::new(); num_layers],
            allocated_blocks: 0,
            free_blocks: Vec::new(),
            seqs: BTreeMap::new(),
            next_id: 0,
        }
    }

    pub fn add_sequence(&mut self) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(
            id,
            SeqEntry {
                blocks: Vec::new(),
                len: 0,
            },
        );
        id
    }

    /// Drops a sequence and returns its blocks to the pool.
    pub fn remove_sequence(&mut self, seq: SeqId) -> Result<(), KvCacheError> {
        let e = self
            .seqs
            .remove(&seq)
            .ok_or(KvCacheError::UnknownSequence(seq))?;
        self.free_blocks.extend(e.blocks);
        Ok(())
    }

    pub fn len(&self, seq: SeqId) -> Result<usize, KvCacheError> {
        self.seqs
            .get(&seq)
            .map(|e| e.len)
            .ok_or(KvCacheError::UnknownSequence(seq))
    }

    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks currently owned by sequences.
    pub fn used_blocks(&self) -> usize {
        self.allocated_blocks - self.free_blocks.len()
    }

    /// Rolls `seq` back to its first `len` positions (rejected draft tokens), freeing whole blocks.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<(), KvCacheError> {
        let e = self
            .seqs
            .get_mut(&seq)
            .ok_or(KvCacheError::UnknownSequence(seq))?;
        if len > e.len {
            return Err(KvCacheError::TruncateBeyondEnd {
                seq,
                len,
                current: e.len,
            });
        }
        e.len = len;
        let keep = len.div_ceil(self.block_size);
        self.free_blocks.extend(e.blocks.drain(keep..));
        Ok(())
    }

    /// Makes room for `seq` to hold `new_len` positions and sets its length to `new_len`; the caller
    /// then writes positions `old_len..new_len` in every layer. Fails without changing anything if
    /// the pool is exhausted.
    pub fn grow(&mut self, seq: SeqId, new_len: usize) -> Result<(), KvCacheError> {
        let bs = self.block_size;
        let e = self
            .seqs
            .get(&seq)
            .ok_or(KvCacheError::UnknownSequence(seq))?;
        let needed = new_len.div_ceil(bs).saturating_sub(e.blocks.len());
        let available = self.free_blocks.len() + (self.max_blocks - self.allocated_blocks);
        if needed > available {
            return Err(KvCacheError::OutOfBlocks {
                seq,
                needed,
                free: available,
                block_size: bs,
                max_blocks: self.max_blocks,
            });
        }
        let mut new_blocks = Vec::with_capacity(needed);
        for _ in 0..needed {
            let b = match self.free_blocks.pop() {
                Some(b) => b,
                None => {
                    let b = self.allocated_blocks;
                    self.allocated_blocks += 1;
                    let size = self.allocated_blocks * bs * self.kv_dim;
                    for l in 0..self.num_layers {
                        self.keys[l].resize(size, 0.0);
                        self.values[l].resize(size, 0.0);
                    }
                    b
                }
            };
            new_blocks.push(b);
        }
        let e = self.seqs.get_mut(&seq).expect("checked above");
        e.blocks.extend(new_blocks);
        e.len = e.len.max(new_len);
        Ok(())
    }

    fn offset(&self, e: &SeqEntry, pos: usize) -> usize {
        (e.blocks[pos / self.block_size] * self.block_size + pos % self.block_size) * self.kv_dim
    }

    /// Writes the key and value (all KV heads) of `pos`, which must be below the sequence's length.
    pub fn write(
        &mut self,
        layer: usize,
        seq: SeqId,
        pos: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KvCacheError> {
        let e = self
            .seqs
            .get(&seq)
            .ok_or(KvCacheError::UnknownSequence(seq))?;
        assert!(pos < e.len, "write past the grown length");
        let o = self.offset(e, pos);
        self.keys[layer][o..o + self.kv_dim].copy_from_slice(k);
        self.values[layer][o..o + self.kv_dim].copy_from_slice(v);
        Ok(())
    }

    /// Read view of one layer of one sequence, for attention.
    pub fn view(&self, layer: usize, seq: SeqId) -> Result<KvView<'_>, KvCacheError> {
        let e = self
            .seqs
            .get(&seq)
            .ok_or(KvCacheError::UnknownSequence(seq))?;
        Ok(KvView {
            keys: &self.keys[layer],
            values: &self.values[layer],
            blocks: &e.blocks,
            len: e.len,
            block_size: self.block_size,
            kv_dim: self.kv_dim,
        })
    }

    /// Keys and values of positions `0..len` of one layer, contiguous (tests and debugging).
    pub fn gather(&self, layer: usize, seq: SeqId) -> Result<(Vec<f32>, Vec<f32>), KvCacheError> {
        let view = self.view(layer, seq)?;
        let mut k = Vec::with_capacity(view.len * self.kv_dim);
        let mut v = Vec::with_capacity(view.len * self.kv_dim);
        for p in 0..view.len {
            k.extend_from_slice(view.key(p));
            v.extend_from_slice(view.value(p));
        }
        Ok((k, v))
    }
}

pub struct KvView<'a> {
    keys: &'a [f32],
    values: &'a [f32],
    blocks: &'a [usize],
    len: usize,
    block_size: usize,
    kv_dim: usize,
}

impl KvView<'_> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn offset(&self, pos: usize) -> usize {
        debug_assert!(pos < self.len);
        (self.blocks[pos / self.block_size] * self.block_size + pos % self.block_size) * self.kv_dim
    }
}

impl KvSource for KvView<'_> {
    fn key(&self, pos: usize) -> &[f32] {
        let o = self.offset(pos);
        &self.keys[o..o + self.kv_dim]
    }
    fn value(&self, pos: usize) -> &[f32] {
        let o = self.offset(pos);
        &self.values[o..o + self.kv_dim]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncate_frees_blocks_and_reuse_keeps_other_sequences_intact() {
        let mut c = PagedKvCache::new(1, 2, 4, 64);
        let a = c.add_sequence();
        let b = c.add_sequence();
        c.grow(a, 10).unwrap();
        for p in 0..10 {
            c.write(0, a, p, &[p as f32, 0.5], &[-(p as f32), 1.0])
                .unwrap();
        }
        c.grow(b, 3).unwrap();
        for p in 0..3 {
            c.write(0, b, p, &[100.0 + p as f32, 0.0], &[0.0, 0.0])
                .unwrap();
        }
        assert_eq!(c.used_blocks(), 4);
        c.truncate(a, 5).unwrap();
        assert_eq!(c.used_blocks(), 3);
        c.grow(a, 12).unwrap();
        for p in 5..12 {
            c.write(0, a, p, &[p as f32 + 0.25, 0.5], &[0.0, 0.0])
                .unwrap();
        }
        let (k, _) = c.gather(0, a).unwrap();
        assert_eq!(k[8], 4.0); // position 4 survived the truncation
        assert_eq!(k[10], 5.25); // position 5 was rewritten
        let (kb, _) = c.gather(0, b).unwrap();
        assert_eq!(kb, vec![100.0, 0.0, 101.0, 0.0, 102.0, 0.0]);
        assert!(matches!(
            c.truncate(a, 13),
            Err(KvCacheError::TruncateBeyondEnd { .. })
        ));
    }

    #[test]
    fn exhaustion_is_an_error_not_a_panic() {
        let mut c = PagedKvCache::new(2, 4, 4, 8);
        let a = c.add_sequence();
        assert!(matches!(
            c.grow(a, 9),
            Err(KvCacheError::OutOfBlocks { .. })
        ));
        assert_eq!(c.len(a).unwrap(), 0);
        c.grow(a, 8).unwrap();
        c.remove_sequence(a).unwrap();
        let b = c.add_sequence();
        c.grow(b, 8).unwrap();
        assert!(c.len(a).is_err());
    }
}
