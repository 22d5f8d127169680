"""A strict structural check of .buildkite/pipeline.yml, so a typo fails CPU CI rather than
an MI355X or H200 agent: known step fields only (Buildkite's command-step attributes), the
required ones present and typed, unique keys, every ``if_changed`` glob matching a file of
this repository, every script a command names present, and each GPU step pinned to its
device. The checker is also shown failing on broken copies of the file."""

import copy
import re
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / ".buildkite" / "pipeline.yml"

TOP_KEYS = {"env", "steps", "agents", "notify"}
# Buildkite command-step attributes (pipeline schema, command step)
STEP_KEYS = {
    "label", "key", "command", "commands", "agents", "env", "if_changed", "artifact_paths",
    "timeout_in_minutes", "depends_on", "soft_fail", "retry", "parallelism", "plugins",
    "priority", "concurrency", "concurrency_group", "branches", "if", "allow_dependency_failure",
    "cancel_on_build_failing", "skip", "notify", "matrix", "secrets", "cache",
}  # fmt: skip
IF_CHANGED_KEYS = {"include", "exclude"}
# every GPU step runs when any of these changes (the issue: kernel, model, runtime paths)
MUST_WATCH = ("src/mono_ext/kernels/**", "src/mono_ext/models/**", "src/mono_ext/runtime/**")
DEVICES = {"gfx950": ("mi355", "8"), "sm_90": ("h200", "1")}


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    files = out.stdout.split() if out.returncode == 0 else []
    return files or [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()]


def _glob_re(glob: str) -> re.Pattern:
    """Buildkite glob: ``**`` crosses directories, ``*`` does not, ``{a,b}`` alternates."""
    out, i = "", 0
    while i < len(glob):
        c = glob[i]
        if glob.startswith("**", i):
            out, i = out + ".*", i + 2
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "{":
            j = glob.index("}", i)
            out += "(?:" + "|".join(re.escape(p) for p in glob[i + 1 : j].split(",")) + ")"
            i = j
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


def _globs(value) -> list:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return value
    return [None]


def check_pipeline(doc, files: list[str]) -> list[str]:
    """Every structural problem of a parsed pipeline (empty: none)."""
    reasons = []
    if not isinstance(doc, dict):
        return ["the pipeline is not a mapping"]
    reasons += [f"unknown top-level key {k!r}" for k in sorted(set(doc) - TOP_KEYS)]
    for k, v in (doc.get("env") or {}).items():
        if not isinstance(v, str):
            reasons.append(f"top-level env {k}: value {v!r} is not a string")
    steps = doc.get("steps")
    if not isinstance(steps, list) or not steps:
        return reasons + ["steps must be a non-empty list"]
    keys = []
    for n, step in enumerate(steps):
        where = f"step {n}"
        if not isinstance(step, dict):
            reasons.append(f"{where} is not a mapping")
            continue
        where = f"step {step.get('key', n)!r}"
        reasons += [f"{where}: unknown field {k!r}" for k in sorted(set(step) - STEP_KEYS)]
        for field, typ in (("label", str), ("key", str), ("command", str)):
            if not isinstance(step.get(field), typ):
                reasons.append(f"{where}: {field} must be a {typ.__name__}")
        key = step.get("key")
        if isinstance(key, str) and not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", key):
            reasons.append(f"{where}: key {key!r} is not [a-z0-9_-]")
        keys.append(key)
        t = step.get("timeout_in_minutes")
        if not (isinstance(t, int) and not isinstance(t, bool) and 0 < t <= 240):
            reasons.append(f"{where}: timeout_in_minutes must be an int in 1..240, got {t!r}")
        agents = step.get("agents")
        if not isinstance(agents, dict) or not isinstance(agents.get("queue"), str):
            reasons.append(f"{where}: agents.queue must name a queue")
            agents = {}
        env = step.get("env") or {}
        for k, v in env.items():
            if not isinstance(v, str):
                reasons.append(f"{where}: env {k}: value {v!r} is not a string")
        ic = step.get("if_changed")
        if not isinstance(ic, dict) or set(ic) - IF_CHANGED_KEYS or "include" not in ic:
            reasons.append(f"{where}: if_changed must be {{include: [...], exclude: [...]}}")
            ic = {}
        include = _globs(ic.get("include", []))
        for g in include + (_globs(ic["exclude"]) if "exclude" in ic else []):
            if not isinstance(g, str):
                reasons.append(f"{where}: if_changed globs must be strings")
            elif not any(_glob_re(g).match(f) for f in files):
                reasons.append(f"{where}: if_changed glob {g!r} matches no file of the repo")
        reasons += [
            f"{where}: if_changed does not watch {w}" for w in MUST_WATCH if w not in include
        ]
        cmd = step.get("command")
        if isinstance(cmd, str):
            m = re.fullmatch(r"bash (\S+) (\S+)", cmd)
            if not m:
                reasons.append(f"{where}: command must be 'bash SCRIPT ARCH', got {cmd!r}")
            else:
                script, arch = m.groups()
                if script not in files:
                    reasons.append(f"{where}: command runs {script}, which is not in the repo")
                if arch not in DEVICES:
                    reasons.append(f"{where}: unknown device {arch!r} (have {sorted(DEVICES)})")
                else:
                    queue, gpus = DEVICES[arch]
                    if queue not in str(agents.get("queue", "")):
                        reasons.append(f"{where}: {arch} step on queue {agents.get('queue')!r}")
                    if env.get("MONO_EXT_EXPECT_ARCH") != arch:
                        reasons.append(f"{where}: MONO_EXT_EXPECT_ARCH is not {arch}")
                    if env.get("MONO_EXT_EXPECT_GPUS") != gpus:
                        reasons.append(f"{where}: MONO_EXT_EXPECT_GPUS is not {gpus}")
        for a in step.get("artifact_paths") or []:
            if not isinstance(a, str):
                reasons.append(f"{where}: artifact path {a!r} is not a string")
    dup = sorted({k for k in keys if keys.count(k) > 1 and k is not None})
    reasons += [f"step key {k!r} is used twice" for k in dup]
    archs = {re.sub(r"^bash \S+ ", "", s.get("command", "")) for s in steps if isinstance(s, dict)}
    reasons += [f"no step runs on {a}" for a in sorted(set(DEVICES) - archs)]
    return reasons


