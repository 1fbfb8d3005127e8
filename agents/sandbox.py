# agents/sandbox.py — run untrusted Python (a model's tool call) in a throwaway jail.
#
# Owns: `run_python(code)` -> `SandboxResult`, the `SandboxLimits` it runs under, and `isolation()`, which says
# what this machine enforces. Each call is one fresh process tree:
#   - resource limits (setrlimit): address space (memory), CPU seconds, processes, file size, open files, no core;
#   - a wall-clock deadline and an output cap, enforced by the caller, which kills the whole tree;
#   - with namespaces (root, Linux): new mount, PID, network, IPC and UTS namespaces; the code is chrooted into a
#     size-capped tmpfs holding read-only binds of the system libraries and this Python's install prefix, a
#     fresh /tmp (its working directory), a private /proc and four /dev nodes, and runs as a uid of its own with
#     no groups. So: no network (only a down loopback), no view of the repository, $HOME or other processes,
#     no writes outside /tmp, and the process limit counts only its own processes. When the PID namespace's
#     first process exits or is killed, the kernel kills every process left in it (a fork bomb included).
#   - without namespaces (not root, or a kernel that refuses them): the limits and the deadline only, in a fresh
#     temporary directory with a scrubbed environment; `isolation()` says so, and filesystem and network access
#     are then NOT contained.
# Never: filters code by its text, raises on bad code (every failure is a SandboxResult with `error` set), or
# leaves its temporary directory behind.
from __future__ import annotations

import ctypes
import functools
import json
import os
import resource
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass


@dataclass
class SandboxLimits:
    wall_s: float = 10.0          # wall-clock deadline for the whole call (the jail's start-up included)
    cpu_s: int = 5                # CPU seconds per process (SIGXCPU, then SIGKILL)
    memory_mb: int = 1024         # address space per process (RLIMIT_AS); Python + numpy start in ~300 MB
    processes: int = 16           # processes and threads of the sandbox's uid (RLIMIT_NPROC)
    output_bytes: int = 8192      # stdout + stderr kept; more kills the run
    disk_mb: int = 32             # largest file (RLIMIT_FSIZE) and, jailed, the size of the whole tmpfs


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None         # None when the process was killed by a signal
    error: str                    # "" on success, else why it failed (a sentence for the model to read)
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.error

    def tool_output(self, limit: int = 2000) -> str:
        """What the model sees as the tool's reply: its output, then the error (tails kept, capped)."""
        text = self.stdout + (("\n" if self.stdout and not self.stdout.endswith("\n") else "") + self.stderr
                              if self.stderr else "")
        if len(text) > limit:
            text = "..." + text[-limit:]
        if self.error:
            text = f"{text.rstrip()}\n[error] {self.error}".lstrip("\n")
        return text or "(no output)"


# ---- the jail (runs as the child process, before the code) ---------------------------------------------------

_CLONE = {"mount": 0x00020000, "uts": 0x04000000, "ipc": 0x08000000, "pid": 0x20000000, "net": 0x40000000}
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG = 1
_SYSTEM_DIRS = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]
_SYSTEM_FILES = ["/etc/ld.so.cache", "/etc/localtime", "/etc/passwd", "/etc/group"]
_DEVICES = ["/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"]
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(libc, source: str | None, target: str, fstype: str | None, flags: int, options: str | None = None) -> None:
    _check(libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                      options and options.encode()), f"mount {target}")


