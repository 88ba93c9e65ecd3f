"""Distributed execution: process groups for expert (and, next, tensor) parallelism."""

from libs.dist.groups import Group, ParallelGroups, ParallelLayout, default_backend, init_parallel, shutdown_parallel, single_group

__all__ = ["Group", "ParallelGroups", "ParallelLayout", "default_backend", "init_parallel", "shutdown_parallel", "single_group"]
