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
//!
//! Cooperative launches (`CU_LAUNCH_ATTRIBUTE_COOPERATIVE`, [`launch_with`]) are for persistent kernels
//! that synchronise their CTAs through global memory (the fused step, `fused_step.cu`): the driver then
//! guarantees that every CTA of the grid is resident at once, or refuses the launch, instead of
//! deadlocking a grid barrier. [`co_resident_grid`] checks the grid against the occupancy first, so the
//! error names the limit.

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
    // SAFETY: forwarded; the caller vouches for the arguments and the PDL contract.
    unsafe {
        launch_with(
            stream,
            func,
            cfg,
            args,
            LaunchOptions {
                pdl,
                cooperative: false,
            },
        )
    }
}

/// Launch attributes beyond the grid shape.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaunchOptions {
    /// Programmatic dependent launch (see the module docs).
    pub pdl: bool,
    /// All CTAs co-resident or the launch fails (`CU_LAUNCH_ATTRIBUTE_COOPERATIVE`).
    pub cooperative: bool,
}

/// [`launch`] with any combination of [`LaunchOptions`].
///
/// # Safety
/// As [`launch`]; with `cooperative` the grid must also fit on the device at once (check it with
/// [`co_resident_grid`]), or the driver refuses the launch.
pub unsafe fn launch_with(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    args: &[KernelArg],
    opts: LaunchOptions,
) -> Result<(), CudaError> {
    let mut values: Vec<u64> = args.iter().map(|a| a.0).collect();
    let mut params: Vec<*mut c_void> = values
        .iter_mut()
        .map(|v| v as *mut u64 as *mut c_void)
        .collect();
    let mut attrs: Vec<sys::CUlaunchAttribute> = Vec::with_capacity(2);
    if opts.pdl {
        // SAFETY: a zeroed attribute is a valid "ignore" value; only the fields set below are read.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        attrs.push(attr);
    }
    if opts.cooperative {
        // SAFETY: as above.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
        attr.value.cooperative = 1;
        attrs.push(attr);
    }
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: if attrs.is_empty() {
            std::ptr::null_mut()
        } else {
            attrs.as_mut_ptr()
        },
        numAttrs: attrs.len() as u32,
    };
    stream.context().bind_to_thread()?;
    // SAFETY: `params` points at `values` and `config.attrs` at `attrs`, which outlive the call; the
    // caller vouches for the rest.
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

/// The grid of a persistent kernel: `requested` CTAs (None: one per SM), checked against how many
/// fit at once (`blocks_per_sm` from the occupancy calculator, times `num_sms`). Pure arithmetic, so the
/// rule is tested without a GPU; [`co_resident_grid`] asks the driver for `blocks_per_sm`.
pub fn persistent_grid(
    requested: Option<u32>,
    num_sms: u32,
    blocks_per_sm: u32,
) -> Result<u32, String> {
    let fit = num_sms.saturating_mul(blocks_per_sm);
    let grid = requested.unwrap_or(num_sms);
    if grid == 0 {
        return Err("a persistent kernel needs at least one CTA".into());
    }
    if blocks_per_sm == 0 {
        return Err("not even one CTA fits on an SM (registers or shared memory)".into());
    }
    if grid > fit {
        return Err(format!(
            "{grid} CTAs requested but only {fit} can be resident at once ({blocks_per_sm} per SM x {num_sms} SMs)"
        ));
    }
    Ok(grid)
}

/// [`persistent_grid`] with the device's occupancy for `func` at `threads` threads and `smem` bytes
/// of dynamic shared memory per CTA.
pub fn co_resident_grid(
    func: &CudaFunction,
    requested: Option<u32>,
    num_sms: u32,
    threads: u32,
    smem: usize,
) -> Result<u32, CudaError> {
    let per_sm = func.occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)?;
    persistent_grid(requested, num_sms, per_sm).map_err(CudaError::Shape)
}

/// The cluster width `func` was compiled with (`__cluster_dims__`), 1 for a kernel without one. A
/// launch without a cluster attribute gets that width.
pub fn required_cluster_width(func: &CudaFunction) -> Result<u32, CudaError> {
    let width =
        func.get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH)?;
    Ok(width.max(1) as u32)
}

/// The grid of a persistent kernel compiled with clusters of `width` CTAs: the requested grid (one CTA
/// per SM by default) rounded down to whole clusters, and no more than the `resident` clusters that fit
/// at once (a cluster's CTAs share a GPC, so fewer may fit than the SMs' count suggests).
pub fn persistent_cluster_grid(
    requested: Option<u32>,
    num_sms: u32,
    width: u32,
    resident: u32,
) -> Result<u32, String> {
    let width = width.max(1);
    let asked = requested.unwrap_or(num_sms);
    let want = asked / width * width;
    if want == 0 {
        return Err(format!(
            "a grid of {asked} CTAs holds no whole cluster of {width}"
        ));
    }
    if resident == 0 {
        return Err(format!(
            "not even one cluster of {width} CTAs fits on the device (registers or shared memory)"
        ));
    }
    Ok(want.min(resident.saturating_mul(width)))
}

/// `co_resident_grid` for a kernel compiled with clusters of `width` CTAs (`persistent_cluster_grid`,
/// with the occupancy calculator's count of resident clusters).
pub fn co_resident_cluster_grid(
    func: &CudaFunction,
    stream: &CudaStream,
    requested: Option<u32>,
    num_sms: u32,
    threads: u32,
    smem: usize,
    width: u32,
) -> Result<u32, CudaError> {
    let want =
        persistent_cluster_grid(requested, num_sms, width, u32::MAX).map_err(CudaError::Shape)?;
    let cfg = LaunchConfig {
        grid_dim: (want, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let resident = func.occupancy_max_active_clusters(cfg, stream)?;
    persistent_cluster_grid(requested, num_sms, width, resident).map_err(CudaError::Shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_persistent_grid_must_fit_on_the_device_at_once() {
        assert_eq!(persistent_grid(None, 132, 1), Ok(132));
        assert_eq!(persistent_grid(Some(66), 132, 1), Ok(66));
        assert_eq!(persistent_grid(Some(264), 132, 2), Ok(264));
        assert!(persistent_grid(Some(133), 132, 1).is_err());
        assert!(persistent_grid(None, 132, 0).is_err());
        assert!(persistent_grid(Some(0), 132, 1).is_err());
    }

    #[test]
    fn a_cluster_grid_is_whole_clusters_that_fit_at_once() {
        assert_eq!(persistent_cluster_grid(None, 132, 2, 66), Ok(132));
        assert_eq!(persistent_cluster_grid(None, 132, 4, 33), Ok(132));
        // Fewer clusters resident than the SMs allow: the grid shrinks to what fits.
        assert_eq!(persistent_cluster_grid(None, 132, 4, 32), Ok(128));
        // A request is rounded down to whole clusters.
        assert_eq!(persistent_cluster_grid(Some(131), 132, 2, 66), Ok(130));
        assert_eq!(persistent_cluster_grid(Some(64), 132, 1, u32::MAX), Ok(64));
        assert!(persistent_cluster_grid(Some(3), 132, 4, 33).is_err());
        assert!(persistent_cluster_grid(None, 132, 2, 0).is_err());
    }

    #[test]
    fn scalar_arguments_keep_their_bits_in_the_low_bytes() {
        assert_eq!(KernelArg::i32(-1).0, 0xffff_ffff);
        assert_eq!(KernelArg::f32(1.0).0, 0x3f80_0000);
        assert_eq!(KernelArg::u64(u64::MAX).0, u64::MAX);
        assert_eq!(KernelArg::null().0, 0);
    }
}
