//! Kernel launches with programmatic dependent launch (PDL, sm_90+).
//!
//! A decode step is ~150 small kernels in a row. Between two ordinary launches the GPU drains the first
//! kernel completely, then ramps the next one up from nothing: at decode sizes that gap (tail + launch +
//! the first loads' latency) is as long as the useful work of a 10 MB weight matrix. A kernel launched
//! with `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION` may start as soon as every block of the
//! kernel before it has executed `griddepcontrol.launch_dependents`; it then does whatever does not
//! depend on that kernel (loading its first weight tiles) and blocks in `griddepcontrol.wait` until the
//! previous kernel has completed and its writes are visible. CUDA-graph capture keeps these edges.
//!
//! The contract every kernel launched this way keeps (decoder.cu, `SPECULA_PDL_*`):
//! - nothing written by an earlier kernel is read, and nothing is written at all, before `pdl_wait()`;
//! - at least one thread of every block executes `pdl_wait()` (so a kernel's completion implies its
//!   predecessor's, and the chain stays ordered for kernels further down the stream);
//! - `pdl_launch_dependents()` comes after `pdl_wait()`, so at most two kernels are in flight at once.
//!
//! Kernels that are not PDL-aware (cuBLAS, memsets) are launched normally and act as full barriers.

use cudarc::driver::{sys, CudaFunction, CudaStream, DevicePtr, LaunchConfig};
use std::ffi::c_void;

use super::CudaError;

/// One kernel argument, stored by value in 8 bytes (the driver reads as many bytes as the parameter
/// has: 4 for `int`/`float`, 8 for pointers and 64-bit integers; little-endian, so the low bytes).
#[derive(Debug, Clone, Copy)]
pub struct KernelArg(u64);

impl KernelArg {
    /// A device buffer (its address on `stream`). Event tracking is off in `GpuDevice`, so taking
    /// the address records nothing.
    pub fn buf<T, P: DevicePtr<T>>(p: &P, stream: &CudaStream) -> KernelArg {
        let (ptr, _sync) = p.device_ptr(stream);
        KernelArg(ptr)
    }

    /// A null pointer (optional inputs).
    pub fn null() -> KernelArg {
        KernelArg(0)
    }

    pub fn i32(v: i32) -> KernelArg {
        KernelArg(v as u32 as u64)
    }

    pub fn f32(v: f32) -> KernelArg {
        KernelArg(v.to_bits() as u64)
    }

    pub fn u64(v: u64) -> KernelArg {
        KernelArg(v)
    }
}

/// Launches `func` on `stream` with `args` (in the kernel's parameter order); with `pdl` the launch
/// may overlap the previous kernel on the stream as described in the module docs.
///
/// # Safety
/// `args` must match the kernel's signature (count, order, sizes), every buffer must be live and large
/// enough for what the kernel touches with this configuration, and with `pdl` the kernel must keep the
/// PDL contract above.
pub unsafe fn launch(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    args: &[KernelArg],
    pdl: bool,
) -> Result<(), CudaError> {
    let mut values: Vec<u64> = args.iter().map(|a| a.0).collect();
    let mut params: Vec<*mut c_void> = values
        .iter_mut()
        .map(|v| v as *mut u64 as *mut c_void)
        .collect();
    // SAFETY: a zeroed attribute is a valid "ignore" value; only the fields set below are read.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: if pdl { &mut attr } else { std::ptr::null_mut() },
        numAttrs: u32::from(pdl),
    };
    stream.context().bind_to_thread()?;
    // SAFETY: `params` points at `values`, which outlive the call; the caller vouches for the rest.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()?;
    }
    Ok(())
}

/// Whether programmatic dependent launch is used on this device: compute capability 9.0 or newer and
/// `SPECULA_PDL=1`. Off by default: on the H200 it did not shorten the graph-replayed llama3.2-1b step
/// (NOTES.md v0.5: 1.753 ms with, 1.716 ms without at 1 x 8 tokens), so it stays opt-in until a kernel
/// sequence shows a gain.
pub fn pdl_supported(major: i32) -> bool {
    major >= 9 && std::env::var("SPECULA_PDL").is_ok_and(|v| v == "1")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalar_arguments_keep_their_bits_in_the_low_bytes() {
        assert_eq!(KernelArg::i32(-1).0, 0xffff_ffff);
        assert_eq!(KernelArg::f32(1.0).0, 0x3f80_0000);
        assert_eq!(KernelArg::u64(u64::MAX).0, u64::MAX);
        assert_eq!(KernelArg::null().0, 0);
    }
}
