# trainer/cpu_setup.py in fresh processes (each probe is a subprocess, since both changes are process-wide and one-way):
# freed pages kept in glibc's heap, MKL's AVX-512 kernels on an AMD CPU (the same bits anywhere else), and
# TRACERL_CPU_SETUP=0 leaving a process as it comes.
import json
import os
import subprocess
import sys

import torch

from trainer import cpu_setup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_probe(code: str, switch: str | None = None) -> list[str]:
    """`code` in a new Python, with TRACERL_CPU_SETUP set to `switch` (None: unset, whatever this process has)."""
    env = {name: value for name, value in os.environ.items() if name != cpu_setup.SWITCH}
    if switch is not None:
        env[cpu_setup.SWITCH] = switch
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=True).stdout.split(maxsplit=2)


# ---- the heap --------------------------------------------------------------------------------------------------

FAULTS_PROBE = """
import resource, sys, psutil, torch
sys.path.insert(0, {root!r})
from trainer import cpu_setup
took = {setup}
rss = psutil.Process().memory_info().rss
torch.empty(16 << 20).fill_(1.0)                       # a first 64 MB tensor, freed: its pages are touched once
held = psutil.Process().memory_info().rss - rss        # what the process keeps of it once it is freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):                                    # a step's gradients and logits: allocated, filled, freed
    torch.empty(16 << 20).fill_(1.0)
print(took, held, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def heap_probe(setup: str, switch: str | None = None) -> tuple[str, int, int]:
    """(what `setup` returned, bytes of a freed 64 MB tensor the process still holds, minor faults of 20 more)."""
    took, held, faults = run_probe(FAULTS_PROBE.format(root=ROOT, setup=setup), switch)
    return took, int(held), int(faults)


def test_a_cpu_process_reuses_freed_pages_instead_of_faulting_them_in_again():
    """glibc's default maps each large allocation afresh and unmaps it on free, so each of 20 64-MB tensors faults
    its 16K pages in again (the trap, armed first); after keep_freed_memory a freed tensor's pages stay in the
    process and the next one reuses them. Measured: 327,700 faults against 16-98K (the kernel's NUMA balancing
    also faults resident pages now and then, more so on a busy machine)."""
    pages = 20 * (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    _, held, faults = heap_probe("None")
    assert held < (16 << 20) and faults >= pages // 2      # the trap: unmapped on free, faulted in again
    kept, held, reused = heap_probe("cpu_setup.keep_freed_memory()")
    assert kept == "True" and held >= (60 << 20) and reused <= faults // 2


def test_tracerl_cpu_setup_0_leaves_the_process_as_it_comes():
    """prepare_cpu_process, the call train.py, an engine actor and a trainer rank make, keeps freed pages unless
    TRACERL_CPU_SETUP=0: then it changes nothing and the process frees as one that never called it (the control,
    which the held-pages check refuses). Any other value, or none, leaves the set-up on."""
    _, plain, _ = heap_probe("None")
    assert plain < (16 << 20)                                          # the control: freed pages given back
    for switch in (None, "1"):
        _, held, _ = heap_probe("cpu_setup.prepare_cpu_process()", switch)
        assert held >= (60 << 20), switch                              # on: the freed tensor's pages kept
    took, held, _ = heap_probe("cpu_setup.prepare_cpu_process()", "0")
    assert took == "False" and held < (16 << 20)                       # off: given back, as without the call
    took, held, _ = heap_probe("cpu_setup.keep_freed_memory()", "0")   # each part reads the switch itself
    assert took == "False" and held < (16 << 20)


# ---- matrix products ---------------------------------------------------------------------------------------------

MKL_PROBE = """
import sys, torch
sys.path.insert(0, {root!r})
from trainer import cpu_setup
if {late}:                                             # a product first: MKL has chosen its kernels by now
    torch.ones(64, 64) @ torch.ones(64, 64)
took = cpu_setup.mkl_avx512_on_amd() if {call} else None
g = torch.Generator().manual_seed(0)
a, b = torch.randn(300, 576, generator=g), torch.randn(1536, 576, generator=g)
product = a @ b.T
error = (product.double() - a.double() @ b.double().T).pow(2).mean().sqrt().item()
print(took, error, product.sum(1).tolist())
"""


def test_mkl_takes_avx512_kernels_on_an_amd_cpu_and_leaves_every_other_cpu_as_it_was():
    """On an AMD CPU with AVX-512, mkl_avx512_on_amd changes the kernels MKL multiplies with: the same fp32 product
    comes out with other round-off (the trap: a call that did nothing would give the same bits), and stays as close
    to fp64 as fp32 products are (K 576: RMS error about 6e-6 with either kernel; 3e-5 would be a bf16-class loss).
    Anywhere else, once a product has run, or with TRACERL_CPU_SETUP=0, it returns False and the bits are the ones
    MKL gives without it."""
    def probe(call: bool, late: bool = False, switch: str | None = None) -> tuple[str, float, list[float]]:
        out = run_probe(MKL_PROBE.format(root=ROOT, call=call, late=late), switch)
        return out[0], float(out[1]), json.loads(out[2])
    _, error, plain = probe(False)
    took, error_after, after = probe(True)
    with open("/proc/cpuinfo") as f:
        amd_avx512 = "AuthenticAMD" in f.read(4096) and torch.backends.cpu.get_cpu_capability() == "AVX512" \
            and torch.backends.mkl.is_available()
    assert took == str(amd_avx512)
    if amd_avx512:
        assert after != plain                  # other kernels: other round-off in some of 300 row sums
    else:
        assert after == plain
    assert error < 3e-5 and error_after < 3e-5
    late_took, _, late = probe(True, late=True)
    assert late_took == "False" and late == plain      # too late: MKL keeps the kernels it chose first
    off_took, _, off = probe(True, switch="0")
    assert off_took == "False" and off == plain        # switched off: MKL chooses as it comes
