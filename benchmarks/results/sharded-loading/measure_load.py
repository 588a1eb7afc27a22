import resource, sys, time, torch
from kvserve.distributed.parallel_state import GroupCoordinator
mode, d = sys.argv[1], sys.argv[2]
t = time.perf_counter()
if mode == "share":
    from kvserve.model_executor.sharded_loader import load_rank_share
    loaded, _, read = load_rank_share(d, torch.float32, torch.device("cpu"), GroupCoordinator(0, 2), GroupCoordinator())
    extra = f"read {read.bytes_read/1e6:.0f} MB of {read.checkpoint_bytes/1e6:.0f} MB"
else:
    from kvserve.model_executor.loader import load_model
    from kvserve.model_executor.tensor_parallel import shard_model
    loaded = load_model(d, dtype=torch.float32)
    shard_model(loaded.model, GroupCoordinator(0, 2))
    extra = "read whole"
held = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
print(f"{mode}: {time.perf_counter()-t:.1f} s, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1e3:.0f} MB, rank 0 holds {held/1e6:.0f} MB fp32, {extra}")
