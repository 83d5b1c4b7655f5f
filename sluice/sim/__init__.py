"""Discrete-event simulator: the real cores, a virtual clock, an event heap and the GPU cost model."""

from sluice.sim.cluster import Simulator
from sluice.sim.config import SimConfig
from sluice.sim.run import SimResult, simulate

__all__ = ["SimConfig", "SimResult", "Simulator", "simulate"]
