# agents/process.py — agents as processes: a rollout may be any program (another interpreter with its own packages,
# a CLI harness, a program in another language) that talks to its loopback session over HTTP.
#
# Owns: `ProcessAgent` (a ChatAgent that runs one program per rollout), `Workspace` (its two directories),
# `ProcessRun` (what the program did), `ProcessFailure` (a failed rollout and the reason it is counted under),
# `reward_from_stdout` (the output convention), and the launcher (this file run as `python -I -S agents/process.py
# SPEC`), the process between the caller and the program that holds the program's whole process tree.
# One rollout, run by ChatAgentRunner against its own loopback session:
#   - a fresh directory holds `work/` (the program's cwd: the recipe's `prepare` fills it from the task, its `grade`
#     reads what the program left there) and `home/` (its HOME and TMPDIR); all of it is removed afterwards, by
#     coreutils' rm (any depth, no link followed), whatever the program left;
#   - the program starts with stdin at /dev/null and an environment built from nothing: the session's URL and key
#     in the variables the stock SDKs read (OPENAI_BASE_URL, OPENAI_API_BASE (litellm's older name), OPENAI_API_KEY,
#     ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY), the model name in TRACERL_MODEL, and what the recipe's `environment`
#     adds. The caller's own variables (its API keys, tokens, proxies) never reach it unless the recipe names them;
#   - the tails of its stdout and stderr are kept (`output_bytes` each; the rest is read and dropped);
#   - at its deadline (`timeout_s`), or when the runner cancels the rollout, the whole tree gets SIGTERM and, after
#     a grace of GRACE_S, SIGKILL; when the program exits, whatever it left running is SIGKILLed. The launcher holds
#     the tree two ways: it is a child subreaper (PR_SET_CHILD_SUBREAPER: a descendant orphaned by a double fork or
#     a setsid is reparented to it, so it stays a descendant, and it kills every descendant it finds in /proc until
#     none is left), and where namespaces work (root on Linux) it is the parent of a PID namespace whose first
#     process dies with it, the kernel then killing every process in the namespace;
#   - the reward comes from the program's last stdout line, a JSON object {"reward": r, "score": s, "info": {...}}
#     (the default `grade`; score and info optional), or from the recipe's `grade` over what is left in `work/`.
#   - jail = True runs the program in the python sandbox's jail (agents/sandbox.py, bubblewrap): a read-only tmpfs
#     root with the system libraries, the Python prefix and the recipe's `jail_binds` ({path in the jail: host path},
#     so a venv is seen at a path of the recipe's choosing, never the checkout's) read-only, its two directories and
#     /tmp writable (handed to the jail's uid; as root, all three on one tmpfs of JAIL_DISK_MB, so every byte and
#     file it writes counts against one cap), a host uid of its own (never root's), its own user, mount, PID, IPC, UTS,
#     cgroup and network namespaces, the sandbox's seccomp filter and a cgroup capping the whole tree
#     (JAIL_MEMORY_MB, JAIL_PROCESSES). Its network holds only its own loopback, where the jail's pid 1
#     (agents/jail_init.py) listens on the session's port and relays each connection through a Unix socket bound in
#     from the host to this process's SessionRelay, which forwards it to the session's server: the program reaches
#     its session's server and nothing else (no other listener on the host, no outside address), and the server's
#     keys keep it to its own session. Where a protection is missing and not accepted (sandbox.refusal), a jailed
#     rollout is refused, never run unjailed.
# Keeps invariant 1 by construction: the program's tokens are its session's (loopback.py); nothing here sees ids.
# Never: passes the caller's environment through, leaves a process or a directory behind, or lets a failing program
# fail more than its own rollout (a ProcessFailure names the reason ChatAgentRunner counts it under).
from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from urllib.parse import urlsplit

if __name__ == "__main__":       # the launcher: -I -S put neither the repository nor site-packages on its path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import sandbox               # the standard library only, like this launcher
else:
    from agents import sandbox

