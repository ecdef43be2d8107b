"""Tensor parallelism over torch.distributed: the process group and its failures (`group`), starting
and stopping the ranks (`launch`: torch.multiprocessing on one machine, torchrun across machines),
the other ranks' command loop (`worker`) and rank 0's side (`driver`). What each rank holds of the
model is `models.sharding`; the parallel layers are `layers.parallel`."""
