# Tests for agents/graders.py: extraction, normalisation and equivalence on tables of positive and negative cases;
# read_agent_file, and swe_fix's grader reading through it, on real hostile files an agent can leave behind.
import json
import os
import re
import resource
import threading
import time
from types import SimpleNamespace

import pytest

from agents import graders
from agents.harness import json_lines
from agents.process import ProcessFailure, Workspace, reward_from_stdout
from recipes import swe_fix
from recipes.code_exec import PROBLEMS


@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{7}.", "7"),
    ("first \\boxed{3}, then corrected: \\boxed{ 5 }", "5"),                 # the last one wins
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),                               # nested braces kept
    ("\\fbox{42}", "42"),
    ("\\boxed{8} and a cut-off \\boxed{\\frac{1}{", "8"),                    # last *balanced* one
    ("\\boxed {x^{2}}", "x^{2}"),
    ("The answer is \\boxed{}.", ""),                                       # empty, but present
    ("no box here, just 7", None),
    ("\\boxed{unclosed", None),
])
def test_extract_boxed_takes_the_last_balanced_box(text, expected):
    assert graders.extract_boxed(text) == expected


def test_extract_answer_tag_takes_the_last_tag():
    assert graders.extract_answer_tag("<answer>3</answer> wait <answer>\n 4 \n</answer>") == "4"
    assert graders.extract_answer_tag("<answer>3") is None


@pytest.mark.parametrize("text, expected", [
    ("<answer>9</answer> \\boxed{7}", "7"),                                  # 1. boxed beats the tag
    ("The answer is \\boxed{}. <answer>6</answer>", "6"),                    # empty box counts as absent
    ("Sam has 3 + 4 = 7 apples.\nThe final answer is 7.", "7"),              # 3. "answer is"
    ("The final answer is 14 + 4 = 18.", "18"),                              # after the last '='
    ("The answer is: 1,000 apples", "1,000 apples"),                         # unit words go in normalize
    ("The answer is 7, because 3 + 4 = 7", "7"),
    ("Answer: x^2", "x^2"),                                                 # no number: the sentence
    ("Sam has 7 - 2 = 5 apples left.", "5"),                                 # 4. last number
    ("I am not sure.", None),
    ("", None),
])
def test_extract_final_answer_tries_box_tag_phrase_then_last_number(text, expected):
    assert graders.extract_final_answer(text) == expected


@pytest.mark.parametrize("raw, normalized", [
    (" $7$. ", "7"), ("1,000", "1000"), ("x = 7", "7"), ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("90^\\circ", "90"), ("50\\%", "50"), ("\\text{7 apples}", "7"), ("2\\pi", "2\\pi"), ("1,2", "1,2"),
])
def test_normalize_answer(raw, normalized):
    assert graders.normalize_answer(raw) == normalized


@pytest.mark.parametrize("prediction, label", [
    ("7", "7"), ("7.0", "7"), ("7.00", "7"), ("\\frac{14}{2}", "7"), ("14/2", "7"), ("1,000", "1000"),
    ("-\\frac{1}{3}", "-1/3"), ("0.5", "\\frac{1}{2}"), (".5", "1/2"), ("x=7", "7"), ("$7$", "7"),
    ("7 apples", "7"), ("\\sqrt{2}/2", "\\frac{1}{\\sqrt{2}}"), ("2x+2", "2(x+1)"), ("x^2 - 1", "(x-1)(x+1)"),
    ("2\\pi", "\\pi \\cdot 2"), ("(1, 2)", "(1,2)"), ("\\frac{\\sqrt{3}}{2}", "\\sqrt{3}/2"),
    # geo3k: exact radicals and multiples of pi, and their correct roundings (a tool computed them)
    ("\\sqrt{52}", "2 \\sqrt{13}"), ("7.21", "2 \\sqrt{13}"), ("7.2111", "2\\sqrt{13}"), ("31.42", "10 \\pi"),
    ("2\\sqrt{13}", "7.21"), ("70^{\\circ}", "70"), ("4\\sqrt{3}", "\\sqrt{48}"),
])
def test_equivalent_answers_are_accepted(prediction, label):
    assert graders.is_equivalent(prediction, label)
    assert graders.grade(f"So the result is \\boxed{{{prediction}}}.", label) == 1.0