def _bind(libc, source: str, target: str) -> None:
    """Read-only bind of `source` at `target` (made to match: a directory or an empty file)."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(libc, source, target, None, _MS_BIND | _MS_REC)
    # a bind mount ignores MS_RDONLY on creation: it takes a remount to make it read-only
    _mount(libc, None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | (0 if source.startswith(
        "/dev/") else _MS_NODEV))


def _build_root(libc, root: str, uid: int, disk_mb: int) -> None:
    """A tmpfs at `root` with what Python needs to run, read-only, and a private writable /tmp."""
    _mount(libc, "tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={disk_mb}m,mode=0755")
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):                         # /lib -> usr/lib on merged-/usr systems
            os.symlink(os.readlink(path), root + path)
        elif os.path.isdir(path):
            _bind(libc, path, root + path)
    # the jail runs the base interpreter (the real path of sys.executable), never a virtual environment, so only the
    # base install is mounted: a venv inside the repository (launch.sh's .venv) would reveal the repository's path
    prefix = os.path.realpath(sys.base_prefix)
    if not any(prefix == d or prefix.startswith(d + "/") for d in _SYSTEM_DIRS):
        _bind(libc, prefix, root + prefix)               # e.g. a pyenv or conda install under $HOME: only it
    for path in _SYSTEM_FILES:
        if os.path.exists(path):
            _bind(libc, path, root + path)
    for path in _DEVICES:
        _bind(libc, path, root + path)
    os.makedirs(root + "/proc")
    _mount(libc, "proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    os.makedirs(root + "/tmp", mode=0o700)
    os.chown(root + "/tmp", uid, uid)


def _set_limits(limits: dict) -> None:
    mb = 1024 * 1024
    for name, value in [("RLIMIT_AS", limits["memory_mb"] * mb), ("RLIMIT_FSIZE", limits["disk_mb"] * mb),
                        ("RLIMIT_NPROC", limits["processes"]), ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0)]:
        resource.setrlimit(getattr(resource, name), (value, value))
    # the soft limit sends SIGXCPU (reported as a CPU-time error); the hard one, a second later, SIGKILL
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))


def _exit_like(status: int) -> None:
    """End this process the way the wait `status` says its child ended, so the caller sees the same."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _exec_code(spec: dict) -> None:
    """Limit, drop to the sandbox uid (jailed, as root) and become the code's Python."""
    _set_limits(spec["limits"])
    if spec["namespaces"] and os.getuid() == 0:         # root: become a uid no other process has
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    os.execve(spec["python"], [spec["python"], "-I", "main.py"], _ENV)


def _jail_main(spec_path: str) -> None:
    """The child side. Jailed, three processes: this one enters the namespaces and forks the PID namespace's
    init, which builds the root and forks the code. The code is not the init on purpose: an init ignores the
    signals it has no handler for (SIGXCPU, SIGTERM, ...), and when the init exits the kernel kills whatever
    the code left running."""
    with open(spec_path) as f:
        spec = json.load(f)
    if not spec["namespaces"]:
        with open("main.py", "w") as f:
            f.write(spec["code"])
        _exec_code(spec)
    libc = _libc()
    _check(libc.unshare(sum(_CLONE[name] for name in ("mount", "pid", "net", "ipc", "uts"))), "unshare")
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)     # nothing mounted here propagates to the host
    status_read, status_write = os.pipe()                    # the init reports the code's wait status here
    if os.fork():
        os.close(status_write)
        reported = os.read(status_read, 32)
        _, init_status = os.wait()
        _exit_like(int(reported) if reported else init_status)
    os.close(status_read)
    _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")   # the init dies with its parent
    root = spec["root"]
    _build_root(libc, root, spec["uid"], spec["limits"]["disk_mb"])
    with open(root + "/tmp/main.py", "w") as f:
        f.write(spec["code"])
    os.chroot(root)
    os.chdir("/tmp")
    code_pid = os.fork()
    if code_pid == 0:
        _exec_code(spec)                                     # the pipe's end is closed on exec
    _, status = os.waitpid(code_pid, 0)
    os.write(status_write, str(status).encode())
    os._exit(0)


# ---- the caller's side ----------------------------------------------------------------------------------------

def _probe() -> bool:
    """Whether this machine lets us build the namespace jail (root on Linux, namespaces allowed)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return False
    done = _run("print('ok')", SandboxLimits(wall_s=20.0), namespaces=True)
    return done.ok and done.stdout.strip() == "ok"


@functools.lru_cache(maxsize=1)
def _namespaces_work() -> bool:
    return _probe()


def isolation() -> str:
    """What `run_python` enforces on this machine, in words."""
    limits = "rlimits (memory, CPU time, processes, file size, open files), a wall-clock deadline, an output cap"
    if _namespaces_work():
        return (f"{limits}; mount/PID/network/IPC/UTS namespaces, a chroot into a tmpfs with read-only system "
                f"libraries and the Python prefix, a private uid: no network, no host files, no other processes")
    who = ("as root, so the process limit does not hold" if os.geteuid() == 0 else
           "as the caller's uid, whose other processes count against the process limit")
    return (f"{limits}, {who}; NOT enforced: filesystem and network isolation (Linux namespaces need root here), "
            f"so run untrusted code on a machine where they work")


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a Python program in a fresh jail; never raises for anything the code does."""
    if not isinstance(code, str):
        return SandboxResult("", "", None, f"the code must be a string, got {type(code).__name__}", 0.0)
    return _run(code, limits or SandboxLimits(), namespaces=_namespaces_work())


