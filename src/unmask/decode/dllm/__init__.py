"""Masked diffusion LMs: the canvas and its approximate caches (:mod:`.canvas`, :mod:`.cache`),
semi-AR diffusion (:mod:`.diffusion`, :mod:`.diffusion_batch`), Dream's schedule (:mod:`.dream`) and
Early-Bird with its routers' selection (:mod:`.early_bird`, :mod:`.early_bird_batch`, :mod:`.eb_select`)."""
