"""Early-Bird routers (spec/early_bird.md §3–§4): LBS chooses where to decode, LPS which
positions of the active block to commit. Both are small ``nn.Module``s that read only the base
model's logits (and, for LBS, its frozen input embedding), so they add no base-model forward."""

from unmask.routers.io import Routers, load_router, load_routers, save_router
from unmask.routers.lbs import LBSConfig, LBSRouter
from unmask.routers.lps import LPSConfig, LPSRouter

__all__ = ["LBSConfig", "LBSRouter", "LPSConfig", "LPSRouter", "Routers", "load_router", "load_routers",
           "save_router"]
