"""Chapter 08: tensor parallelism over torch.distributed (gloo on a CPU, NCCL on GPUs).

    llm = LLM(tensor_parallel_size=2)      # spawns rank 1 itself; or run under torchrun / accelerate launch

sharding: which slice of each weight a rank holds; layers: the row-parallel and vocabulary-parallel
layers that communicate; loader: a rank's shard from the checkpoint; group: the ranks and how rank 0
reaches them; worker: what each rank runs; runtime: this process's part, as `LLM` starts it.
"""
from nanoserve.distributed.sharding import ShardPlan, check_tensor_parallel_size

__all__ = ["ShardPlan", "check_tensor_parallel_size"]
