# Agents as processes (agents/process.py), with real programs over real loopback HTTP: a program sees its session
# in the stock SDKs' variables, its own cwd and none of the host's secrets; every sampled token of its session is
# trainable exactly once; after every rollout (success, failure, timeout, cancellation) no process of its tree is
# left, a double-forked setsid daemon and a program that ignores SIGTERM included, in both tree-holding modes (PID
# namespace, subreaper), and its directory is gone; failures are counted by reason; the reward comes from stdout
# or from the recipe's grader. Real harnesses run unchanged: mini-swe-agent (the swe_fix recipe's agent, on a tiny
# Qwen3 taught its format, several turns) and the `openai` package's own command line from another interpreter
# with its own packages (openai 2.34, the last release with the CLI, in a virtual environment of its own).
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from urllib.parse import urlsplit

import pytest

import data
import models
from agents import ChatAgentRunner, Result, graders, process, sandbox
from agents.process import GRACE_S, ProcessAgent, ProcessFailure, reward_from_stdout
from engines import SamplingParams
from invariants import check_sampled_once
from recipes import swe_fix
from recipes.code_exec import run_hidden_tests
from rollout import EmbeddedEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
jailed = pytest.mark.skipif(bool(sandbox.refusal()), reason=f"the jail is incomplete here: {sandbox.refusal()}")
SEEN: dict[str, dict] = {}          # prompt -> what a test agent saw (its workspace, its probe, its run)


# ---- set-up: the swe_fix recipe's taught model behind a real engine; a runner per test --------------------------

@pytest.fixture(scope="module")
def policy():
    path = swe_fix.taught_model()
    return EmbeddedEngine(models.load_model(path)), models.load_tokenizer(path)


AGENT_SAMPLING = SamplingParams(max_tokens=8, seed=0)


def run_agents(policy, agent_cls, prompts: list[str], max_turns: int = 1, step_timeout_s: float = 60.0,
               sampling: SamplingParams = AGENT_SAMPLING):
    engine, tokenizer = policy
    runner = type("Runner", (ChatAgentRunner,), {"agent_cls": agent_cls})(
        engine, tokenizer, max_turns=max_turns, max_length=2048, step_timeout_s=step_timeout_s)
    try:
        tasks = [data.Task(f"t{i}", [{"role": "user", "content": p}], label="") for i, p in enumerate(prompts)]
        return runner.run(tasks, [f"g{i}" for i in range(len(tasks))], sampling), runner.failures
    finally:
        runner.server.stop()


def processes_holding(needle: str) -> list[int]:
    """Live processes whose command line holds `needle` or whose cwd is under it (from /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode("utf-8", "replace")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:                       # it ended while we looked
            continue
        if needle in argv or needle in cwd:
            found.append(int(pid))
    return found


class Recorded(ProcessAgent):
    """A ProcessAgent whose prepare remembers its workspace, so a test can check it is gone afterwards."""

    def prepare(self, ctx, ws):
        SEEN.setdefault(ctx.prompt, {})["ws"] = ws


# ---- the program's view: its session, its cwd, nothing of the host ------------------------------------------------

PROBE = r"""
import json, os, sys
import anthropic, openai
first = openai.OpenAI(max_retries=0).chat.completions.create(model=os.environ["TRACERL_MODEL"], extra_body={
    "return_token_ids": True}, messages=[{"role": "user", "content": "hi"}])
second = anthropic.Anthropic(max_retries=0).messages.create(
    model=os.environ["TRACERL_MODEL"], max_tokens=8, messages=[{"role": "user", "content": "and you?"}])
with open("probe.json", "w") as f:
    json.dump({"env": dict(os.environ), "cwd": os.getcwd(), "stdin": sys.stdin.read(),
               "openai_ids": first.model_extra["token_ids"],
               "anthropic_text": "".join(b.text for b in second.content if b.type == "text")}, f)
