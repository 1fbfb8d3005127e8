# trainer/cpu_setup.py — what a process that trains or samples on a CPU changes in itself before its first model loads:
# glibc's heap keeps the pages it frees, and MKL multiplies with its AVX-512 kernels on an AMD CPU that has them.
#
# Owns: `prepare_cpu_process`, called where such a process starts (train.py's main on a machine without a GPU, and
# the async runtime's engine actor and trainer rank on a CPU: runtime.embedded_engine, runtime.TrainerRank), and
# its two parts, each process-wide:
#   keep_freed_memory - glibc's mallopt: no mmap for large allocations, one arena, a 2 GiB trim threshold. By
#     default each allocation over the dynamic mmap threshold (a step's gradients, the [V, H] tied-embedding
#     gradient, logits) is a fresh mmap and each free unmaps it, so every step faults those pages in anew: ~500K
#     minor faults and ~30% of a 135M model's CPU train step (2 cores). Kept in the heap, the next step reuses them
#     (peak RSS measured unchanged: 4.8 GB).
#   mkl_avx512_on_amd - writes 1 into MKL's cached answer to "an Intel CPU?", in this process's memory, before the
#     first product. MKL (linked into torch's x86 wheels, where it runs fp32 products) picks its kernels by the
#     CPU's vendor before its features: on an AMD CPU its AVX2 ones even where the CPU has AVX-512 (Zen 4, 5), at
#     half the fp32 GEMM rate (2-core Zen 5: 210 against 460 GFLOP/s at [1000, 576] x [576, 1536]). Told "Intel", it
#     chooses by the features, as on an Intel CPU that has them.
# Neither changes what a run computes beyond fp32 round-off (RMS error against fp64 at K 576: 7.3e-6 with the
# AVX-512 kernels, 6.0e-6 with the AVX2 ones), for the engine and the trainer alike.
#
# Off: TRACERL_CPU_SETUP=0 in the environment leaves the allocator and MKL as they come (each part returns False);
# runtime.connect hands the variable to Ray's workers, so engine actors and trainer ranks choose as the driver does.
# What would make it unsafe:
#   - the heap: freed memory that others on the machine need back (up to 2 GiB of it stays in each process, and
#     without mmap one live block at the top of the heap pins every free page below it), or many threads allocating
#     at once (one arena, one lock);
#   - MKL: an MKL that reads its "Intel" answer for more than choosing kernels by the CPU's features (an Intel-only
#     path taken on trust would run on an AMD CPU: a crash on an unknown instruction, or other numbers). The function
#     that caches the answer is matched byte for byte against the code this was written for and left alone when it
#     differs, but a match shows the same code, not the same use of its answer. The write must come before any
#     thread's first MKL call (each part runs first thing, before a model loads), and a run compared bit for bit
#     with one that did not take it differs in round-off.
# Never: changes MKL's kernels once it has chosen them; a process that computes on a GPU does not call it.
from __future__ import annotations

import ctypes
import os
import platform

import torch

SWITCH = "TRACERL_CPU_SETUP"       # "0": this process's allocator and MKL as they come


def switched_off() -> bool:
    """True when the environment says TRACERL_CPU_SETUP=0."""
    return os.environ.get(SWITCH) == "0"


# ---- the heap: freed pages kept for the next step ----------------------------------------------------------------

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8   # glibc's mallopt parameters (malloc.h)
HEAP_KEPT_BYTES = 2**31 - 1       # the largest trim threshold mallopt takes (an int)


def keep_freed_memory() -> bool:
    """Makes glibc malloc keep freed memory for reuse in this process (call it before the first model loads).
    False where the C library is not glibc (macOS, musl), or when switched off: the allocator is then left as it is."""
    if switched_off():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:            # no mallopt in this process's C library
        return False
    return all(mallopt(param, value) == 1 for param, value in
               ((M_MMAP_MAX, 0), (M_ARENA_MAX, 1), (M_TRIM_THRESHOLD, HEAP_KEPT_BYTES)))


# ---- matrix products: MKL's AVX-512 kernels on an AMD CPU that has AVX-512 ----------------------------------------

# MKL keeps its answer to "an Intel CPU?" in a static int beside mkl_serv_intel_cpu_true (-1 until asked), read by
# the function's first instruction; the kernels are chosen at the first product, by that answer and the features.
INTEL_CPU_CACHE_LOAD = b"\x8b\x05"          # mov eax, [rip + disp32]: the function's first instruction reads its cache
INTEL_CPU_CACHE_TEST = b"\x85\xc0\x78"      # test eax, eax; js: computed only while the cache is negative


def mkl_avx512_on_amd() -> bool:
    """Makes MKL take its AVX-512 kernels on an AMD CPU with AVX-512, before the process's first product. True if it
    did; False elsewhere, when switched off, once MKL has chosen, or where mkl_serv_intel_cpu_true is not the code it
    was written for."""
    if switched_off() or platform.system() != "Linux" or platform.machine() != "x86_64" \
            or not torch.backends.mkl.is_available() or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    with open("/proc/cpuinfo") as f:
        if "AuthenticAMD" not in f.read(4096):
            return False
    try:
        torch_cpu = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"),
                                mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        function = ctypes.cast(torch_cpu.mkl_serv_intel_cpu_true, ctypes.c_void_p).value
    except (OSError, AttributeError):     # another build of torch: no MKL symbols to find
        return False
    code = ctypes.string_at(function, 9)
    if code[:2] != INTEL_CPU_CACHE_LOAD or code[6:] != INTEL_CPU_CACHE_TEST:
        return False
    cached = ctypes.c_int.from_address(function + 6 + int.from_bytes(code[2:6], "little", signed=True))
    if cached.value >= 0:                 # MKL has asked already, and chosen its kernels by the answer
        return False
    cached.value = 1
    return True


# ---- the process ---------------------------------------------------------------------------------------------------

def prepare_cpu_process() -> bool:
    """Before a CPU process's first model loads: keep_freed_memory, then mkl_avx512_on_amd (whose answer it returns).
    With TRACERL_CPU_SETUP=0, neither."""
    keep_freed_memory()
    return mkl_avx512_on_amd()
