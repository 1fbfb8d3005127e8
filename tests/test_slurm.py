# slurm.sbatch for real: a Slurm cluster on this machine, started by the test (Debian's slurm-wlm with munge, which
# `./launch.sh test` installs from apt): munged, slurmctld and two slurmd on localhost, so the job has a first node
# (the batch script, the Ray head) and a second one (a Ray worker, started by srun). `sbatch --nodes 2 slurm.sbatch`
# runs a two-step tiny run through ./launch.sh cluster and train.py in ray mode, with one engine actor on each node.
# While it runs, a client without the cluster's Ray token (none sent, or a wrong one) is refused by its head: the
# test's own environment turns Ray's auth off (conftest.py), and launch.sh cluster turns it back on for the job.
# Everything the test starts is stopped, and its files removed, whether the job succeeds or not.
#
# Slurm here: no cgroups (proctrack/linuxproc, task/none), no accounting daemon (the job's state and exit code come
# from scontrol, which keeps a finished job for MinJobAge), every file in one temporary folder. Each slurmd reads a
# copy of slurm.conf with its own port, spool folder and log (a single host runs two only that way), so the
# configuration hash check is off.
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from test_runtime import PARITY_RECIPE, metrics_of, tiny_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES = 2
PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"      # the daemons live in sbin
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")
# A client of the cluster's GCS (the head's port, where ray.init and every node connect first): one call, answered or
# refused at once (ray.init(address=...) retries a refusal for 20 s before it gives up).
RAY_PROBE = """
import sys
import ray.exceptions
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_keys(b"", None, timeout=10)
except ray.exceptions.AuthenticationError:
    print("refused")
else:
    print("admitted")
"""
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE")

