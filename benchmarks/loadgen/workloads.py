"""The benchmark's workloads moved into the package (`pdserve.workload.datasets`), where the
planner reads them too; this name stays for the scripts and tests that import it."""

from pdserve.workload.datasets import (
    DATASETS,
    DEFAULT_LENGTHS,
    RequestSpec,
    WorkloadConfig,
    build_workload,
    parse_length,
    read_jsonl,
)

__all__ = [
    "DATASETS",
    "DEFAULT_LENGTHS",
    "RequestSpec",
    "WorkloadConfig",
    "build_workload",
    "parse_length",
    "read_jsonl",
]