print(json.dumps({"reward": 0.5, "score": 1, "info": {"turns": 2}}))
"""


class ProbeAgent(Recorded):
    def command(self, ctx, ws):
        return [PYTHON, "-c", PROBE]

    def grade(self, ctx, ws, run):
        with open(os.path.join(ws.work, "probe.json")) as f:          # what it left behind
            SEEN[ctx.prompt].update(probe=json.load(f), ctx=ctx)
        return super().grade(ctx, ws, run)                             # the reward from its stdout


def test_a_program_sees_its_session_its_own_cwd_and_none_of_the_hosts_secrets(policy, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-host-secret")
    monkeypatch.setenv("TRACERL_HOST_SECRET", "do-not-leak")
    (rollout,), failures = run_agents(policy, ProbeAgent, ["probe the session"], max_turns=2)
    assert failures == {}
    seen = SEEN["probe the session"]
    probe, ctx, ws = seen["probe"], seen["ctx"], seen["ws"]
    env = probe["env"]
    assert env == {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": ws.home, "TMPDIR": ws.home, "LANG": "C.UTF-8",
                   "OPENAI_BASE_URL": ctx.base_url, "OPENAI_API_BASE": ctx.base_url, "OPENAI_API_KEY": ctx.api_key,
                   "ANTHROPIC_BASE_URL": ctx.session_url, "ANTHROPIC_API_KEY": ctx.api_key, "TRACERL_MODEL": "policy"}
    assert "sk-host-secret" not in json.dumps(probe) and "do-not-leak" not in json.dumps(probe)
    assert os.environ["TRACERL_HOST_SECRET"] == "do-not-leak"        # armed: the host really has the secret
    assert probe["cwd"] == ws.work and probe["stdin"] == ""
    # both SDKs reached the session through the variables alone: two turns, each trainable exactly once
    engine, tokenizer = policy
    assert rollout.num_turns == 2 and len(rollout.generations) == 2
    assert probe["openai_ids"] == rollout.generations[0].token_ids
    assert probe["anthropic_text"] == tokenizer.decode(rollout.generations[1].token_ids, skip_special_tokens=True)
    check_sampled_once(rollout.rows, rollout.generations)
    assert (rollout.reward, rollout.score, rollout.info) == (0.5, 1.0, {"turns": 2.0})
    assert not os.path.exists(os.path.dirname(ws.work))                # the rollout's directory is gone


# ---- the whole tree goes, however it hides ------------------------------------------------------------------------

DAEMON = r"""
import os, signal, sys, time
if os.fork() == 0:                        # the classic daemon: fork, setsid, fork again, and the first parent exits
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", SLEEPER, MARKER])
    os._exit(0)
time.sleep(0.3)
"""


def daemon(marker: str, ignore_term: bool = False) -> str:
    """Python source that leaves a double-forked, setsid'd sleeper with `marker` in its argv."""
    sleeper = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else
               "import time\n") + "time.sleep(300)"
    return DAEMON.replace("SLEEPER", repr(sleeper)).replace("MARKER", repr(marker))