@pytest.fixture(scope="module")
def doc():
    return yaml.safe_load(PIPELINE.read_text())


@pytest.fixture(scope="module")
def files():
    return _tracked() + [str(p.relative_to(ROOT)) for p in (ROOT / ".buildkite").rglob("*")]


def test_the_pipeline_is_well_formed(doc, files):
    assert check_pipeline(doc, files) == []


def test_the_step_script_checks_the_device_and_runs_the_gpu_tests():
    script = (ROOT / ".buildkite" / "gpu_step.sh").read_text()
    for d in (
        "tests/kernels/triton",
        "tests/kernels/flydsl",
        "tests/models/qwen3_next/triton",
        "tests/models/qwen3_next/flydsl",
        "tests/engines",
    ):
        assert d in script and (ROOT / d).is_dir(), d
    assert "gcnArchName" in script and "device_count" in script
    assert "set -euo pipefail" in script


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda d: d["steps"][0].update(comand=d["steps"][0].pop("command")), "unknown field"),
        (lambda d: d["steps"][0]["if_changed"]["include"].append("src/mono_ext/kernal/**"),
         "matches no file"),
        (lambda d: d["steps"][0]["if_changed"]["include"].remove("src/mono_ext/runtime/**"),
         "does not watch src/mono_ext/runtime/**"),
        (lambda d: d["steps"][0].update(command="bash .buildkite/gpu_stp.sh gfx950"),
         "not in the repo"),
        (lambda d: d["steps"][0]["env"].update(MONO_EXT_EXPECT_GPUS=8), "not a string"),
        (lambda d: d["steps"][1].update(key=d["steps"][0]["key"]), "used twice"),
        (lambda d: d["steps"][0]["agents"].update(queue="h200"), "gfx950 step on queue"),
        (lambda d: d["steps"][0].update(timeout_in_minutes="90"), "timeout_in_minutes"),
        (lambda d: d.update(stpes=d.pop("steps")), "unknown top-level key"),
    ],
)  # fmt: skip
def test_the_checker_catches_typos(doc, files, mutate, needle):
    broken = copy.deepcopy(doc)
    mutate(broken)
    reasons = check_pipeline(broken, files)
    assert any(needle in r for r in reasons), reasons
