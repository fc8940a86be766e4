"""memrt.comm: topology-aware drop-in torch.distributed."""