class TreeAgent(Recorded):
    """The prompt names the program: a daemon left behind by a program that succeeds or fails, or a program
    that ignores SIGTERM (with a SIGTERM-ignoring daemon of its own) and outlives its deadline."""
    timeout_s = 3.0

    def command(self, ctx, ws):
        kind, marker = ctx.prompt.split()
        body = {"succeeds": daemon(marker) + "print('{\"reward\": 1.0}')\n",
                "fails": daemon(marker) + "raise SystemExit(3)\n",
                "hangs": daemon(marker, ignore_term=True) + "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                                            "time.sleep(300)\n"}[kind]
        return [PYTHON, "-c", body, marker]


@pytest.mark.parametrize("pid_namespace", [True, False], ids=["pid-namespace", "subreaper"])
def test_no_process_of_a_rollouts_tree_outlives_it(policy, monkeypatch, pid_namespace):
    if pid_namespace and not process._pid_namespace():
        pytest.skip("a PID namespace of the launcher's own needs root")
    monkeypatch.setattr(process, "_pid_namespace", lambda: pid_namespace)
    markers = {kind: f"tracerl-marker-{uuid.uuid4().hex}" for kind in ("succeeds", "fails", "hangs")}
    prompts = [f"{kind} {marker}" for kind, marker in markers.items()]
    start = time.monotonic()
    rollouts, failures = run_agents(policy, TreeAgent, prompts)
    assert time.monotonic() - start < TreeAgent.timeout_s + GRACE_S + 5.0
    assert [r.task_id for r in rollouts] == ["t0"] and rollouts[0].reward == 1.0
    assert failures == {"process_exit": 1, "process_timeout": 1}
    for prompt, marker in zip(prompts, markers.values()):
        assert processes_holding(marker) == []
        assert not os.path.exists(os.path.dirname(SEEN[prompt]["ws"].work))


HIDES = r"""
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)             # inherited by every child below
if os.fork() == 0:                                       # a stopped child
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(300)
if os.fork() == 0:                                       # a child in a process group of its own
    os.setpgid(0, 0)
    time.sleep(300)
"""


class HidingAgent(Recorded):
    """A program that leaves a setsid'd daemon, a stopped child and a child in its own process group, all
    ignoring SIGTERM, and sleeps past its deadline; run jailed (a venv bound at /opt/venv) or not."""
    timeout_s = 3.0
    jail_binds = {"/opt/venv": sys.prefix}

    def command(self, ctx, ws):
        marker = ctx.prompt
        body = HIDES + daemon(marker, ignore_term=True) + "time.sleep(300)\n"
        return ["/opt/venv/bin/python" if self.jail else PYTHON, "-c", body, marker]


@pytest.mark.parametrize("jail, pid_namespace", [(True, False), (False, True), (False, False)],
                         ids=["jailed", "pid-namespace", "subreaper"])
def test_a_tree_that_hides_and_ignores_sigterm_dies_at_the_deadline(policy, monkeypatch, jail, pid_namespace):
    if jail and sandbox.refusal():
        pytest.skip(f"the jail is incomplete here: {sandbox.refusal()}")
    if pid_namespace and not process._pid_namespace():
        pytest.skip("a PID namespace of the launcher's own needs root")
    monkeypatch.setattr(process, "_pid_namespace", lambda: pid_namespace)
    marker = f"tracerl-marker-{uuid.uuid4().hex}"
    rollouts, failures = run_agents(policy, type("Hiding", (HidingAgent,), {"jail": jail}), [marker])
    assert rollouts == [] and failures == {"process_timeout": 1}
    assert processes_holding(marker) == []                   # at once: not one of the four is left
    assert not os.path.exists(os.path.dirname(SEEN[marker]["ws"].work))


def test_the_daemon_outlives_a_plain_subprocess_so_the_tree_check_is_armed():
    marker = f"tracerl-marker-{uuid.uuid4().hex}"
    subprocess.run([PYTHON, "-c", daemon(marker)], check=True, timeout=30)
    time.sleep(0.2)
    survivors = processes_holding(marker)
    try:
        assert len(survivors) == 1                                     # a plain wait leaves it running
    finally:
        for pid in survivors:
            os.kill(pid, 9)


def test_a_rollout_the_runner_cancels_takes_its_tree_with_it(policy):
    class Patient(TreeAgent):
        timeout_s = 60.0                      # longer than the runner's 1 s budget: the runner cancels first
    marker = f"tracerl-marker-{uuid.uuid4().hex}"
    rollouts, failures = run_agents(policy, Patient, [f"hangs {marker}"], step_timeout_s=1.0)
    assert rollouts == [] and failures == {"agent_timeout": 1}
    assert processes_holding(marker) == []
    assert not os.path.exists(os.path.dirname(SEEN[f"hangs {marker}"]["ws"].work))


# ---- failures by reason; the reward from stdout ------------------------------------------------------------------

class OutputAgent(ProcessAgent):
    output_bytes = 4096
    PROGRAMS = {
        "exits 3": [PYTHON, "-c", "raise SystemExit(3)"],
        "not found": ["/nonexistent/agent"],
        "prints prose": [PYTHON, "-c", "print('I think the answer is 4.')"],
        "misspells": [PYTHON, "-c", "print('{\"rewrad\": 1}')"],
        "floods then scores": [PYTHON, "-c", "import sys\nsys.stdout.write('x' * 3_000_000 + '\\n')\n"
                                             "print('{\"reward\": 0.25, \"score\": 0}')"],
    }

    def command(self, ctx, ws):
        return self.PROGRAMS[ctx.prompt]


def test_failures_count_by_reason_and_the_reward_comes_from_the_last_stdout_line(policy, caplog):
    rollouts, failures = run_agents(policy, OutputAgent, list(OutputAgent.PROGRAMS))
    assert failures == {"process_exit": 1, "process_spawn": 1, "process_reward": 2}
    assert [(r.task_id, r.reward, r.score) for r in rollouts] == [("t4", 0.25, 0.0)]   # 3 MB of output, capped
    logged = caplog.text
    assert "exited with status 3" in logged and "/nonexistent/agent" in logged and "rewrad" in logged


def test_the_stdout_convention_refuses_what_it_does_not_define_and_says_what_it_accepts():
    assert reward_from_stdout('noise\n{"reward": 1, "info": {"steps": 3}}\n\n') == \
        Result(reward=1.0, info={"steps": 3.0})
    for bad in ["", "4", '{"reward": "1"}', '{"reward": true}', '{"reward": 1, "info": {"x": "y"}}', '[1]']:
        with pytest.raises(ProcessFailure, match=r'like \{"reward": 1.0') as caught:
            reward_from_stdout(bad)
        assert caught.value.reason == "process_reward"


# ---- the jail -----------------------------------------------------------------------------------------------------

JAILED = r"""
import json, os, sys
import openai
reply = openai.OpenAI(max_retries=0).chat.completions.create(model=os.environ["TRACERL_MODEL"],
                                                             messages=[{"role": "user", "content": "hi"}])
open("note.txt", "w").write("written in the jail")
open(os.path.join(os.environ["HOME"], "cache.txt"), "w").write("home is writable")
sysctls = 0                                   # files under /proc/sys it can open for writing (none is written)
for folder, _, names in os.walk("/proc/sys"):
    for name in names:
        try:
            os.close(os.open(os.path.join(folder, name), os.O_WRONLY))
            sysctls += 1
        except OSError:
            pass
print(json.dumps({"reward": float(os.path.exists(sys.argv[1])),
                  "info": {"uid": os.getuid(), "pid": os.getpid(), "writable_sysctls": sysctls}}))
"""


class JailedAgent(ProcessAgent):
    jail = True
    jail_binds = {"/opt/venv": sys.prefix}   # the interpreter and its packages (openai)

    def command(self, ctx, ws):
        return ["/opt/venv/bin/python" if self.jail else PYTHON, "-c", JAILED, os.path.join(ROOT, "README.md")]

    def grade(self, ctx, ws, run):
        with open(os.path.join(ws.work, "note.txt")) as f:             # the grader reads what the jail left
            assert f.read() == "written in the jail"
        return super().grade(ctx, ws, run)


@jailed
def test_a_jailed_program_reaches_its_session_but_not_the_repository(policy):
    (rollout,), failures = run_agents(policy, JailedAgent, ["jailed"])
    assert failures == {} and rollout.num_turns == 1
    assert rollout.reward == 0.0                                       # the repository is not there
    assert rollout.info["uid"] >= 100_000 and rollout.info["pid"] == 3  # its own uid; its own PID namespace
    #                                                        (pid 1: the jail's init; 2: its session relay)
    assert rollout.info["writable_sysctls"] == 0                      # not host root, and /proc/sys read-only
    check_sampled_once(rollout.rows, rollout.generations)
    unjailed, _ = run_agents(policy, type("Unjailed", (JailedAgent,), {"jail": False}), ["unjailed"])
    assert unjailed[0].reward == 1.0                                   # armed: unjailed, the same check sees it
    if os.geteuid() == 0:                                              # and, as root, writes kernel.core_pattern
        assert unjailed[0].info["writable_sysctls"] > 0


def _proc_net_address(hex_address: str) -> str:
    """/proc/net/tcp{,6}'s address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def host_listeners() -> list[tuple[str, int]]:
    """Every TCP port listening on this host (its network namespace), from /proc/net/tcp and tcp6, as addresses to
    try: its own address where it listens on one, else loopback (both families) and this host's other addresses."""
    others = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)} - {"127.0.0.1", "::1"}
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state != "0A":                             # LISTEN
                    continue
                address, port = local.split(":")
                host = _proc_net_address(address)
                if host in ("0.0.0.0", "::"):                 # any address
                    found |= {(name, int(port, 16)) for name in ["127.0.0.1", "::1", *others]}
                else:
                    found.add((host, int(port, 16)))
    return sorted(found)


