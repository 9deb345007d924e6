"""Block decoders over an exact KV cache: lossy SBD (:mod:`.sbd`) and SingleBD (:mod:`.single`) on one
running batch (:mod:`.batch`) with the pure commit rule (:mod:`.rule`) and its step report (:mod:`.report`)."""
