//! CUDA-graph capture shared by the GPU forward (`specula-model`) and the GPU DSpark drafter: both
//! record a step's launches once per launch shape and replay them.

use super::CudaError;
use cudarc::driver::{sys, CudaGraph, CudaStream};
use std::sync::Arc;

/// A captured graph owned by one GPU object. cudarc leaves `CudaGraph` `!Send` because graph objects
/// must not be used from two threads at once; moving one to another thread with its owner is fine
/// (every launch binds the context to the calling thread first), so an owner holding these stays `Send`
/// (a drafter or an engine thread may own it) but must not be `Sync`.
pub struct OwnedGraph(pub CudaGraph);

// SAFETY: see above: only ownership moves between threads; `OwnedGraph` is not `Sync`, so no two
// threads can reach the same graph at once.
unsafe impl Send for OwnedGraph {}

/// Records the launches `record` queues on `stream` into a graph (nothing runs during capture) and
/// uploads it, so the first replay pays no setup. `record`'s own error wins over the capture's.
/// Capture needs the context's event tracking off (`GpuDevice` does that).
pub fn capture_graph<E: From<CudaError>>(
    stream: &Arc<CudaStream>,
    record: impl FnOnce() -> Result<(), E>,
) -> Result<OwnedGraph, E> {
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| E::from(e.into()))?;
    let recorded = record();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    recorded?;
    let graph = graph.map_err(|e| E::from(e.into()))?.ok_or_else(|| {
        E::from(CudaError::Shape(
            "CUDA graph capture produced no graph".into(),
        ))
    })?;
    graph.upload().map_err(|e| E::from(e.into()))?;
    Ok(OwnedGraph(graph))
}
