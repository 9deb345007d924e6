"""Multi-Block Diffusion: the pure Block Buffer (:mod:`.buffer`), its window forward and config
(:mod:`.window`) and the running batch (:mod:`.batch`); spec/mbd.md."""
