"""Final-answer extraction and math equivalence for task files (math-verify), never raising on model output."""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from fractions import Fraction
from functools import lru_cache


logger = logging.getLogger(__name__)

MAX_COMPLETION_CHARS = 100_000  # longer completions are judged by their last 100k characters
MAX_ANSWER_CHARS = 300  # a longer extracted final answer scores 0 (no math answer is that long)
MAX_NUMBER_CHARS = 60  # plain numbers longer than this go through math-verify, not Fraction
MATH_TIMEOUT_S = 2  # math-verify's budget per parse and per comparison (whole seconds: signal.alarm)

# ------------------------------------------------------------------------------------ answer extraction
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
NUMBER = re.compile(_NUMBER)
NUMBER_OR_FRACTION = re.compile(rf"{_NUMBER}(?:\s*/\s*{_NUMBER})?")
PLAIN_NUMBER = re.compile(r"\s*(-?\d+(?:\.\d+)?(?:/-?\d+(?:\.\d+)?)?)\s*")
LATEX_HINTS = ("\\", "^", "{")
MARKERS = ("final answer is", "final answer:", "answer is", "answer:")


def _balanced_braces(text: str, open_at: int) -> str | None:
    """The content of the {...} group whose '{' is at `open_at` (nested braces balanced), or None."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:i]
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) in `text`, or None if absent or unclosed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = start + (6 if text.startswith("\\boxed", start) else 5)
    if text.startswith("{", rest):
        return _balanced_braces(text, rest)
    if text.startswith(" ", rest):  # "\boxed 5": up to the next whitespace or '$'
        token = re.match(r"\s*([^\s$]+)", text[rest:rest + MAX_ANSWER_CHARS + 1])
        return token.group(1) if token else None
    return None


def last_tag(text: str, tag: str) -> str | None:
    """The content of the last <tag>...</tag> (to the end of the text if it is not closed), or None."""
    start = text.rfind(f"<{tag}>")
    if start < 0:
        return None
    start += len(tag) + 2
    end = text.find(f"</{tag}>", start)
    return text[start:] if end < 0 else text[start:end]


def _answer_in(segment: str) -> str | None:
    """A final answer stated in free text: its first $...$ (else its first line) if that looks like LaTeX
    (has a backslash, ^ or {), else the first number or simple fraction in it ("$1,000." -> "1000",
    "3 / 4" -> "3/4")."""
    segment = segment.strip()
    math_mode = re.search(r"\$+([^$]+)\$+", segment)
    candidate = (math_mode.group(1) if math_mode else segment.split("\n", 1)[0]).strip().rstrip(".,;:").strip()
    if any(h in candidate for h in LATEX_HINTS):
        return candidate.strip("$").strip() or None
    number = NUMBER_OR_FRACTION.search(candidate) or NUMBER_OR_FRACTION.search(segment)
    return re.sub(r"[,\s]", "", number.group(0)) if number else None


def extract_final_answer(text: str) -> str | None:
    """The final answer of a completion: the content of the last \\boxed{...} (balanced braces), else of
    the last <answer>...</answer>, else what follows the last '####', else what follows the last "answer
    is" / "answer:" (to the end of its line), else the whole text if it is one line of LaTeX, else the
    last number in the text; None if there is none.
    From free text (all but \\boxed) a LaTeX-looking answer is kept as written (its first $...$), else
    its first number or simple fraction. Never raises."""
    try:
        if not isinstance(text, str):
            return None
        text = text[-MAX_COMPLETION_CHARS:]
        boxed = last_boxed(text)
        if boxed is not None and boxed.strip():
            return boxed.strip()
        tagged = last_tag(text, "answer")
        if tagged is not None:
            inner = last_boxed(tagged)
            found = inner.strip() if inner else _answer_in(tagged)
            if found:
                return found
        if "####" in text:
            found = _answer_in(text[text.rfind("####") + 4:].split("\n", 1)[0])
            if found:
                return found
        lower = text.lower()
        at = max((lower.rfind(m) + len(m) if lower.rfind(m) >= 0 else -1) for m in MARKERS)
        if at >= 0:
            found = _answer_in(text[at:].split("\n", 1)[0])
            if found:
                return found
        whole = text.strip()
        if "\n" not in whole and len(whole) <= MAX_ANSWER_CHARS and any(h in whole for h in LATEX_HINTS):
            return _answer_in(whole)  # the completion is a bare expression: "\frac{1}{2}", "$2^{10}$"
        numbers = NUMBER.findall(text)
        return numbers[-1].replace(",", "") if numbers else None
    except Exception:  # noqa: BLE001 - model output never raises
        return None


# ---------------------------------------------------------------------------------------------- math
def _gold_form(answer: str) -> str:
    """A gold answer as a bare expression: a full solution text ("... #### 72", "... \\boxed{5}") is
    reduced to its final answer; "$...$" delimiters are dropped."""
    answer = answer.strip()
    if "\\boxed" in answer or "\\fbox" in answer or "####" in answer:
        answer = extract_final_answer(answer) or answer
    return answer.strip().strip("$").strip()


def _canonical(text: str) -> str:
    return re.sub(r"\s+|\\[ ,;!]|\$", "", text).rstrip(".")


def _as_fraction(text: str) -> Fraction | None:
    """An integer, decimal or a/b fraction ("1,000", "0.50", "3/4") as an exact Fraction, else None."""
    text = text.replace(",", "")
    if len(text) > MAX_NUMBER_CHARS:
        return None
    m = PLAIN_NUMBER.fullmatch(text)
    if m is None:
        return None
    try:
        return Fraction(m.group(1))
    except (ValueError, ZeroDivisionError):
        return None


def _parse_latex(expr: str, timeout_s: int | None) -> list:
    from math_verify import parse

    return parse(f"${expr}$", parsing_timeout=timeout_s)


@lru_cache(maxsize=4096)
def _parse_gold(expr: str, timeout_s: int | None) -> list:
    return _parse_latex(expr, timeout_s)


def _math_equal(gold: str, pred: str, timeout_s: int | None) -> bool:
    """math-verify's equivalence of two bare LaTeX/plain expressions. With timeout_s, math-verify
    interrupts a slow parse or comparison by SIGALRM, so this must run on a main thread."""
    from math_verify import verify

    gold_parsed, pred_parsed = _parse_gold(gold, timeout_s), _parse_latex(pred, timeout_s)
    return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))


class _MathWorker:
    """math-verify in a child process, for callers off the main thread (signal.alarm, math-verify's
    timeout, only works on the main thread). The child runs each comparison on its own main thread with
    math-verify's timeouts; if it has not answered within the deadline (a computation stuck where a signal
    cannot reach it) it is killed, the answer is False, and the next call starts a fresh child. Calls are
    serialised by a lock."""

    STARTUP_S = 120.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._failed = False

    def _start(self) -> subprocess.Popen | None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([p for p in sys.path if p]))
        code = "from steadyrl.reward.math_answers import _worker_main; _worker_main()"
        try:
            proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    env=env, bufsize=0)
            if _read_line(proc, time.monotonic() + self.STARTUP_S) == "ready":
                return proc
            proc.kill()
            proc.wait()
            reason = "it did not report ready"
        except OSError as err:
            reason = str(err)
        logger.warning(f"could not start the math-verify child process ({reason}); off the main thread, math answers "
                       "are verified in a thread without an interruptible timeout")
        self._failed = True
        return None

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def equal(self, gold: str, pred: str, timeout_s: int) -> bool:
        with self._lock:
            if self._proc is None and not self._failed:
                self._proc = self._start()
            if self._proc is None:
                return _equal_in_thread(gold, pred, timeout_s)
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write((json.dumps([gold, pred, timeout_s]) + "\n").encode())
                # a parse of each side and the comparisons, each bounded by timeout_s inside the child
                reply = _read_line(self._proc, time.monotonic() + 4 * timeout_s + 2.0)
            except OSError:
                reply = None
            if reply not in ("0", "1"):
                logger.warning("math-verify child process timed out or died; restarting it")
                self.stop()
                return False
            return reply == "1"


def _read_line(proc: subprocess.Popen, deadline: float) -> str | None:
    """One line from the child's stdout, or None at EOF or when `deadline` (monotonic) passes."""
    assert proc.stdout is not None
    fd, data = proc.stdout.fileno(), b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        data += chunk
    return data.decode(errors="replace").strip()


