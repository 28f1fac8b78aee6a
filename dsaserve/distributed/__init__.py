"""Tensor and expert parallelism over torch.distributed: process groups, counted collectives, weight shards."""
