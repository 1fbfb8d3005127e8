# bench/sandbox_overhead.py — what one sandbox call costs: today's jail (bubblewrap as a host uid of its own, its
# own pid 1, a cgroup per call with the tree's CPU read every 50 ms, seccomp) against agents/sandbox.py at
# --baseline-rev (by default e144c4a: bubblewrap as root where the Python install is private, no CPU cap for the
# tree), the same code, calls run one after another, the two sides in alternating rounds so that both see the same
# load. An earlier baseline (4396417, the rlimit-only jail before bubblewrap) is one flag away.
#
# Reported per program: median seconds per call and calls per second on each side, and their ratio; also what
# today's jail costs without its cgroup (the jail an ordinary user gets). Writes a JSON summary (--out).
#
#   python bench/sandbox_overhead.py [--calls 20] [--rounds 3] [--baseline-rev e144c4a] [--out docs/sandbox-overhead.json]
import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from agents import sandbox  # noqa: E402

PROGRAMS = {"print": "print('ok')", "numpy": "import numpy\nprint(numpy.arange(10).sum())"}


def load_baseline(rev: str, folder: str):
    """The sandbox module as it was at `rev`, from git, loaded under its own name (its launcher is the file)."""
    path = os.path.join(folder, "sandbox_baseline.py")
    with open(path, "w") as f:
        f.write(subprocess.run(["git", "-C", ROOT, "show", f"{rev}:agents/sandbox.py"], check=True,
                               capture_output=True, text=True).stdout)
    spec = importlib.util.spec_from_file_location("sandbox_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module               # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def time_calls(call, code: str, calls: int) -> list[float]:
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        done = call(code)
        seconds.append(time.perf_counter() - start)
        if not done.ok:
            raise RuntimeError(f"a benchmark call failed: {done.tool_output()}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-rev", default="e144c4a")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "sandbox-overhead.json"))
    args = parser.parse_args()
    found = sandbox.isolation()
    if found.missing:
        raise SystemExit(f"today's jail is incomplete here, so the comparison would not be like for like: {found}")
    no_cgroup = sandbox.Isolation({"tree_limits": "left out by the benchmark"})
    with tempfile.TemporaryDirectory() as folder:
        baseline = load_baseline(args.baseline_rev, folder)
        sides = {"before": lambda code: baseline.run_python(code),
                 "after": lambda code: sandbox.run_python(code),
                 "after_without_cgroup": lambda code: sandbox._run(code, sandbox.SandboxLimits(), no_cgroup)}
        summary = {"baseline_rev": args.baseline_rev, "calls": args.calls, "rounds": args.rounds,
                   "cpus": os.cpu_count(), "as_root": os.geteuid() == 0, "isolation": str(found), "programs": {}}
        for name, code in PROGRAMS.items():
            seconds = {side: [] for side in sides}
            for _ in range(args.rounds):
                for side, call in sides.items():
                    seconds[side] += time_calls(call, code, args.calls)
            medians = {side: statistics.median(values) for side, values in seconds.items()}
            summary["programs"][name] = {
                **{f"{side}_s_per_call": round(median, 4) for side, median in medians.items()},
                **{f"{side}_calls_per_s": round(1 / median, 2) for side, median in medians.items()},
                "after_over_before_time": round(medians["after"] / medians["before"], 3)}
            print(name, json.dumps(summary["programs"][name]), flush=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