REACH = r"""
import json, os, socket, sys
reached = []
for host, port in json.loads(sys.argv[1]) + [["8.8.8.8", 53], ["1.1.1.1", 443]]:
    try:
        socket.create_connection((host, port), timeout=1).close()
        reached.append([host, port])
    except OSError:
        pass
open("reached.json", "w").write(json.dumps(reached))
print(json.dumps({"reward": 1.0}))
"""


class ReachAgent(Recorded):
    """Tries every listening port of the host (and two outside addresses) and leaves the list of what connected."""
    timeout_s = 120.0
    jail = True
    jail_binds = {"/opt/venv": sys.prefix}

    def command(self, ctx, ws):
        # read now, with the session's server listening: it and the bystanders are among them
        return ["/opt/venv/bin/python" if self.jail else PYTHON, "-c", REACH, json.dumps(host_listeners())]

    def grade(self, ctx, ws, run):
        with open(os.path.join(ws.work, "reached.json")) as f:
            SEEN[ctx.prompt]["reached"] = [tuple(pair) for pair in json.load(f)]
        SEEN[ctx.prompt]["session_port"] = urlsplit(ctx.session_url).port
        return super().grade(ctx, ws, run)


@jailed
def test_a_jailed_program_reaches_its_session_and_no_other_listener_on_the_host(policy):
    # a listener on loopback and one on every address stand for what a trainer's host runs (Ray's control server,
    # another runner's loopback server, a database), beside whatever else listens here
    bystanders = [socket.create_server(("127.0.0.1", 0)), socket.create_server(("0.0.0.0", 0))]
    try:
        (rollout,), failures = run_agents(policy, ReachAgent, ["reach"])
        assert failures == {}
        session_port = SEEN["reach"]["session_port"]
        assert SEEN["reach"]["reached"] == [("127.0.0.1", session_port)], SEEN["reach"]["reached"]
        # armed: unjailed, the same program reaches the bystanders (and the session's server itself)
        unjailed, _ = run_agents(policy, type("Unjailed", (ReachAgent,), {"jail": False}), ["reach unjailed"])
        reached = {port for _, port in SEEN["reach unjailed"]["reached"]}
        assert {bystander.getsockname()[1] for bystander in bystanders} <= reached and unjailed[0].reward == 1.0
    finally:
        for bystander in bystanders:
            bystander.close()