GRACE_S = 2.0                    # between SIGTERM and SIGKILL for a tree stopped at its deadline
JAIL_PROCESSES = 512             # a jailed program's whole tree (its cgroup): room for a harness, not a fork bomb
JAIL_MEMORY_MB = 4096            # a jailed program's whole tree (its cgroup): a harness, litellm and its tools
JAIL_DISK_MB = 64                # all a jailed program writes (work/, home/, /tmp: one tmpfs), and its largest file
JAIL_FILES = 16_384              # the files and folders it may make there (each costs kernel memory, no bytes)
_MNT_DETACH = 2
_PR_SET_CHILD_SUBREAPER, _PR_SET_PDEATHSIG = 36, 1
_CLONE_NEWPID = 0x20000000
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# ---- the launcher (its own process: python -I -S agents/process.py SPEC) ------------------------------------------

def _pid_namespace() -> bool:
    """Whether an unjailed program gets a PID namespace of its own here (unshare needs root)."""
    return sys.platform == "linux" and os.geteuid() == 0


class _Stop(Exception):
    """A stop signal reached the launcher: the deadline passed, the rollout was cancelled, or the caller died."""


def _on_stop(signum, frame):
    for sig in _STOP_SIGNALS:    # one stop is enough: the tree is being taken down
        signal.signal(sig, signal.SIG_IGN)
    raise _Stop()


def _grace(seconds: float) -> None:
    """SIGTERM the whole tree, then give it `seconds` to end by itself."""
    sandbox.signal_each(sandbox.descendants(os.getpid()), signal.SIGTERM)
    end = time.monotonic() + seconds
    while sandbox.reap_children() and time.monotonic() < end:
        time.sleep(0.02)


