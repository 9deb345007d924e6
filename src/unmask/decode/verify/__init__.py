"""AR and lossless SBD on one verify batch (spec/sbd_exact.md): AR, the K = 1 step (:mod:`.ar`); the
running batch (:mod:`.batch`) and its rows' host side (:mod:`.rows`); its resolved config, windows and
tables (:mod:`.config`); the pure step rule (:mod:`.steps`), tree windows (:mod:`.tree`) and sampled
acceptance (:mod:`.sampled`); draft layouts: chains (:mod:`.chain`), siblings (:mod:`.siblings`) and the
options that name them (:mod:`.layout`). Lossless SBD's knobs are the ``sbd`` decoder's
(:mod:`unmask.decode.blocks.sbd`)."""