def test_a_jailed_rollout_is_refused_where_the_jail_cannot_be_built(policy, monkeypatch):
    monkeypatch.setattr(sandbox, "_VERIFIED", None)
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)           # a machine without bubblewrap
    rollouts, failures = run_agents(policy, JailedAgent, ["no jail here"])
    assert rollouts == [] and failures == {"process_spawn": 1}


# ---- the jail's files: one disk cap for every path it writes; cleanup finishes whatever is left ---------------------

FILL = r"""
import json, os
open("answer.txt", "w").write("left for the grader")
places, mib, files = [os.getcwd(), os.environ["HOME"], "/tmp"], 0, 0
for i in range(96):                           # 96 MiB, 1 MiB a file, over its three writable places
    try:
        with open(os.path.join(places[i % 3], f"fill{i}"), "wb") as f:
            f.write(b"x" * (1 << 20))
        mib += 1
    except OSError:
        pass
os.mkdir("many")
for i in range(50_000):                       # empty files: no bytes, but an inode each
    try:
        open(f"many/{i}", "w").close()
        files += 1
    except OSError:
        break
print(json.dumps({"reward": 1.0, "info": {"mib": mib, "files": files}}))
"""


class FillAgent(ProcessAgent):
    jail = True

    def command(self, ctx, ws):
        return [os.path.realpath(PYTHON), "-I", "-c", FILL]

    def grade(self, ctx, ws, run):                                     # the grader still reads what it left
        assert graders.read_agent_file(ws.work, "answer.txt", 100) == b"left for the grader"
        return super().grade(ctx, ws, run)


