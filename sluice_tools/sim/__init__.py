"""Discrete-event simulator: the real cores, a virtual clock, an event heap and the GPU cost model."""

from sluice_tools.sim.cluster import Simulator
from sluice_tools.sim.config import SimConfig
from sluice_tools.sim.run import SimResult, simulate

__all__ = ["SimConfig", "SimResult", "Simulator", "simulate"]
