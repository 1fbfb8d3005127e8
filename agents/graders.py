# agents/graders.py — answer extraction and equivalence for verifiable rewards, and the one way a grader reads the
# files an agent left behind.
# Owns: pulling a final answer out of a model response, normalising it, deciding whether it equals a reference
# label (exact numbers first, then small symbolic expressions), and the 1.0/0.0 grade built from those;
# `read_agent_file`, through which every read by the trainer of a file an agent left (its working directory, its
# HOME) goes: a regular file, reached without following a symlink, of bounded size, or a clear refusal; and
# `parse_agent_json`, through which every parse of JSON an agent wrote (a file, a stdout line) goes: its values
# counted before any is built, so the parse's memory is bounded, not only its bytes.
# Never: evaluates text as Python (expressions go through a small whitelisted parser that builds sympy objects),
# raises on a malformed response, follows a link or opens a FIFO or device an agent left, or imports the rest of
# tracerl.
# Invariant: grading is a pure function of (response, label): deterministic, bounded in time by size limits.
import io
import json
import os
import re
import stat
from fractions import Fraction

import ijson
import sympy

# ---- extraction ----

_BOXED_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ANSWER_PHRASE = re.compile(r"answer\s*(?:is|:)\s*:?", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _braced(text: str, open_index: int) -> str | None:
    """Content of the brace group opening at text[open_index] == '{', or None if it never closes."""
    depth = 0
    for index in range(open_index, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[open_index + 1:index]
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last balanced \\boxed{...} or \\fbox{...} (nested braces kept), stripped; None if none."""
    for match in reversed(list(_BOXED_START.finditer(text))):
        content = _braced(text, match.end() - 1)
        if content is not None:
            return content.strip()
    return None


def extract_answer_tag(text: str) -> str | None:
    """Content of the last <answer>...</answer>, stripped; None if none."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def extract_final_answer(text: str) -> str | None:
    """The response's final answer, trying in order (an empty result counts as absent):
    1. the last \\boxed{...} / \\fbox{...};  2. the last <answer>...</answer>;
    3. the clause after the last "answer is" / "answer:" (up to a newline, '. ' or ', '), from its last '='
       on ("14 + 4 = 18" -> "18"; unit words are dropped later by normalize_answer);
    4. the last number anywhere in the text. None if all fail."""
    for candidate in (extract_boxed(text), extract_answer_tag(text)):
        if candidate:
            return candidate
    phrases = list(_ANSWER_PHRASE.finditer(text))
    if phrases:
        clause = re.split(r"\n|\.\s|\.$|,\s", text[phrases[-1].end():].strip(), maxsplit=1)[0]
        value = clause.split("=")[-1].strip()
        if value:
            return value
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


# ---- normalisation ----

_DROP = ["\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "^\\circ", "^{\\circ}", "°", "\\%", "%", "$", "\\displaystyle"]


def normalize_answer(answer: str) -> str:
    """Canonical text form: no spaces, LaTeX spacing/sizing/degree/percent/dollar marks, \\text{} wrappers,
    thousands separators, trailing period or unit word after a number ('7 apples'); \\dfrac/\\tfrac -> \\frac;
    'x = 7' -> '7'; lower case."""
    text = answer.strip()
    text = re.sub(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}", r"\1", text)
    for mark in _DROP:
        text = text.replace(mark, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\s+", "", text).rstrip(".").lower()
    if re.fullmatch(r"[a-z]=.+", text):  # a single variable assignment: keep the value
        text = text[2:]
    unit = re.fullmatch(r"(-?\d[\d.,/]*)([a-z]{2,})", text)  # '7apples' -> '7' (but '2pi' stays)
    if unit and unit.group(2) not in _CONSTANTS:
        text = unit.group(1)
    return re.sub(r"(?<![\d.])(\d{1,3}(?:,\d{3})+)(?![\d,])", lambda m: m.group(1).replace(",", ""), text)


def _as_fraction(text: str) -> Fraction | None:
    """An exact number from normalised text: 7, -7.50, 14/2, \\frac{14}{2}, -\\frac{1}{3}; else None."""
    frac = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", text)
    if frac:
        text = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    if not re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/-?\d+(?:\.\d+)?)?", text):
        return None
    numerator, _, denominator = text.partition("/")
    try:
        return Fraction(numerator) / Fraction(denominator) if denominator else Fraction(numerator)
    except ZeroDivisionError:
        return None


# ---- safe symbolic parsing ----
# LaTeX -> a plain infix string -> tokens -> sympy objects, by recursive descent over a fixed grammar:
#   sum := product (('+'|'-') product)* ; product := unary (('*'|'/')? unary)* (no operator = implicit '*')
#   unary := '-' unary | power ; power := atom ('^' unary)? ; atom := number | name | func '(' sum ')' | '(' sum ')'

MAX_EXPRESSION_CHARS = 80   # longer answers are compared as text only
MAX_EXPONENT = 64           # larger literal exponents are refused (no 2^999999999 blow-ups) ...
MAX_POWER_BITS = 4096       # ... and so are powers of numbers whose result would exceed this many bits
_FUNCTIONS = {"sqrt": sympy.sqrt, "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "log": sympy.log,
              "ln": sympy.log, "exp": sympy.exp}
_CONSTANTS = {"pi": sympy.pi, "e": sympy.E, "i": sympy.I}
_TOKEN = re.compile(r"\d+(?:\.\d+)?|\.\d+|[a-z]+|[-+*/^()]")


def _latex_to_infix(text: str) -> str:
    for command, replacement in [("\\cdot", "*"), ("\\times", "*"), ("\\div", "/"), ("\\pi", "pi"), ("**", "^")]:
        text = text.replace(command, replacement)
    while "\\frac{" in text or "\\sqrt{" in text:
        start = min(i for i in (text.find("\\frac{"), text.find("\\sqrt{")) if i >= 0)
        is_frac = text.startswith("\\frac{", start)
        first_open = start + 5  # index of '{' in both "\\frac{" and "\\sqrt{"
        first = _braced(text, first_open)
        if first is None:
            raise ValueError("unbalanced braces")
        after = first_open + len(first) + 2
        if not is_frac:
            text = f"{text[:start]}sqrt({first}){text[after:]}"
            continue
        second = _braced(text, after) if text[after:after + 1] == "{" else None
        if second is None:
            raise ValueError("\\frac without a second argument")
        text = f"{text[:start]}(({first})/({second})){text[after + len(second) + 2:]}"
    return text.replace("{", "(").replace("}", ")").replace("\\", "")


class _Parser:
    def __init__(self, text: str):
        self.tokens = _TOKEN.findall(text)
        if "".join(self.tokens) != text:
            raise ValueError(f"unexpected characters in {text!r}")
        self.position = 0

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise ValueError(f"expected {expected or 'a token'}, got {token}")
        self.position += 1
        return token

    def parse(self):
        value = self.sum()
        if self.peek() is not None:
            raise ValueError(f"trailing token {self.peek()}")
        return value

    def sum(self):
        value = self.product()
        while self.peek() in ("+", "-"):
            value = value + self.product() if self.take() == "+" else value - self.product()
        return value

    def product(self):
        value = self.unary()
        while self.peek() is not None and self.peek() not in ("+", "-", ")"):
            operator = self.take() if self.peek() in ("*", "/") else "*"
            value = value * self.unary() if operator == "*" else value / self.unary()
        return value

    def unary(self):
        if self.peek() == "-":
            self.take()
            return -self.unary()
        return self.power()

    def power(self):
        base = self.atom()
        if self.peek() != "^":
            return base
        self.take()
        exponent = self.unary()
        if exponent.is_number and abs(exponent) > MAX_EXPONENT:
            raise ValueError("exponent too large")
        if exponent.is_number and base.is_number and base != 0 and \
                (abs(exponent) * sympy.log(abs(base), 2)).evalf() > MAX_POWER_BITS:
            raise ValueError("power too large")
        return base ** exponent

    def atom(self):
        token = self.take()
        if token == "(":
            value = self.sum()
            self.take(")")
            return value
        if token[0].isdigit() or token[0] == ".":
            return sympy.Rational(token)
        if token in _FUNCTIONS:
            self.take("(")
            value = self.sum()
            self.take(")")
            return _FUNCTIONS[token](value)
        if token in _CONSTANTS:
            return _CONSTANTS[token]
        if len(token) == 1:
            return sympy.Symbol(token)
        raise ValueError(f"unknown name {token!r}")


def to_sympy(answer: str):
    """An answer ("2\\sqrt{13}", "18\\pi", "\\frac{7}{2}") as a sympy expression, through normalize_answer and the
    whitelisted parser above; ValueError if it is not a small expression."""
    return _parse(normalize_answer(answer))


def _parse(text: str):
    """Normalised text as a sympy expression; ValueError past MAX_EXPRESSION_CHARS or outside the parser's grammar."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"answer longer than {MAX_EXPRESSION_CHARS} characters")
    return _Parser(_latex_to_infix(text)).parse()


# ---- equivalence and grade ----

def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += (char in "({[") - (char in ")}]")
        if char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    return parts + [text[start:]]


_DECIMAL = re.compile(r"-?\d*\.(\d+)")
MIN_ROUNDED_DECIMALS = 2   # "7.2" is too coarse to stand for 2\sqrt{13}; "7.21" is its rounding


def _irrational_value(text: str) -> float | None:
    """The value of an exact irrational answer (2\\sqrt{13}, 10\\pi), or None. A rational one (1/3) has an exact
    written form, so a rounding of it is not accepted in its place."""
    if _as_fraction(text) is not None or len(text) > MAX_EXPRESSION_CHARS:
        return None
    value = _parse(text)
    return float(value.evalf()) if value.is_number and value.is_real and value.is_rational is False else None


def _rounds_to(decimal: str, exact: str) -> bool:
    """True when `decimal` ("7.21") is the irrational `exact` ("2\\sqrt{13}") correctly rounded to its own number
    of decimals (at least MIN_ROUNDED_DECIMALS): what a model that computed the answer with a tool writes."""
    match = _DECIMAL.fullmatch(decimal)
    if match is None or len(match.group(1)) < MIN_ROUNDED_DECIMALS:
        return False
    value = _irrational_value(exact)
    return value is not None and abs(float(decimal) - value) <= 0.5 * 10 ** -len(match.group(1)) * (1 + 1e-9)


def _equal_normalized(first: str, second: str) -> bool:
    if first == second:
        return True
    first_number, second_number = _as_fraction(first), _as_fraction(second)
    if first_number is not None and second_number is not None:
        return first_number == second_number
    first_parts, second_parts = _split_top_level(first), _split_top_level(second)
    if len(first_parts) > 1 and len(first_parts) == len(second_parts):  # tuples/lists: element-wise, in order
        return all(_equal_normalized(a, b) for a, b in zip(first_parts, second_parts))
    try:
        return _rounds_to(first, second) or _rounds_to(second, first) or \
            sympy.simplify(_parse(first) - _parse(second)) == 0
    except Exception:  # malformed, unsupported or too long an expression: not equivalent (grading never raises)
        return False


def is_equivalent(prediction: str | None, label: str) -> bool:
    """True when `prediction` means the same answer as `label`: equal after normalize_answer, equal as exact
    numbers (7 = 7.0 = 7.00 = 14/2 = \\frac{14}{2}; 1,000 = 1000), element-wise for comma lists, a decimal that
    is the other, irrational side correctly rounded (7.21 = 2\\sqrt{13}, 31.42 = 10\\pi; two decimals at least), or equal as
    small symbolic expressions (sympy, whitelisted parser, size-limited). Never raises."""
    if prediction is None or label is None:
        return False
    try:
        return _equal_normalized(normalize_answer(str(prediction)), normalize_answer(str(label)))
    except Exception:
        return False


def grade(response: str, label: str) -> float:
    """1.0 if the final answer extracted from `response` is equivalent to `label`, else 0.0."""
    return 1.0 if is_equivalent(extract_final_answer(response or ""), label) else 0.0


# ---- reading what an agent left behind ----
# Whatever an agent leaves is hostile: add.py as a symlink to /dev/zero (an unbounded read grows the trainer until
# MemoryError) or to a host secret, a FIFO no one writes (open() blocks the trainer), a 100 MB sparse file, a
# directory where a file belongs, a symlinked parent directory, a hard link to a host file. So a path is walked one
# name at a time from the root, each directory opened relative to the last with O_NOFOLLOW (no link anywhere on the
# way is followed, the root's own last name included: an unjailed agent has the trainer's uid and can swap its own
# directory for a link), and only a regular file with one name and at most `max_bytes` bytes is read. Each name is
# checked with lstat before it is opened, as opening a FIFO blocks and opening a device can act; what was opened is
# checked again with fstat. No deadline is needed: the agent's whole process tree is dead before its grader runs,
# nothing is opened that could block (O_NONBLOCK besides), and a regular file on the workspace's local filesystem
# reads in bounded time.

class AgentFileError(Exception):
    """A file an agent left that read_agent_file refused; the message is '<path>: <why>'."""


class AgentFileMissing(AgentFileError):
    """The file, or a directory on its way, does not exist: an agent that deleted its answer, not a hostile file."""


_KINDS = [(stat.S_ISREG, "a regular file"), (stat.S_ISLNK, "a symbolic link (never followed)"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]
_OPEN_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def read_agent_file(root: str, relative_path: str, max_bytes: int) -> bytes:
    """The bytes of `relative_path` ('name' or 'folder/name') under the directory `root`, which an agent wrote
    into. Refused (AgentFileError, naming the path and why) unless `root` and every folder on the way are real
    directories and the last name a regular file with one name and at most `max_bytes` bytes; at most
    max_bytes + 1 bytes are ever read. AgentFileMissing (an AgentFileError) when it does not exist; ValueError when
    `relative_path` is not plain names (an empty, '.', '..' or absolute part): the grader's own mistake."""
    names = relative_path.split("/")
    if any(name in ("", ".", "..") for name in names):
        raise ValueError(f"relative_path must be plain names joined by '/', got {relative_path!r}")
    directory = _open_directory(root, None, root)
    try:
        for depth, name in enumerate(names[:-1]):
            inner = _open_directory(name, directory, "/".join(names[:depth + 1]))
            os.close(directory)
            directory = inner
        return _read_regular(names[-1], directory, relative_path, max_bytes)
    finally:
        os.close(directory)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "an unknown kind of file")


def _lstat(name: str, dir_fd: int | None, shown: str) -> os.stat_result:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise AgentFileMissing(f"{shown}: does not exist") from None
    except OSError as exc:                 # e.g. a directory the agent took its permissions from (EACCES)
        raise AgentFileError(f"{shown}: {exc.strerror}") from None


def _open(name: str, dir_fd: int | None, flags: int, shown: str) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        raise AgentFileError(f"{shown}: {exc.strerror}") from None


def _open_directory(name: str, dir_fd: int | None, shown: str) -> int:
    mode = _lstat(name, dir_fd, shown).st_mode
    if not stat.S_ISDIR(mode):
        raise AgentFileError(f"{shown}: not a directory but {_kind(mode)}")
    return _open(name, dir_fd, _OPEN_DIRECTORY, shown)


def _check_file(status: os.stat_result, shown: str, max_bytes: int) -> None:
    if not stat.S_ISREG(status.st_mode):
        raise AgentFileError(f"{shown}: not a regular file but {_kind(status.st_mode)}")
    if status.st_size > max_bytes:
        raise AgentFileError(f"{shown}: larger than {max_bytes} bytes ({status.st_size})")
    if status.st_nlink != 1:   # a second name may be a host file's: a jailed agent cannot link one (another mount,
        # and protected_hardlinks refuses a file it could not read), but an unjailed one, with the trainer's uid, can
        raise AgentFileError(f"{shown}: has {status.st_nlink} names (a hard link may be a host file's)")


def _read_regular(name: str, dir_fd: int, shown: str, max_bytes: int) -> bytes:
    _check_file(_lstat(name, dir_fd, shown), shown, max_bytes)
    fd = _open(name, dir_fd, _OPEN_FILE, shown)
    try:
        _check_file(os.fstat(fd), shown, max_bytes)
        data = bytearray()
        # the size checked may not be the size read: stop at end of file or one byte past the cap
        while len(data) <= max_bytes and (chunk := os.read(fd, max_bytes + 1 - len(data))):
            data += chunk
        if len(data) > max_bytes:
            raise AgentFileError(f"{shown}: larger than {max_bytes} bytes")
        return bytes(data)
    finally:
        os.close(fd)


# A byte bound is no memory bound for JSON: `{},` is 3 bytes and a 64-byte dict (a 15 MiB file of them grows the
# parser by ~390 MB). So the values are counted first by a streaming parser (ijson over yajl: it builds no value, keeps
# no more than one token, and stops at the bound), and json.loads runs only on a document within it. Each key, scalar,
# and start and end of a container is one event; a Python object costs at most ~100 bytes per event, so the bound
# caps the parse near 10 MB beyond the document's own bytes.
JSON_EVENTS = 100_000             # far above any report an agent or harness writes (mini's trajectory: ~1,000)


def json_events(text: bytes | str, shown: str, max_events: int = JSON_EVENTS) -> int:
    """How many parse events the JSON an agent wrote holds (`shown` names it in errors), counted without building any
    value: AgentFileError past `max_events`, ValueError where it is not one JSON document."""
    raw = text.encode() if isinstance(text, str) else text
    count = 0
    try:
        for count, _ in enumerate(ijson.basic_parse(io.BytesIO(raw)), 1):
            if count > max_events:
                raise AgentFileError(f"{shown}: more than {max_events} JSON values (its parse would grow unbounded)")
    except ijson.JSONError as exc:
        raise ValueError(f"{shown}: not JSON ({str(exc).splitlines()[0]})") from None
    return count


def parse_agent_json(text: bytes | str, shown: str, max_events: int = JSON_EVENTS):
    """json.loads of JSON an agent wrote, once json_events has found it within `max_events` (the same errors)."""
    json_events(text, shown, max_events)
    return json.loads(text)