@pytest.mark.parametrize("prediction, label", [
    ("8", "7"), ("7.01", "7"), ("0.333", "1/3"), ("-7", "7"), ("70", "7"), ("1,2", "12"), ("(2, 1)", "(1, 2)"),
    ("x+1", "x+2"), ("", "7"), (None, "7"), ("seven", "7"), ("\\frac{1}{0}", "7"), ("1/0", "1/0x"),
    ("7.2", "2\\sqrt{13}"), ("7.22", "2\\sqrt{13}"), ("7.21", "7.2111"), ("31.41", "10\\pi"), ("0.33", "1/3"),
])
def test_different_answers_are_rejected(prediction, label):
    assert not graders.is_equivalent(prediction, label)


@pytest.mark.parametrize("garbage", [
    "\\frac{", "}{", "((((((((", "9^9^9^9^9^9", "((9^64)^64)^64^64", "__import__('os').system('echo')",
    "x" * 10_000, "\\sqrt[3]{8}", "1/(x-x)", "i^i^i", "😀", "\\boxed{\\boxed{", "\x00",
])
def test_garbage_never_raises_and_is_fast(garbage):
    start = time.perf_counter()
    assert graders.grade(garbage, "7") == 0.0
    assert graders.is_equivalent(garbage, garbage + "+1") is False
    assert time.perf_counter() - start < 2.0


def test_grade_on_realistic_smollm2_responses():
    # responses seen from SmolLM2-135M-Instruct on data.arithmetic_tasks prompts
    assert graders.grade("Sam has 9 + 8 = 17 apples.\nThe final answer is 17.", "17") == 1.0
    assert graders.grade("Sam has 14 apples, and 4 apples are left.\n\nThe final answer is 14 + 4 = 18.", "10") == 0.0
    assert graders.grade("Sam has 7 - 2 = 5 apples left. The answer is \\boxed{5}", "5") == 1.0
    assert graders.grade("so 7 + 7 = 14 apples.\n\nThe answer is \\boxed{}.", "14") == 0.0  # the phrase holds no number


# ---- what an agent left behind: read_agent_file, and swe_fix's grader reading through it --------------------------
# Each read runs in a worker thread joined with a deadline (a read that blocks is reported as a hang, and its FIFOs
# are then opened for writing so the thread ends), under an address-space ceiling (an unbounded read ends in
# MemoryError here instead of taking the machine's memory) while a sampler watches this process's RSS.

CEILING_MB = 256          # address space a call may add; beyond it an unbounded read gets MemoryError
HANG_S = 10.0             # a grade with its sandbox run takes about a second; a blocked read never ends
REFUSAL_S = 2.0           # a refusal reads nothing and runs nothing
RSS_GROWTH_MB = 4         # ... so it adds next to nothing to this (the trainer's) process
PAGE = os.sysconf("SC_PAGE_SIZE")


def _statm(field: int) -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[field]) * PAGE


def _unblock_fifos(top: str) -> None:
    """Open every FIFO under `top` for writing and close it: a reader blocked in open() gets EOF and goes on."""
    for folder, _, files in os.walk(top):
        for name in files:
            try:
                os.close(os.open(os.path.join(folder, name), os.O_WRONLY | os.O_NONBLOCK))
            except OSError:      # not a FIFO, or no reader waiting on it
                pass


def bounded(call, top: str):
    """(what `call` returned or raised, seconds it took, how far this process's RSS rose above its start)."""
    outcome = {}

    def work():
        try:
            outcome["value"] = call()
        except BaseException as exc:
            outcome["value"] = exc

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    start, peak, began = _statm(1), 0, time.monotonic()
    resource.setrlimit(resource.RLIMIT_AS, (_statm(0) + (CEILING_MB << 20), hard))
    worker = threading.Thread(target=work, daemon=True)
    try:
        worker.start()
        while worker.is_alive() and time.monotonic() - began < HANG_S:
            peak = max(peak, _statm(1))
            worker.join(0.002)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    if worker.is_alive():
        _unblock_fifos(top)
        worker.join(HANG_S)
        pytest.fail(f"hang: the read was still blocked after {HANG_S:g} s (ended by writing to its FIFOs)")
    return outcome["value"], time.monotonic() - began, max(peak - start, 0)


ADD = next(problem for problem in PROBLEMS if problem[0] == "add")
FIXED = "def add(a, b):\n    return a + b\n"
SECRET = "HOST_SECRET = 'a file outside the workspace'\n"
TRAJECTORY = json.dumps({"info": {"exit_status": "Submitted", "model_stats": {"api_calls": 3}}})