@jailed
def test_every_path_a_jailed_program_writes_counts_against_one_disk_cap(policy):
    (rollout,), failures = run_agents(policy, FillAgent, ["fill"])
    assert failures == {}
    assert rollout.info["mib"] <= process.JAIL_DISK_MB < 96, rollout.info       # work, home and /tmp together
    assert rollout.info["files"] < 50_000, rollout.info                          # inodes are capped too


LEAVE = r"""
import json, os, sys
os.symlink(sys.argv[1], "out")                 # a link out of the folder, to a host directory
os.symlink(sys.argv[1], os.path.join(os.environ["HOME"], "out"))
os.mkdir(b"odd \n\xff name")                   # a name that is no UTF-8, with a newline
os.mkdir("locked")
open("locked/f", "w").write("x")
os.chmod("locked", 0)                          # a folder no one may list or write
start = os.getcwd()
for _ in range(1500):                          # 1,500 folders deep
    os.mkdir("d")
    os.chdir("d")
open("bottom", "w").write("x")
os.chdir(start)
print(json.dumps({"reward": 1.0}))
"""


@pytest.mark.parametrize("jail", [True, False], ids=["jailed", "unjailed"])
def test_cleanup_finishes_whatever_the_program_leaves_and_follows_no_link_out(policy, tmp_path, jail):
    if jail and sandbox.refusal():
        pytest.skip(f"the jail is incomplete here: {sandbox.refusal()}")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("a host file")
    agent = type("Leave", (Recorded,), {"jail": jail, "command": lambda self, ctx, ws: [
        os.path.realpath(PYTHON), "-I", "-c", LEAVE, str(outside)]})
    (rollout,), failures = run_agents(policy, agent, [f"leave {jail}"])
    assert failures == {} and rollout.reward == 1.0
    assert not os.path.exists(os.path.dirname(SEEN[f"leave {jail}"]["ws"].work))   # launch.json (its key) too
    assert (outside / "keep").read_text() == "a host file"                          # the link out was not followed


# ---- real harnesses, unchanged ------------------------------------------------------------------------------------

class MiniProbe(swe_fix.MiniSweAgent):
    """The swe_fix recipe's agent, keeping mini-swe-agent's trajectory for the test before the directory goes."""

    def grade(self, ctx, ws, run):
        with open(os.path.join(ws.home, "trajectory.json")) as f:
            SEEN[ctx.prompt] = {"trajectory": json.load(f), "ws": ws}
        return super().grade(ctx, ws, run)