def _worker_main() -> None:
    """The child's loop: a JSON [gold, pred, timeout_s] per stdin line -> "1" / "0" per stdout line."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # nothing else may write to the protocol stream
    import math_verify  # noqa: F401 - import before announcing readiness

    out.write("ready\n")
    for line in sys.stdin:
        try:
            gold, pred, timeout_s = json.loads(line)
            ok = _math_equal(gold, pred, int(timeout_s))
        except BaseException:  # noqa: BLE001 - incl. math-verify's TimeoutException
            ok = False
        out.write("1\n" if ok else "0\n")


def _equal_in_thread(gold: str, pred: str, timeout_s: int) -> bool:
    """Fallback without a child process: math-verify without its signal timeout, in a daemon thread that
    is abandoned (left running) if it overruns the deadline."""
    result: list[bool] = []

    def run() -> None:
        try:
            result.append(_math_equal(gold, pred, None))
        except BaseException:  # noqa: BLE001
            result.append(False)

    thread = threading.Thread(target=run, name="math-verify", daemon=True)
    thread.start()
    thread.join(4 * timeout_s + 2.0)
    return bool(result and result[0])


_WORKER = _MathWorker()
atexit.register(_WORKER.stop)


def _symbolic_equal(gold: str, pred: str, timeout_s: int) -> bool:
    if threading.current_thread() is threading.main_thread() and os.name == "posix":
        return _math_equal(gold, pred, timeout_s)
    return _WORKER.equal(gold, pred, timeout_s)


def verify_math(completion: str, answer: str | int | float, timeout_s: int = MATH_TIMEOUT_S) -> float:
    """1.0 if the final answer of `completion` (extract_final_answer) equals the gold `answer` ("18",
    "0.5", "\\frac{1}{2}", or a solution text ending in \\boxed{} / '#### n'), else 0.0. Plain numbers
    and a/b fractions compare exactly (Fraction); anything else by math-verify's numeric/symbolic
    equivalence, each parse and comparison limited to `timeout_s` seconds (a timeout scores 0). On the
    main thread math-verify's SIGALRM timeout is used; elsewhere (Ray actor threads, Serve replicas) the
    check runs in a child process that is killed if it overruns."""
    try:
        pred = extract_final_answer(completion)
        gold = _gold_form(str(answer))
        if not pred or not gold or len(pred) > MAX_ANSWER_CHARS:
            return 0.0
        pred = pred.strip().strip("$").strip()
        if _canonical(pred) == _canonical(gold):
            return 1.0
        pred_number, gold_number = _as_fraction(pred), _as_fraction(gold)
        if pred_number is not None and gold_number is not None:
            return float(pred_number == gold_number)
        return float(_symbolic_equal(gold, pred, max(1, int(timeout_s))))
    except Exception:  # noqa: BLE001 - model output never raises
        return 0.0
