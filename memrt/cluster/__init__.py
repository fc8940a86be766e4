"""Emulated clusters on one machine: network namespaces joined by a rate-limited link, slow ranks."""

from memrt.cluster.emulated import EmulatedCluster, can_emulate, parse_rate

__all__ = ["EmulatedCluster", "can_emulate", "parse_rate"]
