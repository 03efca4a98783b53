"""Simulation of the rollout side at scale: simulated engines behind the real router and service,
in simulated time (:mod:`~loongsage.core.sim.clock`, :mod:`~loongsage.core.sim.engine`)."""