def _exec_program(spec: dict, report_fd: int) -> None:
    """The program's side of the fork: default signals, its cwd, (jailed) its uid and limits, then exec."""
    try:
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)          # an ignored signal would stay ignored across exec
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        sandbox.check_call(sandbox.libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
        os.chdir(spec["cwd"])
        if spec["jail"] is not None:                    # become bwrap, which runs the program in its jail
            import resource
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            disk = spec["jail"]["disk_mb"] << 20
            resource.setrlimit(resource.RLIMIT_FSIZE, (disk, disk))
            sandbox.exec_jail(sandbox.JailSpec(**spec["jail"]), spec["argv"], spec["cwd"], spec["env"])
        os.execvpe(spec["argv"][0], spec["argv"], spec["env"])   # the report pipe closes on exec (O_CLOEXEC)
    except BaseException as exc:
        os.write(report_fd, f"spawn {type(exc).__name__}: {exc}\n".encode())
    os._exit(127)


def _namespace_init(spec: dict, report_fd: int) -> None:
    """Process 1 of the new PID namespace (unjailed runs; a jailed one gets bwrap's): a mount namespace of its own
    with a /proc of the namespace, then the program as its child; it reaps orphans until the program ends, reports
    the program's wait status and exits, and the kernel kills whatever else is left in the namespace."""
    try:
        libc, check_call = sandbox.libc(), sandbox.check_call
        check_call(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")   # dies with the launcher
        sandbox.private_mount_namespace()                                             # nothing here reaches the host
        check_call(libc.mount(b"proc", b"/proc", b"proc", 0, None), "mount /proc")    # this namespace's processes
        program = os.fork()
        if program == 0:
            _exec_program(spec, report_fd)
        while True:
            pid, status = os.wait()
            if pid == program:
                break
        os.write(report_fd, f"status {status}\n".encode())
    except BaseException as exc:
        os.write(report_fd, f"spawn {type(exc).__name__}: {exc}\n".encode())
    os._exit(0)


def _start_and_wait(spec: dict) -> dict:
    """Fork the program (or the namespace's init) and wait for it, reaping orphans meanwhile."""
    libc, check_call = sandbox.libc(), sandbox.check_call
    check_call(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl")
    if spec["namespaces"]:
        check_call(libc.unshare(_CLONE_NEWPID), "unshare")         # the next child is the namespace's pid 1
    read_end, write_end = os.pipe()
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)     # a stop must not reach the child before its exec
    first = os.fork()
    if first == 0:
        os.close(read_end)
        (_namespace_init if spec["namespaces"] else _exec_program)(spec, write_end)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    os.close(write_end)
    while True:
        pid, status = os.wait()
        if pid == first:
            break
    with os.fdopen(read_end) as f:
        lines = f.read().splitlines()
    spawn = [line[6:] for line in lines if line.startswith("spawn ")]
    if spawn:
        return {"spawn_error": spawn[0]}
    reported = [int(line[7:]) for line in lines if line.startswith("status ")]
    if spec["namespaces"] and not reported:
        return {"spawn_error": f"the namespace's first process ended without a report (wait status {status})"}
    return {"wait_status": reported[0] if reported else status}


def _launch(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _on_stop)
    report = {"wait_status": None, "spawn_error": "", "stopped": False}
    try:
        sandbox.check_call(sandbox.libc().prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0), "prctl")
        if spec["jail"] is not None:
            sandbox.enter_call(spec["procs_files"])             # its cgroup and a fresh session keyring
        report.update(_start_and_wait(spec))
    except _Stop:
        report["stopped"] = True
        _grace(spec["grace_s"])
    except OSError as exc:
        report["spawn_error"] = f"the launcher could not start the program: {exc}"
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    sandbox.kill_tree()          # what the program left running, or what the grace did not end
    with open(spec["report"], "w") as f:
        json.dump(report, f)
    os._exit(0)


if __name__ == "__main__":       # the launcher ends here; what follows is the caller's side
    _launch(sys.argv[1])


# ---- the caller's side: one rollout is one program ----------------------------------------------------------------

from agents import ChatAgent, ChatContext, Result  # noqa: E402  (after the launcher, which must not import them)
from agents.graders import AgentFileError, parse_agent_json  # noqa: E402


class ProcessFailure(Exception):
    """A process rollout that failed. `reason` is the counter ChatAgentRunner adds it to: process_spawn (it could
    not start), process_exit (non-zero status or a signal), process_timeout (killed at its deadline),
    process_reward (no reward in its output), process_grade (a grader refused what the program left)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass
class Workspace:
    work: str                    # the program's cwd: prepared from the task, graded after the program exits
    home: str                    # its HOME and TMPDIR: config files, caches, a harness's own logs


@dataclass
class ProcessRun:
    stdout: str                  # the last `output_bytes` it wrote to stdout (decoded, invalid bytes replaced)
    stderr: str                  # the same for stderr
    exit_code: int               # 0, or a status accepts_exit took (any other fails the rollout before `grade`)
    seconds: float               # wall-clock time from start to the end of its whole tree
    dropped_bytes: int           # output beyond the tails, read and dropped


_REWARD_KEYS = {"reward", "score", "info"}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def reward_from_stdout(stdout: str) -> Result:
    """The output convention: the last non-empty stdout line is a JSON object {"reward": <number>, "score":
    <number>, "info": {<name>: <number>}}, score and info optional. Raises ProcessFailure("process_reward")."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    expected = 'its last stdout line must be a JSON object like {"reward": 1.0, "score": 1.0, "info": {"steps": 3}}'
    if not lines:
        raise ProcessFailure("process_reward", f"the program printed nothing; {expected}")
    try:
        value = parse_agent_json(lines[-1], "its last stdout line")
    except AgentFileError as exc:
        raise ProcessFailure("process_reward", f"{exc}; {expected}") from None
    except ValueError:
        raise ProcessFailure("process_reward", f"its last stdout line is not JSON: {lines[-1][:200]!r}; "
                                               f"{expected}") from None
    info = value.get("info", {}) if isinstance(value, dict) else None
    if not (isinstance(value, dict) and _number(value.get("reward")) and set(value) <= _REWARD_KEYS
            and (value.get("score") is None or _number(value["score"])) and isinstance(info, dict)
            and all(isinstance(k, str) and _number(v) for k, v in info.items())):
        raise ProcessFailure("process_reward", f"its last stdout line is {lines[-1][:200]!r}; {expected} (keys "
                                               f"{sorted(_REWARD_KEYS)} only, numbers for values)")
    score = value.get("score")
    return Result(reward=float(value["reward"]), score=None if score is None else float(score),
                  info={k: float(v) for k, v in info.items()})


class ProcessAgent(ChatAgent):
    """One rollout = one program. Subclass, name the program in `command`, and export a ChatAgentRunner with
    `agent_cls = YourAgent` as the recipe's AgentRunner:

        class Echo(ProcessAgent):
            def command(self, ctx, ws):
                return ["node", "agent.js", ctx.prompt]     # it prints {"reward": ...} as its last line

    prepare(ctx, ws) fills ws.work from the task; environment(ctx, ws) adds variables (a host variable reaches the
    program only if named here, e.g. {"HF_TOKEN": os.environ["HF_TOKEN"]}); grade(ctx, ws, run) turns what the
    program left behind (ws.work, its output) into the Result. Keep `timeout_s` below the runner's budget
    (--rollout.step_timeout_s x max_turns), or the runner's own deadline ends the rollout first (counted as
    agent_timeout; the tree is cleaned up all the same)."""

    timeout_s: float = 60.0                  # the program's wall-clock deadline, its whole tree's
    output_bytes: int = 1 << 20              # the tail of stdout, and of stderr, that is kept
    jail: bool = False                       # run inside the python sandbox's jail (header)
    jail_binds: dict[str, str] = {}          # {path in the jail: host path} the jailed program reads (a venv)

    def command(self, ctx: ChatContext, ws: Workspace) -> list[str]:
        raise NotImplementedError("a ProcessAgent must implement command(ctx, ws) -> argv (a list of strings)")

    def prepare(self, ctx: ChatContext, ws: Workspace) -> None:
        """Fill ws.work from the task (a repository, input files). Nothing by default."""

    def environment(self, ctx: ChatContext, ws: Workspace) -> dict[str, str]:
        """Variables beyond the session's (header). None by default."""
        return {}

    def accepts_exit(self, run: ProcessRun) -> bool:
        """Whether a program that exited with a non-zero status still ended its episode, to be graded like one that
        exited 0 (a harness that stops when the model's reply was cut at max_tokens). No by default: the rollout
        fails, counted as process_exit. A program killed by a signal always fails."""
        return False

    def grade(self, ctx: ChatContext, ws: Workspace, run: ProcessRun) -> Result:
        """The Result of a program that exited 0 (or whose exit accepts_exit took). By default its last stdout line
        (reward_from_stdout)."""
        return reward_from_stdout(run.stdout)

    async def run(self, ctx: ChatContext) -> Result:
        top = tempfile.mkdtemp(prefix="tracerl-process-")
        try:
            place = _jail_files(top) if self.jail else top
            ws = Workspace(os.path.join(place, "work"), os.path.join(place, "home"))
            os.mkdir(ws.work)
            os.mkdir(ws.home)
            self.prepare(ctx, ws)
            run = await self._run_program(ctx, ws, top)
            return await asyncio.to_thread(self.grade, ctx, ws, run)   # a grader may take seconds (a sandbox run)
        finally:
            _remove(top)

    def _environment(self, ctx: ChatContext, ws: Workspace) -> dict[str, str]:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": ws.home, "TMPDIR": ws.home, "LANG": "C.UTF-8",
               "OPENAI_BASE_URL": ctx.base_url, "OPENAI_API_BASE": ctx.base_url, "OPENAI_API_KEY": ctx.api_key,
               "ANTHROPIC_BASE_URL": ctx.session_url, "ANTHROPIC_API_KEY": ctx.api_key,
               "TRACERL_MODEL": ctx.model_name}
        env.update(self.environment(ctx, ws))
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise TypeError(f"{type(self).__name__}.environment must return str -> str, got {env!r}")
        return env

    def _spec(self, ctx: ChatContext, ws: Workspace, top: str) -> tuple[dict, sandbox.TreeCgroup | None,
                                                                          SessionRelay | None]:
        jail, cgroup, relay = None, None, None
        if self.jail:
            found = sandbox.isolation()
            if refused := sandbox.refusal(found):
                raise ProcessFailure("process_spawn", f"the recipe asks for the jail: {refused}")
            # the jail's only route out: its session's server, through a relay at the same port on its own loopback
            server = urlsplit(ctx.session_url)
            relay = SessionRelay(os.path.join(top, "session.sock"), server.hostname, server.port)
            origin, local = f"{server.scheme}://{server.netloc}", f"http://127.0.0.1:{server.port}"
            ctx = replace(ctx, base_url=ctx.base_url.replace(origin, local, 1),
                          session_url=ctx.session_url.replace(origin, local, 1))
            uid = 100_000 + secrets.randbelow(900_000)
            # its /tmp on the same tmpfs as work/ and home/ where there is one, bound first: they are bound inside it
            place = os.path.dirname(ws.work)
            writable = {**({"/tmp": os.path.join(place, "tmp")} if os.path.ismount(place) else {}),
                        ws.work: ws.work, ws.home: ws.home}
            jail = sandbox.JailSpec(uid, os.geteuid() == 0, sandbox.bwrap_path(), JAIL_DISK_MB, JAIL_PROCESSES,
                                    sandbox.write_seccomp_filter(top) if "syscall_filter" not in found.missing else "",
                                    {inside: os.path.realpath(host) for inside, host in self.jail_binds.items()},
                                    writable, {"socket": relay.path, "port": server.port})
            if "tree_limits" not in found.missing:
                cgroup = sandbox.TreeCgroup.create(sandbox.SandboxLimits(memory_mb=JAIL_MEMORY_MB),
                                                   processes=JAIL_PROCESSES)
        argv = self.command(ctx, ws)
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise TypeError(f"{type(self).__name__}.command must return a non-empty list of strings, got {argv!r}")
        return {"argv": argv, "env": self._environment(ctx, ws), "cwd": ws.work,
                "namespaces": jail is None and _pid_namespace(), "jail": None if jail is None else asdict(jail),
                "procs_files": cgroup.procs_files if cgroup else [], "grace_s": GRACE_S,
                "report": os.path.join(top, "report.json")}, cgroup, relay

    async def _run_program(self, ctx: ChatContext, ws: Workspace, top: str) -> ProcessRun:
        spec, cgroup, relay = self._spec(ctx, ws, top)
        try:
            if relay is not None:
                await relay.start()
                if spec["jail"]["drop_uid"]:              # the jail's own uid writes its directories
                    _give(spec["jail"]["uid"], [*spec["jail"]["writable"].values(), relay.path])
            return await self._launch(spec, top)
        finally:                                  # a jailed tree's every process, wherever it went
            if relay is not None:
                await relay.close()
            if cgroup is not None:
                cgroup.kill()
                cgroup.remove()

    async def _launch(self, spec: dict, top: str) -> ProcessRun:
        spec_path = os.path.join(top, "launch.json")         # beside work/ and home/, never inside the jail
        with open(os.open(spec_path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            json.dump(spec, f)
        start = time.monotonic()
        try:
            launcher = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", os.path.abspath(__file__), spec_path, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True, env={})
        except OSError as exc:
            raise ProcessFailure("process_spawn", f"the launcher could not start: {exc}") from None
        out, err = _Tail(self.output_bytes), _Tail(self.output_bytes)
        readers = [asyncio.ensure_future(out.drain(launcher.stdout)), asyncio.ensure_future(err.drain(launcher.stderr))]
        timed_out = False
        try:
            await asyncio.wait_for(launcher.wait(), self.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:                                  # the deadline, a cancelled rollout, or a normal end
            await _stop(launcher)
            _, pending = await asyncio.wait(readers, timeout=5.0)   # the tree is gone, so the pipes close
            for reader in pending:
                reader.cancel()
        seconds = time.monotonic() - start
        try:
            with open(spec["report"]) as f:
                report = json.load(f)
        except (OSError, ValueError):
            raise ProcessFailure("process_spawn", f"the launcher ended (status {launcher.returncode}) without a "
                                                  f"report: {_last_line(err.text())}") from None
        if timed_out or report["stopped"]:
            raise ProcessFailure("process_timeout", f"still running after {self.timeout_s:g} s; its whole process "
                                                    f"tree was killed")
        if report["spawn_error"]:
            raise ProcessFailure("process_spawn", f"{spec['argv'][0]!r} could not start: {report['spawn_error']}")
        code = os.waitstatus_to_exitcode(report["wait_status"])
        if spec["jail"] is not None and code > 128:           # bwrap reports a program killed by signal N as 128 + N
            code = 128 - code
        run = ProcessRun(out.text(), err.text(), code, seconds, out.dropped + err.dropped)
        if code < 0 or (code > 0 and not self.accepts_exit(run)):
            how = f"was killed by {sandbox.signal_name(-code)}" if code < 0 else f"exited with status {code}"
            # a program that reports its errors on stdout (a harness's JSON events) says why there, not on stderr
            raise ProcessFailure("process_exit", f"{spec['argv'][0]!r} {how}: {_last_line(run.stderr)} "
                                                 f"(last stdout line: {_last_line(run.stdout)})")
        return run


class SessionRelay:
    """The host's end of a jailed program's only route out: a Unix socket, bound into the jail, where
    agents/jail_init.py forwards every connection the program makes to 127.0.0.1:<the session's port>; each is
    forwarded on to the session's server. So the jail reaches that server and nothing else on the host or beyond,
    and the server's keys keep it to its own session (opening one takes an admin key the program never holds)."""

    def __init__(self, path: str, host: str, port: int):
        self.path, self.host, self.port = path, host, port
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._forward, self.path)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, upstream}
        await asyncio.gather(_pipe(reader, upstream), _pipe(upstream_reader, writer))
        self._writers -= {writer, upstream}

    async def close(self) -> None:
        """Stop accepting and end every connection still open (the program is gone)."""
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:                               # either end went away
        pass
    finally:
        writer.close()


def _give(uid: int, paths: list[str]) -> None:
    """Hand `paths` (and everything below them) to the jail's uid, so the program writes where the recipe put it."""
    for path in paths:
        os.lchown(path, uid, uid)
        for folder, dirs, files in os.walk(path):
            for name in dirs + files:
                os.lchown(os.path.join(folder, name), uid, uid)


class _Tail:
    """The last `cap` bytes of a stream; the rest is read (so the writer never blocks) and counted."""

    def __init__(self, cap: int):
        self.cap, self.kept, self.dropped = cap, bytearray(), 0

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            self.kept += chunk
            if len(self.kept) > self.cap:
                self.dropped += len(self.kept) - self.cap
                del self.kept[:len(self.kept) - self.cap]

    def text(self) -> str:
        return self.kept.decode("utf-8", "replace")


async def _stop(launcher: asyncio.subprocess.Process) -> None:
    """Ask the launcher to take the tree down (SIGTERM, grace, SIGKILL); kill it if it does not end in time."""
    if launcher.returncode is not None:
        return
    try:
        launcher.send_signal(signal.SIGTERM)
        await asyncio.wait_for(launcher.wait(), GRACE_S + 10.0)
    except ProcessLookupError:
        pass
    except asyncio.TimeoutError:              # a launcher that hangs: its PID namespace dies with it
        launcher.kill()
    await launcher.wait()


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:500] if lines else "(none)"