@pytest.fixture
def rollout(tmp_path, monkeypatch):
    """A rollout's directories as mini-swe-agent left them after fixing add.py and submitting; a host directory
    beside them holding a secret; and the code every hidden-test run in the sandbox was given."""
    ctx = SimpleNamespace(label=swe_fix.task(*ADD).label)
    ws = Workspace(str(tmp_path / "work"), str(tmp_path / "home"))
    os.mkdir(ws.work)
    os.mkdir(ws.home)
    swe_fix.MiniSweAgent().prepare(ctx, ws)
    (tmp_path / "work" / "add.py").write_text(FIXED)
    (tmp_path / "home" / "trajectory.json").write_text(TRAJECTORY)
    host = tmp_path / "host"
    host.mkdir()
    (host / "add.py").write_text(SECRET + FIXED)
    sent = []
    real = swe_fix.run_hidden_tests

    def spy(code, name, tests):
        sent.append(code[:4096])
        return real(code, name, tests)

    monkeypatch.setattr(swe_fix, "run_hidden_tests", spy)
    return SimpleNamespace(ctx=ctx, ws=ws, top=str(tmp_path), host=str(host), sent=sent)


def grade(rollout):
    return bounded(lambda: swe_fix.MiniSweAgent().grade(rollout.ctx, rollout.ws, None), rollout.top)


def test_swe_fix_grades_a_well_formed_fix_and_a_deleted_module(rollout):
    result, _, _ = grade(rollout)
    assert (result.reward, result.score) == (1.0, 1.0), result
    assert result.info == {"tests_passed": 1.0, "submitted": 1.0, "agent_steps": 3.0}
    assert rollout.sent == [FIXED]
    os.remove(os.path.join(rollout.ws.work, "add.py"))        # deleted: an answer that passes nothing
    result, _, _ = grade(rollout)
    assert (result.reward, result.score, result.info["tests_passed"]) == (0.0, 0.0, 0.0), result


def _replace(path: str, make) -> None:
    os.remove(path)
    make(path)


def _sparse(path: str) -> None:
    with open(path, "w") as f:
        f.write(FIXED)
    os.truncate(path, 100 << 20)


def _work_as_link(rollout) -> None:
    os.rename(rollout.ws.work, os.path.join(rollout.top, "moved"))
    os.symlink(rollout.host, rollout.ws.work)


