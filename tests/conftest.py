# Test set-up shared by every test file: the repo root on sys.path, offline hubs, one intra-op thread; import_vllm
# and import_peer, how a test that needs vLLM or a peer's loss code gets it; the tiny model folders the trainer's
# tests share (qwen3_dir, moe_dir); and the order of the files on the suite's two workers (the longest first).
import importlib
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch  # noqa: E402

# Tiny models on a 2-core machine: extra intra-op threads only add spin-wait (a first forward took 2.6 s
# with 2 threads and 0.04 s with 1 while another process was busy).
torch.set_num_threads(1)

# The fp32 kernels a CPU run of train.py multiplies with (on an AMD CPU with AVX-512, MKL's AVX-512 ones, unless
# TRACERL_CPU_SETUP=0), chosen before this process's first product, so the parity tests check the numbers training
# works with.
from trainer import cpu_setup  # noqa: E402

cpu_setup.mkl_avx512_on_amd()

import models  # noqa: E402


def import_vllm():
    """vLLM, for a test that needs it: a skip where it is not installed, but a failure under TRACERL_REQUIRE_VLLM
    (./launch.sh test installs vLLM, so in CI a missing vLLM is a broken setup, not a reason to skip)."""
    if os.environ.get("TRACERL_REQUIRE_VLLM"):
        return importlib.import_module("vllm")
    return pytest.importorskip("vllm")


PEERS = os.path.join(ROOT, ".peers")   # requirements-peers.txt, installed there by ./launch.sh test


def import_peer(module: str):
    """A module of a peer framework's own code (verl, OpenRLHF: requirements-peers.txt), for an oracle test: .peers
    goes to the END of sys.path, so the environment's packages always win. A skip where it is not installed, but a
    failure under TRACERL_REQUIRE_PEERS (./launch.sh test installs it, so in CI it is a broken setup)."""
    if not os.path.isdir(PEERS) and not os.environ.get("TRACERL_REQUIRE_PEERS"):
        pytest.skip("the peers' loss code is not installed: ./launch.sh setup test puts requirements-peers.txt in .peers")
    if PEERS not in sys.path:
        sys.path.append(PEERS)
    return importlib.import_module(module)


@pytest.fixture(scope="module")
def qwen3_dir() -> str:
    """A tiny dense Qwen3 folder (models.tiny_model_dir, made once per machine)."""
    return models.tiny_model_dir("qwen3")


@pytest.fixture
def closed_sessions(monkeypatch) -> list:
    """Every ChatSession a LoopbackServer closes during the test, in order (a runner's server closes each episode's
    when it ends): what a harness test reads the session's lines and record from."""
    import loopback
    sessions, close = [], loopback.LoopbackServer.close_session
    monkeypatch.setattr(loopback.LoopbackServer, "close_session",
                        lambda server, session_id: sessions.append(close(server, session_id)) or sessions[-1])
    return sessions


@pytest.fixture(scope="module")
def moe_dir() -> str:
    """A tiny Qwen3-MoE folder (the R3 tests' policy)."""
    return models.tiny_model_dir("qwen3_moe")


# ---- the order of the files: the longest first ------------------------------------------------------------------
# ./launch.sh test runs the files on two workers, a whole file at a time each (pytest-xdist's loadfile), in the
# order collected here: the files that take minutes go first, so that neither worker is left alone with one at
# the end. test_recipes.py waits for the harness models test_harnesses.py teaches (models._cached_folder's lock),
# so it comes after the others that take minutes. Every other file keeps its place after these, by name.
LONGEST_FIRST = ["test_harnesses.py", "test_runtime.py", "test_vllm_engine.py", "test_process.py", "test_actor.py",
                 "test_train.py", "test_lora.py", "test_compat.py", "test_critic.py", "test_viewer.py",
                 "test_agents.py", "test_recipes.py", "test_sandbox.py", "test_slurm.py"]


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))     # stable: a file's own order is kept
