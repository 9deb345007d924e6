"""The base every running batch shares: requests, rows and slots (:mod:`.running`), decode statistics
(:mod:`.stats`), left padding (:mod:`.batching`), KV caches (:mod:`.kv`) and the static cache with its
compiled forward (:mod:`.static`)."""
