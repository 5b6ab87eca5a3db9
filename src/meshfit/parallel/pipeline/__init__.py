"""Pipeline parallel: the user's model cut into stages, run by torch.distributed.pipelining.

One module per job: `costs` (what a stage costs, balanced cut points), `cut` (cutting the
model in place), `stage` (a stage's module: the model's own forward over its blocks) and
`schedule` (PipelineStages, the schedule, and the runner the Engine drives).
"""

from meshfit.parallel.pipeline.checks import _modules_outside
from meshfit.parallel.pipeline.costs import (
    StageCosts,
    balanced_starts,
    count_costs,
    parameter_costs,
    stage_costs_of,
)
from meshfit.parallel.pipeline.cut import (
    VIRTUAL_STAGES,
    PipelineSplit,
    _head_tail_parameters,
    split_model,
)
from meshfit.parallel.pipeline.schedule import PipelineRunner, build_pipeline, reported_dtype
from meshfit.parallel.pipeline.stage import StageModule, build_stage_module

__all__ = [
    "VIRTUAL_STAGES",
    "PipelineRunner",
    "PipelineSplit",
    "StageCosts",
    "StageModule",
    "_head_tail_parameters",
    "_modules_outside",
    "balanced_starts",
    "build_pipeline",
    "build_stage_module",
    "count_costs",
    "parameter_costs",
    "reported_dtype",
    "split_model",
    "stage_costs_of",
]
