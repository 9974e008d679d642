//! Linear layers on cuBLAS: bf16 weights (row-major `[rows, cols]`, one output feature per row, the
//! same layout as `Matrix`) times bf16 activations, accumulated and written in f32.

use super::CudaError;
use cudarc::cublas::{sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

pub struct Gemm {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
}

impl Gemm {
    pub fn new(stream: Arc<CudaStream>) -> Result<Gemm, CudaError> {
        let blas = CudaBlas::new(stream.clone()).map_err(|e| CudaError::Blas(format!("{e:?}")))?;
        Ok(Gemm { blas, stream })
    }

    /// `out[t, r] = sum_c w[r, c] * x[t, c]` for `t < n`. In cuBLAS's column-major terms the weight is a
    /// `cols x rows` matrix used transposed, the activations `cols x n`, the output `rows x n`.
    #[allow(clippy::too_many_arguments)]
    pub fn linear(
        &self,
        w: &CudaSlice<u16>,
        x: &CudaSlice<u16>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        cols: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        if w.len() < rows * cols || x.len() < n * cols || out.len() < n * rows {
            return Err(CudaError::Shape(format!(
                "linear {rows}x{cols} on {n} rows: buffers of {}, {}, {} elements are too small",
                w.len(),
                x.len(),
                out.len()
            )));
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (wp, _w) = w.device_ptr(&self.stream);
        let (xp, _x) = x.device_ptr(&self.stream);
        let (op, _o) = out.device_ptr_mut(&self.stream);
        // SAFETY: the pointers are live device buffers of at least the sizes checked above, on the
        // stream the handle was created with.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                rows as i32,
                n as i32,
                cols as i32,
                &alpha as *const f32 as *const _,
                wp as *const _,
                sys::cudaDataType_t::CUDA_R_16BF,
                cols as i32,
                xp as *const _,
                sys::cudaDataType_t::CUDA_R_16BF,
                cols as i32,
                &beta as *const f32 as *const _,
                op as *mut _,
                sys::cudaDataType_t::CUDA_R_32F,
                rows as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::Blas(format!("{e:?}")))
    }
}