def _jail_files(top: str) -> str:
    """The folder a jailed rollout's work/, home/ and /tmp live in: a tmpfs of JAIL_DISK_MB and JAIL_FILES mounted on
    top/files, so every byte and file the jail writes counts against one cap (sparse files cost only the pages
    written; a hard link can name only a file of the same tmpfs), and the grader reads it after the jail is gone.
    Mounting takes root; elsewhere it is `top` itself, on the host's disk, and RLIMIT_FSIZE caps each file alone."""
    place = os.path.join(top, "files")
    os.mkdir(place)
    options = f"size={JAIL_DISK_MB}m,nr_inodes={JAIL_FILES},mode=0755".encode()
    if sandbox.libc().mount(b"tmpfs", place.encode(), b"tmpfs", 2 | 4, options) != 0:   # MS_NOSUID | MS_NODEV
        os.rmdir(place)
        return top
    os.mkdir(os.path.join(place, "tmp"), 0o700)
    return place


def _remove(top: str) -> None:
    """Remove a rollout's directory, whatever the program left there: its tmpfs is detached (its pages go with its
    last user), then coreutils' rm, which walks any depth without recursion and follows no link; where a folder the
    program made unreadable stops it (not root), chmod -R, which follows no link either, opens the tree first."""
    files = os.path.join(top, "files")
    if os.path.ismount(files):
        sandbox.libc().umount2(files.encode(), _MNT_DETACH)     # a failure leaves `top` behind, reported below
    for command in (["rm", "-rf", "--", top], ["chmod", "-R", "u+rwx", "--", top], ["rm", "-rf", "--", top]):
        if not os.path.lexists(top):
            return
        subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if os.path.lexists(top):                  # fails the rollout, counted and logged, rather than pass unseen
        raise OSError(f"the rollout's directory {top} could not be removed")
