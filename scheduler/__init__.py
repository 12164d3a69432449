"""The planner: cluster/model/plan files, the cost of a plan (docs/cost-model.md), and
the algorithms that lay a cluster out into pipeline stages. Imports numpy and the standard library only (its graphs are dense delay/bandwidth matrices; networkx was not needed)."""

from scheduler.cost import CostBreakdown, plan_cost
from scheduler.files import Cluster, ModelSpec, Plan, PlanInputError, Stage, load_cluster, load_model, load_plan
from scheduler.planner import ALGORITHMS, choose_stage_for_volunteer, make_plan

__all__ = [
    "ALGORITHMS",
    "Cluster",
    "CostBreakdown",
    "ModelSpec",
    "Plan",
    "PlanInputError",
    "Stage",
    "choose_stage_for_volunteer",
    "load_cluster",
    "load_model",
    "load_plan",
    "make_plan",
    "plan_cost",
]
