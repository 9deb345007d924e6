"""AR and lossless SBD on one verify batch: AR (:mod:`.ar`), the running batch (:mod:`.batch`), its
pure step rule and config (:mod:`.steps`), tree windows (:mod:`.tree`), sampled acceptance
(:mod:`.sampled`) and draft layouts (:mod:`.layout`, :mod:`.siblings`); spec/sbd_exact.md."""
