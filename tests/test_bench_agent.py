"""benchmarks/bench_agent_endpoint.py's own code path on a few episodes (`--quick`): both sides run
their episodes to the reward, with the same sample tokens, and the JSON has every number with
the commit, device and command."""

import json
import sys

import pytest
from helpers import background
from helpers.launch import REPO_ROOT

pytest.importorskip("fastapi")
pytest.importorskip("openai")


def _quick(folder: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.bench_agent_endpoint", "--quick", "--out", f"{folder}/agent.json"]


background.register(
    "bench_agent_endpoint",
    ("tests/test_bench_agent.py::test_agent_endpoint_benchmark_quick_run_writes_a_complete_report",),
    _quick,
    {"PYTHONPATH": REPO_ROOT},
)  # in the background from collection on (helpers/background.py)


@pytest.mark.slow  # ~45 s on 2 cores
def test_agent_endpoint_benchmark_quick_run_writes_a_complete_report():
    proc, folder = background.result("bench_agent_endpoint", timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.load(open(folder / "agent.json"))
    assert len(report["commit"]) == 40 and report["device"].startswith("cpu")
    assert report["command"].endswith("--quick --out " + str(folder / "agent.json"))
    results = report["results"]
    assert results["config"]["concurrent_episodes"] == 8
    runs = results["runs"]
    assert runs["endpoint"][0]["sample_tokens"] == runs["in_process"][0]["sample_tokens"] > 0
    for side in ("endpoint", "in_process"):
        run = runs[side][0]
        assert run["episodes_per_s"] == pytest.approx(8 / run["seconds"])
        assert 0.0 <= run["generator_idle_fraction"] <= 1.0
        assert run["generator_idle_fraction"] == pytest.approx(
            (run["start_s"] + run["blocked_poll_s"]) / run["seconds"]
        )
    ratio = results["ratios"]["endpoint_over_in_process_episodes_per_s"]
    assert ratio == pytest.approx(runs["endpoint"][0]["episodes_per_s"] / runs["in_process"][0]["episodes_per_s"])
