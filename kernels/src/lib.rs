//! CPU reference kernels.
