"""The benchmark harness keeps working: one tiny run end to end (nothing is timed here)."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_benchmark_harness_runs_end_to_end(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--size-mib", "4", "--rounds", "1", "--world-sizes", "1",
         "--sweep-mib", "2", "--no-s3torchconnector", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    summary = results["runs"][0]["summary"]
    assert {"dcpstore AsyncCheckpointer", "torch FsspecWriter dcp.save", "raw boto3 multipart",
            "torch DefaultStager + plan caching async_save"} <= set(summary)
    for row in summary.values():
        assert row["commit_s"] > 0 and row["load_s"] > 0 and row["requests"] > 0
        assert row["save_cpu_s_per_gib"] > 0 and row["load_cpu_s_per_gib"] > 0
        assert "save_vs_raw_boto3" in row and "save_cpu_vs_raw_boto3" in row
    assert "save_vs_best_peer" in summary["dcpstore AsyncCheckpointer"]
    assert results["blocking_vs_clone"]["ratio_steady_state"] > 0
    assert (tmp_path / "results.png").stat().st_size > 1000
    assert "dcpstore AsyncCheckpointer" in out.stdout
