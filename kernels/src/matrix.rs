//! Weight matrices as the kernels consume them: row-major `[rows, cols]`, one output feature per row.

use half::bf16;

/// Storage of a weight matrix. bf16 is the default for real checkpoints (quantised GGUF weights are
/// dequantised to it at load); f32 keeps reference checkpoints exact.
#[derive(Debug, Clone)]
pub enum MatrixData {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

#[derive(Debug, Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: MatrixData,
}

impl Matrix {
    /// Panics if `data.len() != rows * cols`: shapes are validated by the loaders before this point.
    pub fn new(rows: usize, cols: usize, data: MatrixData) -> Self {
        let len = match &data {
            MatrixData::F32(v) => v.len(),
            MatrixData::Bf16(v) => v.len(),
        };
        assert_eq!(
            len,
            rows * cols,
            "matrix data length does not match its shape"
        );
        Matrix { rows, cols, data }
    }

    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        Self::new(rows, cols, MatrixData::F32(data))
    }

    /// Converts f32 values to bf16 (round to nearest even).
    pub fn from_f32_as_bf16(rows: usize, cols: usize, data: &[f32]) -> Self {
        Self::new(
            rows,
            cols,
            MatrixData::Bf16(data.iter().map(|&x| bf16::from_f32(x)).collect()),
        )
    }

    pub fn dtype_name(&self) -> &'static str {
        match self.data {
            MatrixData::F32(_) => "f32",
            MatrixData::Bf16(_) => "bf16",
        }
    }

    pub fn size_bytes(&self) -> usize {
        match &self.data {
            MatrixData::F32(v) => v.len() * 4,
            MatrixData::Bf16(v) => v.len() * 2,
        }
    }

    /// Every element as raw bf16 bits, row-major (f32 weights rounded to nearest even): the layout the
    /// GPU linear layers take.
    pub fn bf16_bits(&self) -> Vec<u16> {
        match &self.data {
            MatrixData::Bf16(v) => v.iter().map(|x| x.to_bits()).collect(),
            MatrixData::F32(v) => v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect(),
        }
    }

    /// Copies row `r` into `out` as f32 (embedding lookup).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let range = r * self.cols..(r + 1) * self.cols;
        match &self.data {
            MatrixData::F32(v) => out.copy_from_slice(&v[range]),
            MatrixData::Bf16(v) => {
                for (o, w) in out.iter_mut().zip(&v[range]) {
                    *o = w.to_f32();
                }
            }
        }
    }

    /// Stacks matrices with equal `cols` and dtype vertically (fusing Q/K/V or gate/up projections
    /// into one pass over the input). Returns None if columns or dtypes differ.
    pub fn vstack(parts: &[&Matrix]) -> Option<Matrix> {
        let cols = parts.first()?.cols;
        if parts.iter().any(|m| m.cols != cols) {
            return None;
        }
        let rows = parts.iter().map(|m| m.rows).sum();
        let data = match &parts[0].data {
            MatrixData::F32(_) => {
                let mut v = Vec::with_capacity(rows * cols);
                for m in parts {
                    match &m.data {
                        MatrixData::F32(d) => v.extend_from_slice(d),
                        MatrixData::Bf16(_) => return None,
                    }
                }
                MatrixData::F32(v)
            }
            MatrixData::Bf16(_) => {
                let mut v = Vec::with_capacity(rows * cols);
                for m in parts {
                    match &m.data {
                        MatrixData::Bf16(d) => v.extend_from_slice(d),
                        MatrixData::F32(_) => return None,
                    }
                }
                MatrixData::Bf16(v)
            }
        };
        Some(Matrix { rows, cols, data })
    }
}
