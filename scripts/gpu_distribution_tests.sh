#!/usr/bin/env bash
# Runs the GPU sampling checks (experiments/src/bin/gpu_sampling_check.rs) on the lent GPU machine and
# writes the log to $OUT/gpu_sampling_h200.txt: Philox known answers, logits processing vs the CPU,
# verify decisions vs the CPU verifier with the same uniforms, chi-square distribution tests of every
# acceptance rule against the verifier's exact outcome distributions, synthetic AL, and kernel timings.
#
# The GPU machine has no cargo: build here, then carry the stripped binary (.carry/ is gitignored).
#   cargo build --release -p specula-experiments --features cuda --bin gpu_sampling_check
#   mkdir -p .carry/bin
#   cp target/release/gpu_sampling_check .carry/bin/ && strip .carry/bin/gpu_sampling_check
#   cp scripts/gpu_distribution_tests.sh .carry/bin/          # only needed while the script is not on main
#   echo "$(git rev-parse HEAD)$(git diff --quiet HEAD || echo +dirty)" > .carry/bin/gpu_sampling_check.rev
# and with the device tool:
#   run(command="bash .carry/bin/gpu_distribution_tests.sh", carry=[".carry/bin"], timeout_s=600)
# The log comes back under the returned files_at; commit it as experiments/results/gpu_sampling_h200.txt.
set -euo pipefail
here=$(pwd)
bin=${GPU_SAMPLING_BIN:-$here/.carry/bin/gpu_sampling_check}
out=${OUT:-/tmp/gpu_sampling_out}
mkdir -p "$out"
log="$out/gpu_sampling_h200.txt"

# cudarc loads libnvrtc at run time: take it from the CUDA toolkit or the nvidia-cuda-nvrtc wheel.
nvrtc_dir=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then nvrtc_dir=$d; break; fi
done
if [[ -z "$nvrtc_dir" ]]; then
  nvrtc_dir=$(python3 - <<'PY' || true
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
fi
if [[ -n "$nvrtc_dir" ]]; then
  export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

rev=$(cat "$bin.rev" 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "unknown GPU")
{
  echo "# gpu_sampling_check, $(date -u +%Y-%m-%dT%H:%M:%SZ), GPU: $gpu, git $rev"
  echo "# NVRTC from ${nvrtc_dir:-the default library path}; command: scripts/gpu_distribution_tests.sh"
  set +e
  timeout 540 "$bin"
  status=$?
  set -e
  echo "# exit status $status"
  exit $status
} 2>&1 | tee "$log"
