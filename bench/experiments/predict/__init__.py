"""``bench predict``'s model (issue 62): a cost per transport from a micro run (:mod:`.costs`) and a discrete-event
simulation of one parameter-server step at any number of servers and link rate (:mod:`.simulate`: its function
``simulate`` is not re-exported here, where it would hide the module of the same name)."""

from bench.experiments.predict.costs import TransferCost, cost_from_points, costs_from_run, sizes_needed
from bench.experiments.predict.simulate import APPLY_S_PER_BYTE, Cluster, StepPrediction, nic_bytes

__all__ = ["APPLY_S_PER_BYTE", "Cluster", "StepPrediction", "TransferCost", "cost_from_points", "costs_from_run",
           "nic_bytes", "sizes_needed"]