SLURM_CONF = """\
ClusterName=tracerl
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={home}/munge.socket
CredType=cred/munge
StateSaveLocation={home}/state
SlurmdSpoolDir={home}/spool{node}
SlurmctldPidFile={home}/slurmctld.pid
SlurmdPidFile={home}/slurmd{node}.pid
SlurmctldLogFile={home}/slurmctld.log
SlurmdLogFile={home}/slurmd{node}.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
MinJobAge=3600
DebugFlags=NO_CONF_HASH
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def tail(path: str, lines: int = 40) -> str:
    if not os.path.exists(path):
        return f"({path}: none)"
    return f"--- {path}\n" + "\n".join(open(path, errors="replace").read().splitlines()[-lines:])


def slurm_cmd(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=60)


def job_state(env: dict, job: str) -> dict[str, str]:
    """scontrol's fields of one job (JobState, ExitCode, ...)."""
    done = slurm_cmd(env, "scontrol", "show", "job", "--oneliner", job)
    return dict(field.split("=", 1) for field in done.stdout.split() if "=" in field)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def slurm():
    """The environment that reaches this machine's new Slurm cluster (SLURM_CONF, PATH), once its nodes are idle."""
    missing = [name for name in DAEMONS if shutil.which(name, path=PATH) is None]
    if missing:
        why = (f"Slurm is not installed here ({', '.join(missing)} missing); ./launch.sh test installs Debian's "
               f"slurmctld, slurmd, slurm-client and munge with apt")
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    home = tempfile.mkdtemp(prefix="tracerl-slurm-")
    os.chmod(home, 0o755)          # munged refuses a socket whose folders not everyone may enter
    env = {**os.environ, "PATH": PATH, "SLURM_CONF": os.path.join(home, "slurm.conf")}
    daemons: list[subprocess.Popen] = []

    def start(name: str, *args: str, conf: str = "slurm.conf") -> None:
        with open(os.path.join(home, f"{name}-{len(daemons)}.out"), "w") as out:
            daemons.append(subprocess.Popen([name, *args], env={**env, "SLURM_CONF": os.path.join(home, conf)},
                                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True))

    def logs() -> str:
        return "\n".join(tail(os.path.join(home, f)) for f in sorted(os.listdir(home)) if f.endswith((".out", ".log")))

    try:
        key = os.path.join(home, "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        # the node's CPUs as slurmd counts them (its own check refuses a node configured with more)
        probe = subprocess.run(["slurmd", "-C"], env=env, capture_output=True, text=True, timeout=60).stdout
        cpus = next(field.split("=")[1] for field in probe.split() if field.startswith("CPUs="))
        host, ctld_port, ports = socket.gethostname().split(".")[0], free_port(), [free_port() for _ in range(NODES)]
        nodes = "\n".join(f"NodeName=n{i} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} State=UNKNOWN"
                          for i, port in enumerate(ports))
        os.makedirs(os.path.join(home, "state"))
        for node, port in [("", ports[0])] + list(enumerate(ports)):      # the controller's copy, then each node's
            os.makedirs(os.path.join(home, f"spool{node}"), exist_ok=True)
            with open(os.path.join(home, f"slurm{node}.conf"), "w") as f:
                f.write(SLURM_CONF.format(host=host, ctld_port=ctld_port, slurmd_port=port, home=home, node=node,
                                          nodes=nodes))
        start("munged", "--foreground", f"--key-file={key}", f"--socket={home}/munge.socket",
              f"--pid-file={home}/munged.pid", f"--log-file={home}/munged.log", f"--seed-file={home}/munged.seed")
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(home, "munge.socket")):
            assert daemons[0].poll() is None and time.monotonic() < deadline, f"munged did not start\n{logs()}"
            time.sleep(0.2)
        start("slurmctld", "-D", "-i")
        for i in range(NODES):
            start("slurmd", "-D", "-N", f"n{i}", conf=f"slurm{i}.conf")
        deadline = time.monotonic() + 90
        while True:
            states = slurm_cmd(env, "sinfo", "--noheader", "--Node", "--format=%N %t").stdout.split("\n")
            if sum(line.endswith(" idle") for line in states) == NODES:
                break
            dead = [p.args[0] for p in daemons if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, \
                f"Slurm's nodes are not idle (sinfo: {states}; exited: {dead})\n{logs()}"
            time.sleep(0.5)
        yield env
    finally:
        # jobs first (their steps run under slurmstepd, apart from slurmd), then the daemons, newest first
        if any(p.args[0] == "slurmctld" and p.poll() is None for p in daemons):
            jobs = slurm_cmd(env, "squeue", "--noheader", "--format=%A").stdout.split()
            if jobs:
                slurm_cmd(env, "scancel", *jobs)
                deadline = time.monotonic() + 60
                while slurm_cmd(env, "squeue", "--noheader").stdout.strip() and time.monotonic() < deadline:
                    time.sleep(1)
        for proc in reversed(daemons):
            stop(proc)
        shutil.rmtree(home, ignore_errors=True)


def probe_ray(address: str, env: dict, home: str) -> str:
    """What the cluster's head tells a client that has no token (sends none) or a wrong one."""
    outcomes = []
    for auth in ({"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "f" * 64}):
        probe_env = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH_")} | auth | {"HOME": home}
        done = subprocess.run([sys.executable, "-c", RAY_PROBE, address], env=probe_env, capture_output=True,
                              text=True, timeout=60)
        outcomes.append(done.stdout.strip() or f"no answer: {done.stderr[-800:]}")
    return " and ".join(sorted(set(outcomes)))


def test_sbatch_slurm_sbatch_trains_through_launch_sh_cluster_on_two_nodes(slurm, tmp_path):
    """The job completes with exit code 0, its Ray cluster has both nodes, and the run wrote both steps' metrics
    with both engines live (each engine takes a node's every CPU, so one of them ran on the srun-started worker).
    While it trains, its Ray head refuses a client without the cluster's token."""
    recipe, out, log = tmp_path / "parity.py", str(tmp_path / "run"), str(tmp_path / "job.out")
    recipe.write_text(PARITY_RECIPE)
    env = {**slurm, "RAY_START_ARGS": "--num-cpus 2 --object-store-memory 100000000"}
    submit = subprocess.run(["sbatch", "--parsable", "--nodes", str(NODES), "--time", "10", "--output", log,
                             "slurm.sbatch", *tiny_flags(str(recipe), 2), "--out", out, "--runtime.engines", "2",
                             "--runtime.engine_cpus", "2", "--runtime.eta", "1", "--correction.level", "token",
                             "--correction.max_staleness", "1"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    deadline, stranger = time.monotonic() + 480, None
    while (state := job_state(env, job)).get("JobState") not in ENDED:
        assert time.monotonic() < deadline, f"job {job} still {state.get('JobState')}\n{tail(log)}"
        head = re.search(r"launch\.sh: Ray cluster at (\S+:\d+)", open(log).read() if os.path.exists(log) else "")
        if head and stranger is None:      # the cluster is up and train.py is starting on it
            stranger = probe_ray(head.group(1), env, str(tmp_path))
        time.sleep(1)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), tail(log, 80)
    text = open(log).read()
    assert f"({NODES} nodes)" in text and "launch.sh: Ray cluster at" in text, tail(log, 80)
    assert stranger == "refused", f"a client without the cluster's Ray token was {stranger}"
    records = metrics_of(out)
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["perf/engines_live"] == 2
    assert all(r["runtime/staleness_over"] == 0 for r in records)
