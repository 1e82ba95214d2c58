"""`examples/stress.py` at CI size on a tiny model: overload, a cancellation storm, injected
faults, a short soak and short requests behind long prompts each hold (the script checks its own
figures and exits non-zero if a scenario fails)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

STRESS = Path(__file__).resolve().parent.parent / "examples" / "stress.py"


@pytest.mark.slow
def test_stress_scenarios_hold_at_ci_size(tiny_model):
    args = ["--model", str(tiny_model), "--requests", "300", "--streams", "80"]
    args += ["--scenarios", "overload,cancellations,faults,soak,hol"]
    done = subprocess.run(
        [sys.executable, str(STRESS), *args, "--minutes", "0.15", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(done.stdout[: done.stdout.rindex("}") + 1])
    assert done.returncode == 0, (report, done.stderr[-2000:])
    overload = report["overload"]
    assert overload["refused_overloaded"] > 0 and overload["preemptions"] > 0  # both happened
    assert overload["completed_same_text"] + overload["refused_overloaded"] == 300
    storm = report["cancellations"]
    assert storm["aborted"] > 0 and storm["survivors_same_text"] == storm["survivors"]
    assert storm["max_tokens_after_abort"] <= 4
    faults = report["faults"]
    assert sum(faults["faults"].values()) > 0  # each stage alone: tests/test_faults.py
    assert 0 < faults["failed_requests"] < 80
    assert faults["untouched_prefix_cached_tokens"] > 0
    assert report["soak"]["blocks_leaked"] == 0 and report["soak"]["rss_growth_pct"] < 5
    # Engine steps from being queued to the first token: a short one starts in its first step.
    assert report["hol"]["cap_on"]["short_ttft_steps_p99"] == 1
    assert "started" in done.stderr  # progress as it runs, not only the report at the end