def _run(code: str, limits: SandboxLimits, namespaces: bool) -> SandboxResult:
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="tracerl-sandbox-")
    uid = 100_000 + secrets.randbelow(900_000)               # own uid: RLIMIT_NPROC counts only this call
    try:
        spec_path = os.path.join(workdir, "spec.json")
        root = os.path.join(workdir, "root")
        os.mkdir(root)
        with open(spec_path, "w") as f:
            json.dump({"uid": uid, "limits": asdict(limits), "code": code, "namespaces": namespaces,
                       "root": root, "python": os.path.realpath(sys.executable)}, f)
        with subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), spec_path], cwd=workdir,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True, env=_ENV) as process:
            stdout, stderr, cut = _collect(process, start + limits.wall_s, limits.output_bytes)
            _kill(process)
            exit_code = process.wait()
        return _result(stdout, stderr, exit_code, cut, limits, time.monotonic() - start)
    except OSError as exc:                                   # the jail could not start (no fork, no disk)
        return SandboxResult("", "", None, f"the sandbox could not start: {exc}", time.monotonic() - start)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(process: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, str]:
    """Read stdout and stderr until both close, the deadline passes ("timeout") or `cap` bytes ("output")."""
    chunks = {process.stdout: bytearray(), process.stderr: bytearray()}
    with selectors.DefaultSelector() as selector:
        for stream in chunks:
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(chunks[process.stdout]), bytes(chunks[process.stderr]), "timeout"
            for key, _ in selector.select(timeout=remaining):
                data = os.read(key.fd, 65536)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                chunks[key.fileobj] += data
                if sum(len(c) for c in chunks.values()) > cap:
                    return bytes(chunks[process.stdout])[:cap], bytes(chunks[process.stderr])[:cap], "output"
    # both pipes closed: the program ended (or closed them); give it until the deadline to exit
    try:
        process.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        return bytes(chunks[process.stdout]), bytes(chunks[process.stderr]), "timeout"
    return bytes(chunks[process.stdout]), bytes(chunks[process.stderr]), ""


def _kill(process: subprocess.Popen) -> None:
    """Kill the call's process group. Jailed, that takes the PID namespace's first process with it, and the
    kernel then kills everything else in the namespace (whatever process group it moved to)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _result(stdout: bytes, stderr: bytes, exit_code: int, cut: str, limits: SandboxLimits,
            seconds: float) -> SandboxResult:
    out, err = stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace")
    sig = -exit_code if exit_code < 0 else 0
    if cut == "timeout":
        error = f"timed out after {limits.wall_s:g} s of wall-clock time; the process was killed"
    elif cut == "output":
        error = f"output exceeded {limits.output_bytes} bytes; the process was killed"
    elif sig == signal.SIGXCPU:
        error = f"exceeded the CPU-time limit of {limits.cpu_s} s"
    elif "MemoryError" in err or "Cannot allocate memory" in err:
        error = f"ran out of memory (limit {limits.memory_mb} MB)"
    elif "BlockingIOError" in err or "can't start new thread" in err:
        error = f"hit the process limit ({limits.processes} processes and threads)"
    elif "File too large" in err or "No space left on device" in err or sig == signal.SIGXFSZ:
        error = f"wrote more than the disk limit of {limits.disk_mb} MB"
    elif sig:
        error = f"killed by signal {signal.Signals(sig).name}"
    elif exit_code != 0:
        last = err.strip().splitlines()[-1] if err.strip() else ""
        error = f"exited with status {exit_code}" + (f": {last}" if last else "")
    else:
        error = ""
    return SandboxResult(out, err, None if sig else exit_code, error, seconds)


if __name__ == "__main__":           # the child side: python -I -S agents/sandbox.py SPEC
    _jail_main(sys.argv[1])
