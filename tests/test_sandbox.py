# The python tool's sandbox, attacked the way a model's code could attack it: every escape (an infinite loop, a
# fork bomb, a memory bomb, an output flood, writes outside its directory, reads of the repository and $HOME,
# the network, a detached process) ends as a clear error in a SandboxResult, and the caller goes on. Each
# attack is a real subprocess on this machine; the jailed ones need Linux namespaces (root) and are skipped,
# with the reason, where they are not available.
import glob
import os
import socket
import tempfile
import threading
import time

import pytest

from agents import sandbox
from agents.sandbox import SandboxLimits, run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = SandboxLimits(wall_s=5.0, cpu_s=2)
jailed = pytest.mark.skipif(not sandbox._namespaces_work(), reason="Linux namespaces need root on this machine")


def live_uids() -> set[int]:
    """Real uids of every process on the machine (from /proc)."""
    uids = set()
    for status in glob.glob("/proc/[0-9]*/status"):
        try:
            with open(status) as f:
                uids.add(int(next(x for x in f if x.startswith("Uid:")).split()[1]))
        except (OSError, StopIteration):
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
def test_a_fork_bomb_hits_the_process_limit_and_leaves_nothing_running():
    before = live_uids()
    done = run_python("import os\nwhile True:\n    os.fork()", FAST)
    assert done.error == "hit the process limit (16 processes and threads)", done.error
    # the patient variant retries forever instead of crashing: the deadline ends it
    done = run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", FAST)
    assert done.error.startswith("timed out")
    time.sleep(0.5)
    assert not {uid for uid in live_uids() - before if uid >= 100_000}, "sandbox processes outlived the call"


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
    # only the Python install itself is mounted (read-only) when it lives under $HOME
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


def test_the_temporary_directory_is_removed():
    pattern = os.path.join(tempfile.gettempdir(), "tracerl-sandbox-*")
    before = set(glob.glob(pattern))
    for code in ("open('left.txt', 'w').write('x' * 1000)", "import time\ntime.sleep(30)"):
        run_python(code, SandboxLimits(wall_s=2.0))
    assert set(glob.glob(pattern)) == before


def test_the_caller_goes_on_after_every_escape_and_isolation_says_what_holds():
    for code in ("while True: pass", "x = ' ' * 10 ** 10", "import os; os.kill(os.getpid(), 9)", 42):
        assert not run_python(code, FAST).ok
    assert run_python("print('still here')").stdout == "still here\n"
    if sandbox._namespaces_work():
        assert "no network, no host files" in sandbox.isolation()
    else:
        assert "NOT enforced" in sandbox.isolation()


@pytest.mark.parametrize("code, error", [
    ("while True:\n    pass", "exceeded the CPU-time limit of 1 s"),
    ("x = bytearray(4 * 1024 ** 3)", "ran out of memory (limit 1024 MB)"),
    ("while True:\n    print('x' * 1000)", "output exceeded 8192 bytes; the process was killed"),
])
def test_without_namespaces_the_limits_still_hold(code, error):
    """The fallback of a machine without namespaces: no jail, but the same limits, deadline and output cap."""
    done = sandbox._run(code, SandboxLimits(wall_s=30.0, cpu_s=1), namespaces=False)
    assert done.error == error