HOSTILE = {   # what the agent leaves -> (how, the words of the refusal)
    "module_symlink_to_dev_zero": (lambda r: _replace(f"{r.ws.work}/add.py", lambda p: os.symlink("/dev/zero", p)),
                                   "symbolic link"),
    "module_symlink_to_etc_passwd": (lambda r: _replace(f"{r.ws.work}/add.py",
                                                        lambda p: os.symlink("/etc/passwd", p)), "symbolic link"),
    "module_fifo_without_writer": (lambda r: _replace(f"{r.ws.work}/add.py", os.mkfifo), "FIFO"),
    "trajectory_fifo_without_writer": (lambda r: _replace(f"{r.ws.home}/trajectory.json", os.mkfifo), "FIFO"),
    "module_sparse_100mb": (lambda r: _sparse(f"{r.ws.work}/add.py"), "larger than"),
    "module_directory": (lambda r: _replace(f"{r.ws.work}/add.py", os.mkdir), "directory"),
    "work_symlinked_to_a_host_directory": (_work_as_link, "symbolic link"),   # an unjailed agent has our uid
    "module_hard_link_to_a_host_file": (lambda r: _replace(f"{r.ws.work}/add.py",
                                                           lambda p: os.link(f"{r.host}/add.py", p)), "hard link"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_swe_fix_grader_refuses_what_the_agent_left_quickly_and_reads_nothing_else(rollout, case):
    make, words = HOSTILE[case]
    make(rollout)
    outcome, seconds, growth = grade(rollout)
    assert not any("root:" in code or "HOST_SECRET" in code for code in rollout.sent), rollout.sent
    assert isinstance(outcome, ProcessFailure) and outcome.reason == "process_grade", repr(outcome)
    assert words in str(outcome), str(outcome)
    assert seconds < REFUSAL_S and growth < RSS_GROWTH_MB << 20, (seconds, growth)


@pytest.mark.parametrize("trajectory", [
    "not json", "[" * 100_000 + "]" * 100_000, '{"info": []}', '{"info": {"exit_status": 1}}',
    '{"info": {"exit_status": "Submitted", "model_stats": {"api_calls": "x"}}}',
], ids=["text", "deep", "info_a_list", "no_model_stats", "steps_text"])
def test_swe_fix_grader_refuses_a_trajectory_that_is_not_minis(rollout, trajectory):
    with open(os.path.join(rollout.ws.home, "trajectory.json"), "w") as f:
        f.write(trajectory)
    outcome, _, _ = grade(rollout)
    assert isinstance(outcome, ProcessFailure) and outcome.reason == "process_grade", repr(outcome)
    assert "trajectory.json" in str(outcome)


def test_read_agent_file_reads_regular_files_up_to_the_cap(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f.txt").write_bytes(b"x" * 100)
    assert graders.read_agent_file(str(tmp_path), "sub/f.txt", 100) == b"x" * 100
    with pytest.raises(graders.AgentFileError, match=r"sub/f.txt: .*larger than 99 bytes"):
        graders.read_agent_file(str(tmp_path), "sub/f.txt", 99)
    # a file whose size says 0 but holds more (a /proc file): the read itself stops one byte past the cap
    assert graders.read_agent_file(f"/proc/{os.getpid()}", "comm", 64).strip()
    with pytest.raises(graders.AgentFileError, match=r"status: larger than 10 bytes$"):
        graders.read_agent_file(f"/proc/{os.getpid()}", "status", 10)


@pytest.mark.parametrize("base, path, words", [
    ("root", "sub/f.txt", "sub: .*symbolic link"),          # a symlinked parent directory
    ("root", "plain/f.txt", "plain: .*regular file"),       # a file where a directory belongs
    ("linked_root", "plain", "symbolic link"),              # the root itself replaced by a symlink
])
def test_read_agent_file_refuses_a_symlinked_or_non_directory_parent(tmp_path, base, path, words):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "f.txt").write_text("outside")
    (outside / "plain").write_text("outside")
    (root / "sub").symlink_to(outside)
    (root / "plain").write_text("a file")
    (tmp_path / "linked_root").symlink_to(outside)
    outcome, _, _ = bounded(lambda: graders.read_agent_file(str(tmp_path / base), path, 1 << 20), str(tmp_path))
    assert isinstance(outcome, graders.AgentFileError), repr(outcome)
    assert not isinstance(outcome, graders.AgentFileMissing) and re.search(words, str(outcome)), str(outcome)


def test_read_agent_file_reports_a_missing_file_apart_from_refusals(tmp_path):
    for path in ["gone.py", "gone/f.py"]:
        with pytest.raises(graders.AgentFileMissing, match="does not exist"):
            graders.read_agent_file(str(tmp_path), path, 100)


@pytest.mark.parametrize("path", ["../f", "/etc/passwd", "a/../../f", "a//f", "./f", ""])
def test_read_agent_file_takes_only_plain_names_under_the_root(tmp_path, path):
    with pytest.raises(ValueError, match="relative_path"):
        graders.read_agent_file(str(tmp_path), path, 100)


# ---- JSON an agent wrote: its values are counted before any is built (agents.graders.parse_agent_json) -------------

WIDE = b"[" + b"{}," * (5 << 20) + b"{}]"     # 15 MiB of empty objects: ~390 MB of dicts once parsed


def test_swe_fix_grader_refuses_a_wide_trajectory_within_a_memory_bound(rollout):
    with open(os.path.join(rollout.ws.home, "trajectory.json"), "wb") as f:
        f.write(WIDE)
    outcome, _, growth = grade(rollout)
    assert isinstance(outcome, ProcessFailure) and outcome.reason == "process_grade", repr(outcome)
    assert "trajectory.json: more than" in str(outcome), str(outcome)
    assert growth < 3 * len(WIDE), growth         # the bytes read and their count: never the parse's 390 MB


def test_every_parse_of_agent_json_counts_its_values_first():
    wide = "[" + "{}," * 200_000 + "{}]"           # one 600 KB stdout line: ~29 MB of dicts once parsed
    with pytest.raises(ProcessFailure, match="stdout line 2: more than") as caught:
        json_lines("a warning\n" + wide)
    assert caught.value.reason == "process_grade"
    with pytest.raises(ProcessFailure, match="its last stdout line: more than") as caught:
        reward_from_stdout(wide)
    assert caught.value.reason == "process_reward"
    # one budget for a harness's whole output: four lines, each within it, past it together
    line = '{"type": "item", "ids": [' + "1," * 30_000 + "1]}"
    assert len(json_lines("\n".join([line] * 3))) == 3
    with pytest.raises(ProcessFailure, match="stdout line 4: more than"):
        json_lines("\n".join([line] * 4))
    # what harnesses and mini really write is parsed as before
    assert json_lines('warning\n{"type": "result", "num_turns": 3}\n[1]') == [{"type": "result", "num_turns": 3}]
    assert graders.parse_agent_json(TRAJECTORY.encode(), "trajectory.json") == json.loads(TRAJECTORY)
    with pytest.raises(ValueError, match="x: not JSON"):
        graders.parse_agent_json("[1] trailing", "x")
