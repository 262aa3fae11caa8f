"""A step's verdict (PASS, FAIL, INCOMPLETE or SKIP, a short reason, seconds), how each
tool's output becomes one, and the summary table. Pure functions, standard library only,
so the CPU tests check them without a GPU.

PASS claims that everything the step was to check was checked: a part that did not run
(a tool out of time, a test skipped for a reason the kit does not expect on a GPU machine)
makes the step INCOMPLETE, never PASS."""

import dataclasses
import re

PASS, FAIL, INCOMPLETE, SKIP = "PASS", "FAIL", "INCOMPLETE", "SKIP"

# pytest's closing line, e.g. "==== 1 failed, 10 passed, 2 errors in 3.01s ====" or, with
# -q, "12 passed, 3 skipped in 4.20s"; long runs add " (0:01:02)" after the seconds.
_PYTEST_CLOSING = re.compile(r"^=*\s*(?P<body>.+?)\s+in\s+[\d.]+s\b(\s*\([\d:]+\))?\s*=*\s*$")
_PYTEST_COUNT = re.compile(r"^(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|warnings?|deselected|rerun)$")
_SANITIZER_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+errors?")
# racecheck reports hazards in a summary of its own: "N hazards displayed (E errors, W warnings)".
_RACECHECK_SUMMARY = re.compile(
    r"RACECHECK SUMMARY:\s*\d+\s+hazards?\s+displayed\s*\((\d+)\s+errors?,\s*(\d+)\s+warnings?\)")
# A line of pytest's short summary: "FAILED tests/test_x.py::test_y[a b] - assert 1 == 2".
_PYTEST_SHORT_SUMMARY = re.compile(r"^=+ short test summary info =+$")
_PYTEST_FAILURE = re.compile(r"^(FAILED|ERROR) (?P<test>.+?)(?: - |$)")
# A skip in the short summary (pytest -rs): "SKIPPED [2] tests/test_x.py:12: needs a CUDA GPU".
_PYTEST_SKIP = re.compile(r"^SKIPPED \[(?P<count>\d+)\] (?P<where>.+?): (?P<reason>.*)$")
# The last line the kit's own check scripts print: "RESULT: PASS <reason>".
_RESULT_LINE = re.compile(r"^RESULT:\s*(PASS|FAIL|SKIP)\b\s*(.*)$")


@dataclasses.dataclass
class Verdict:
    step: str
    status: str  # PASS, FAIL, INCOMPLETE or SKIP
    reason: str
    seconds: float = 0.0


def parse_pytest_summary(text):
    """{outcome: count} from pytest's closing line ("error"/"warning" counted under their
    plural), {} for "no tests ran", None when there is no closing line (pytest was killed
    or crashed before it)."""
    for line in reversed(text.splitlines()):
        match = _PYTEST_CLOSING.match(line.strip())
        if not match:
            continue
        body = match.group("body").strip()
        if body == "no tests ran":
            return {}
        counts = {}
        for part in body.split(", "):
            item = _PYTEST_COUNT.match(part.strip())
            if not item:
                break
            word = item.group(2)
            word = {"error": "errors", "warning": "warnings"}.get(word, word)
            counts[word] = counts.get(word, 0) + int(item.group(1))
        else:
            return counts
    return None


def describe_counts(counts):
    order = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed", "deselected")
    return ", ".join(f"{counts[k]} {k}" for k in order if counts.get(k)) or "no tests ran"


def failures(text):
    """The tests pytest's (last) short summary lists as failed or in error, in its order;
    lines before it, a failing test's captured output among them, are not read."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if _PYTEST_SHORT_SUMMARY.match(line.strip())]
    found = [_PYTEST_FAILURE.match(line) for line in (lines[starts[-1] + 1:] if starts else [])]
    return [m.group("test") for m in found if m]


def first_failure(text):
    """The first of failures(text), or None."""
    return next(iter(failures(text)), None)


def skips(text):
    """[(count, where, reason)] of the skips pytest's short summary lists (pytest -rs)."""
    found = [_PYTEST_SKIP.match(line.strip()) for line in text.splitlines()]
    return [(int(m.group("count")), m.group("where"), m.group("reason")) for m in found if m]


