#!/usr/bin/env python3
"""Compiles candidate fused-step sources with NVRTC (from the nvidia-cuda-nvrtc wheel) the way the host
does (kernels/cuda/decoder.cu first, then the candidate, for sm_90), and prints each one's verdict, so a
candidate is known to compile before it is carried to a device call.
Usage: experiments/fused/nvrtc_check.py CANDIDATE.cu [...]"""
import ctypes, glob, os, sys
import nvidia

lib = next(p for b in nvidia.__path__ for p in glob.glob(os.path.join(b, "**", "libnvrtc.so*"), recursive=True))
nv = ctypes.CDLL(lib)
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
decoder = open(os.path.join(root, "kernels", "cuda", "decoder.cu")).read()
status = 0
for path in sys.argv[1:]:
    src = (decoder + "\n" + open(path).read()).encode()
    prog = ctypes.c_void_p()
    assert nv.nvrtcCreateProgram(ctypes.byref(prog), src, path.encode(), 0, None, None) == 0
    # The options kernels/src/cuda/mod.rs compile_uncached gives NVRTC (through cudarc's CompileOptions).
    opts = [b"--ftz=false", b"--prec-sqrt=true", b"--prec-div=true", b"--gpu-architecture=sm_90"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nv.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace").strip()
    # The log (warnings included) only for a failure: the shipped source has known warnings.
    print(f"{path}: {'ok' if rc == 0 else 'FAILED'}" + (f"\n{text}" if rc != 0 and text else ""))
    status |= rc != 0
sys.exit(status)
