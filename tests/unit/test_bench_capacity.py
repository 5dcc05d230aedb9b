"""bench/capacity.py: the capacity model's arithmetic (issue 40, item 4)."""
import json

from bench import capacity


def _result(tmp_path, **ms):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"points": {"service": {"cpu_ms_per_job": ms}}}))
    return path


def test_each_process_is_planned_at_seventy_percent_of_a_core(tmp_path):
    path = _result(tmp_path, **{"api": 1.0, "worker main": 0.2, "redis": 0.1,
                                "worker child": 0.07})
    row = capacity.model(path, "service")["plans"]["this_machines_cores"]["10000"]
    # 1.0 ms a job at 70 % of a core: 700 jobs/s a process, 15 processes for 10,000.
    assert row["per_process_jobs_per_s_at_70pct"] == {"api": 700, "worker_main": 3500,
                                                      "redis": 7000}
    assert (row["api_processes"], row["worker_main_processes"], row["redis_groups"]) == (15, 3, 2)
    assert row["cores_for_children_outside_the_model"] == 1


def test_the_gpu_host_is_projected_by_the_measured_pair_part_by_part(tmp_path):
    path = _result(tmp_path, **{"api": 1.0, "worker main": 0.2, "redis": 0.1,
                                "worker child": 0.07})
    result = capacity.model(path, "service")
    here = capacity.costs(capacity.HERE_REF, "service")
    there = capacity.costs(capacity.GPU_HOST_REF, "service")
    assert result["ms_per_job_gpu_host_projected"]["redis"] == round(
        0.1 * there["redis"] / here["redis"], 3)
    # A host whose cores do less a job needs more processes for the same rate.
    gpu = result["plans"]["gpu_host_cores"]["50000"]
    local = result["plans"]["this_machines_cores"]["50000"]
    assert gpu["api_processes"] > local["api_processes"]
