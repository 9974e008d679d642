#!/usr/bin/env python3
"""Compiles candidate fused-step sources with NVRTC (from the nvidia-cuda-nvrtc wheel) the way the host
does (kernels/cuda/decoder.cu first, then the candidate, for sm_90), and prints each one's verdict, so a
candidate is known to compile before it is carried to a device call.

Usage: experiments/fused/nvrtc_check.py [--resources] [--sass DIR] CANDIDATE.cu [...]
  --resources  ptxas's registers, stack and spills for the v2 kernels and their non-inlined functions
               (spills in the kernel cost attgrp's first build 2.5% at 1 x 1: NOTES v0.28)
  --sass DIR   also writes each candidate's SASS to DIR/NAME.sass (needs nvdisasm from the
               nvidia-cuda-nvdisasm wheel: pip install "nvidia-cuda-nvdisasm>=13,<14")
  --lineinfo   with --sass: compiles with line info and has nvdisasm print each instruction's source
               line (the candidate's own line numbers), to tell which code a local-memory access is in"""
import argparse, ctypes, glob, os, subprocess, sys
import nvidia


def find(pattern):
    return next((p for b in nvidia.__path__ for p in glob.glob(os.path.join(b, "**", pattern), recursive=True)), None)


ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--resources", action="store_true")
ap.add_argument("--sass")
ap.add_argument("--lineinfo", action="store_true")
ap.add_argument("sources", nargs="+")
args = ap.parse_args()
nv = ctypes.CDLL(find("libnvrtc.so*"))
nvdisasm = find("nvdisasm") if args.sass else None
if args.sass and not nvdisasm:
    sys.exit("--sass: no nvdisasm (pip install 'nvidia-cuda-nvdisasm>=13,<14')")
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
decoder = open(os.path.join(root, "kernels", "cuda", "decoder.cu")).read()
status = 0
for path in args.sources:
    # The #line directive keeps the candidate's own line numbers in --lineinfo's output.
    src = (decoder + f'\n#line 1 "{os.path.basename(path)}"\n' + open(path).read()).encode()
    prog = ctypes.c_void_p()
    assert nv.nvrtcCreateProgram(ctypes.byref(prog), src, path.encode(), 0, None, None) == 0
    # The options kernels/src/cuda/mod.rs compile_uncached gives NVRTC (through cudarc's CompileOptions).
    opts = [b"--ftz=false", b"--prec-sqrt=true", b"--prec-div=true", b"--gpu-architecture=sm_90"]
    if args.resources:
        opts.append(b"--ptxas-options=-v")
    if args.lineinfo:
        opts.append(b"--generate-line-info")
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
    if rc != 0:
        continue
    if args.resources:
        # ptxas prints "Function properties for NAME", then its stack/spill line, then (kernels only) registers.
        lines, keep = text.splitlines(), False
        for line in lines:
            if "Function properties for" in line:
                name = line.split("for", 1)[1].strip()
                keep = "v2" in name or "fv2_" in name
                if keep:
                    print(f"  {name}")
            elif keep and ("spill" in line or "registers" in line):
                print("    " + line.replace("ptxas info    :", "").replace("ptxas         .", "").strip())
    if args.sass:
        nv.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        cubin = ctypes.create_string_buffer(n.value)
        nv.nvrtcGetCUBIN(prog, cubin)
        os.makedirs(args.sass, exist_ok=True)
        base = os.path.join(args.sass, os.path.basename(path).removesuffix(".cu"))
        open(base + ".cubin", "wb").write(cubin.raw)
        with open(base + ".sass", "w") as f:
            subprocess.run([nvdisasm] + (["--print-line-info"] if args.lineinfo else []) + [base + ".cubin"],
                           stdout=f, check=True)
        print(f"  SASS: {base}.sass")
sys.exit(status)
