#!/usr/bin/env bash
# The whole test suite: every crate's tests, with the CUDA backend compiled in (cudarc loads CUDA
# dynamically, so no toolkit or GPU is needed) and its kernels compiled by NVRTC for sm_90 and sm_103a.
# NVRTC comes from the nvidia-cuda-nvrtc Python package.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check "nvidia-cuda-nvrtc>=13,<14" 2>&1 | grep -v "Running pip as the 'root' user" || true
nvrtc_lib=$(python3 - <<'PY'
import glob, os, sys
try:
    import nvidia
except ImportError:
    sys.exit(0)
for base in nvidia.__path__:
    for lib in glob.glob(os.path.join(base, "cu*", "lib", "libnvrtc.so*")):
        print(os.path.dirname(lib))
        sys.exit(0)
PY
)
if [[ -n "$nvrtc_lib" ]]; then
  export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# The feature flags compile every GPU code path (kernels, the GPU forward, the GPU check binaries).
cargo test --workspace --locked --features specula-kernels/cuda,specula-model/cuda,specula-experiments/cuda "$@"
