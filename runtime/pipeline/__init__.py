"""Pipeline parallelism on the actor runtime: stages are placements, 1F1B comes from quotas.

``PipelineStep`` turns one training step into actors per stage (forward,
backward, boundary transfers, gradient reduction, optimizer update);
``timeline`` reads a step's trace back (micro-batches held per stage, bubble).
"""
from .schedule import SCHEDULES
from .step import PipelineConfig, PipelineStep, stage_of

__all__ = ["PipelineConfig", "PipelineStep", "SCHEDULES", "stage_of"]
