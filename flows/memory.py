"""Per-step and per-phase memory peaks for tracking: the sampler lives in hybridcore.memwatch (the engine's
memory ledger uses the same one), re-exported here for the flows side."""
from hybridcore.memwatch import MIB, MemoryWatch, rss_mib  # noqa: F401
