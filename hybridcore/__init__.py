"""hybridcore: the engine every stage runs on (loading, the hybrid actor, RL math, artifacts)."""
