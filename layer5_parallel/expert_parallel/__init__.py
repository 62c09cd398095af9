"""Expert parallelism: an MoE block's experts split over the ranks, tokens sent to their experts.

moe.py is the single-process MoE block (routing, capacity, the reference); experts.py splits
its experts over N ranks with two all-to-alls (dispatch, combine); model.py is a tiny
Mixtral / Qwen-MoE transformer trained or run with it; engine_model.py is an MoE model layer
4's engine serves, whose experts split over the tensor-parallel ranks
(`enable_expert_parallel`) or whose every expert is tensor-parallel.
"""
from .engine_model import (
    MoELlamaModel,
    MoEModelConfig,
    check_expert_parallel,
    expert_load,
    moe_config,
    random_moe_model,
    reset_expert_load,
)
from .experts import ExpertParallelMoE, expert_ranges
from .model import MIXTRAL_TINY, QWEN_MOE_TINY, ExpertParallelModel, MoEConfig, MoETransformer
from .moe import MoEBlock, MoEStats, Routing, route

__all__ = ["MoEBlock", "MoEStats", "Routing", "route", "ExpertParallelMoE", "expert_ranges",
           "MoEConfig", "MoETransformer", "ExpertParallelModel", "MIXTRAL_TINY", "QWEN_MOE_TINY",
           "MoELlamaModel", "MoEModelConfig", "moe_config", "random_moe_model", "expert_load",
           "reset_expert_load", "check_expert_parallel"]