def test_mini_swe_agent_runs_multi_turn_in_its_repository_and_every_sampled_token_trains_once(policy):
    engine, tokenizer = policy
    problems = swe_fix.tasks("train", 0)[:2]
    runner = type("Runner", (swe_fix.AgentRunner,), {"agent_cls": MiniProbe})(engine, tokenizer, max_turns=3,
                                                                              max_length=2048)
    try:
        rollouts = runner.run(problems, ["g0", "g1"], SamplingParams(top_k=1, max_tokens=64))
    finally:
        runner.server.stop()
    assert runner.failures == {} and len(rollouts) == 2
    for task, rollout in zip(problems, rollouts):
        label = json.loads(task.label)
        name, seen = label["name"], SEEN[task.messages[-1]["content"]]
        trajectory = seen["trajectory"]
        assert rollout.num_turns == 3 == trajectory["info"]["model_stats"]["api_calls"]   # mini's step limit
        check_sampled_once(rollout.rows, rollout.generations)
        with pytest.raises(ValueError, match="sampled-once violated"):                   # armed
            check_sampled_once(rollout.rows, rollout.generations + rollout.generations[-1:])
        # the command mini ran is the one the model sampled, and it ran in the rollout's copy of the repository
        sampled = tokenizer.decode(rollout.generations[0].token_ids, skip_special_tokens=True)
        call = json.loads(sampled.split("<tool_call>\n")[1].split("\n</tool_call>")[0])
        assert call == {"name": "bash", "arguments": {"command": f"cat {name}.py"}}
        tool_turns = [m for m in trajectory["messages"] if m["role"] == "tool"]
        assert json.loads(tool_turns[0]["content"])["output"] == label["files"][f"{name}.py"]
        # the grader ran the hidden tests on what was left: the bug, unfixed by a model that learned only the format
        passed, _ = run_hidden_tests(label["files"][f"{name}.py"], name, [(tuple(a), e) for a, e in label["tests"]])
        assert rollout.reward == passed / 3 and rollout.info["agent_steps"] == 3.0
        assert processes_holding(os.path.dirname(seen["ws"].work)) == []
        assert not os.path.exists(os.path.dirname(seen["ws"].work))


@pytest.fixture(scope="module")
def openai_cli_python() -> str:
    """An interpreter of its own with openai 2.34.0, the last release that ships the `openai` command line (2.35
    removed it; this environment's openai is 3.x), built once into the cache from PyPI. Its own site-packages holds
    openai 2.34 alone and comes first on its path; a .pth file after it lends it this interpreter's packages for
    openai's dependencies (httpx, pydantic, ...), so nothing but the one wheel is downloaded or resolved."""
    import site
    import sysconfig

    def write(folder: str) -> None:
        subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", folder], check=True)
        own = subprocess.run([os.path.join(folder, "bin", "python"), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True,
                             check=True).stdout.strip()
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", own,
                        "openai==2.34.0"], check=True)
        with open(os.path.join(own, "lent.pth"), "w") as f:
            f.write("\n".join([sysconfig.get_paths()["purelib"], *site.getsitepackages()]) + "\n")
    lender = hashlib.sha256(sys.prefix.encode()).hexdigest()[:10]       # the packages it borrows are this venv's
    return os.path.join(models._cached_folder(f"venv-openai-2.34.0-{lender}", write), "bin", "python")


def test_the_openai_command_line_from_its_own_interpreter_is_a_process_agent(policy, openai_cli_python):
    class OpenAICommandLine(ProcessAgent):
        def command(self, ctx, ws):           # `openai api chat.completions.create ...`, as `python -m openai`
            return [openai_cli_python, "-m", "openai", "api", "chat.completions.create", "-m", ctx.model_name,
                    "-g", "user", ctx.prompt, "-M", "8"]

        def grade(self, ctx, ws, run):
            SEEN[ctx.prompt] = {"printed": run.stdout}
            return Result(reward=float(bool(run.stdout.strip())))

    (rollout,), failures = run_agents(policy, OpenAICommandLine, ["Say something."])
    engine, tokenizer = policy
    assert failures == {} and rollout.num_turns == 1 and rollout.reward == 1.0
    reply = tokenizer.decode(rollout.generations[0].token_ids, skip_special_tokens=True)
    assert SEEN["Say something."]["printed"] == reply + ("" if reply.endswith("\n") else "\n")   # the CLI's print
    check_sampled_once(rollout.rows, rollout.generations)