def unexpected_skips(text, counts, expected):
    """(how many skips no reason in `expected` explains, the first of them or None). A
    skip the short summary does not list (no -rs) cannot be explained."""
    listed = skips(text)
    unexplained = [(n, where, why) for n, where, why in listed if not any(e in why for e in expected)]
    missing = counts.get("skipped", 0) - sum(n for n, _, _ in listed)
    first = (f"{unexplained[0][1]}: {unexplained[0][2]}" if unexplained else
             "not listed (run pytest with -rs)" if missing > 0 else None)
    return sum(n for n, _, _ in unexplained) + max(missing, 0), first


def pytest_verdict(text, returncode, expected_skips=()):
    """(status, reason): PASS only with a closing line, at least one test passed, no
    failure, no error, exit status 0 and no skip but for a reason in `expected_skips`;
    any other skip makes it INCOMPLETE. A failing run's reason names its first failure."""
    counts = parse_pytest_summary(text)
    if counts is None:
        return FAIL, f"no pytest summary line (exit {returncode})"
    reason = describe_counts(counts)
    if counts.get("failed") or counts.get("errors"):
        first = first_failure(text)
        return FAIL, reason + (f"; first: {first}" if first else "")
    if not counts.get("passed"):
        return FAIL, f"{reason}: no test passed"
    if returncode != 0:
        return FAIL, f"{reason}, but pytest exited {returncode}"
    unexpected, first = unexpected_skips(text, counts, expected_skips)
    if unexpected:
        return INCOMPLETE, f"{reason}; {unexpected} unexpected skips, first: {first}"
    return PASS, reason


def sanitizer_errors(text):
    """The errors compute-sanitizer reported: its last "ERROR SUMMARY: N errors" plus, from
    racecheck, the errors of its last "RACECHECK SUMMARY"; None when it printed neither
    (it did not finish)."""
    summary, races = _SANITIZER_SUMMARY.findall(text), _RACECHECK_SUMMARY.findall(text)
    if not summary and not races:
        return None
    return (int(summary[-1]) if summary else 0) + (int(races[-1][0]) if races else 0)


def racecheck_warnings(text):
    races = _RACECHECK_SUMMARY.findall(text)
    return int(races[-1][1]) if races else 0


def sanitizer_tool_verdict(tool, text, returncode):
    """(status, reason) of one tool's run over the driver: PASS only when the sanitizer
    reports 0 errors and the driver (whose exit status it passes on) exited 0."""
    errors = sanitizer_errors(text)
    if errors is None:
        return FAIL, f"{tool}: no ERROR SUMMARY (exit {returncode})"
    result = result_line(text)
    driver = f" ({result[1]})" if result and result[0] != PASS and result[1] else ""
    warnings = racecheck_warnings(text)
    noted = f", {warnings} race warnings" if warnings else ""  # hazards racecheck rates below errors
    if errors:
        return FAIL, f"{tool}: {errors} errors{noted}"
    if returncode != 0:
        return FAIL, f"{tool}: 0 errors{noted}, driver exited {returncode}{driver}"
    return PASS, f"{tool}: 0 errors{noted}"


def result_line(text):
    """(status, reason) of the last "RESULT: ..." line a check script printed, or None."""
    for line in reversed(text.splitlines()):
        match = _RESULT_LINE.match(line.strip())
        if match:
            return match.group(1), match.group(2).strip()
    return None


def script_verdict(name, text, returncode):
    """(status, reason) of one of the kit's check scripts: its RESULT line, held against
    its exit status (a crash after a PASS line is a failure)."""
    label = f"{name}: " if name else ""
    result = result_line(text)
    if result is None:
        return FAIL, f"{label}no RESULT line (exit {returncode})"
    status, reason = result
    if status == PASS and returncode != 0:
        return FAIL, f"{label}{reason}, but exited {returncode}"
    return status, f"{label}{reason}"


def combine(parts):
    """One verdict from several (status, reason): FAIL if any failed, SKIP if all
    skipped, INCOMPLETE if any part is or if some parts ran and others were skipped (out
    of time, say), else PASS; the reasons joined with '; '."""
    statuses = [status for status, _ in parts]
    if not parts:
        return SKIP, "nothing ran"
    status = (FAIL if FAIL in statuses else SKIP if all(s == SKIP for s in statuses) else
              INCOMPLETE if INCOMPLETE in statuses or SKIP in statuses else PASS)
    return status, "; ".join(reason for _, reason in parts if reason)


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_table(verdicts):
    """The summary as a markdown table, one row per step, in run order."""
    lines = ["| step | verdict | seconds | details |", "|---|---|---|---|"]
    for v in verdicts:
        lines.append(f"| {v.step} | {v.status} | {v.seconds:.0f} | {_cell(v.reason)} |")
    return "\n".join(lines)
