"""unmask: commit many tokens per forward pass.

    >>> import unmask
    >>> out = unmask.generate("Once upon a time", model="stories260K", decoder="ar", max_new_tokens=32)
    >>> out.texts[0], out.stats.nfe, out.stats.tpf
"""

__version__ = "0.1.0"

from unmask.api import Generation, generate
from unmask.decode import DecodeStats
from unmask.errors import UnmaskError
from unmask.models import ModelBundle, load, shipped
from unmask.sampling import Sampling
from unmask.threads import set_threads

__all__ = ["DecodeStats", "Generation", "ModelBundle", "Sampling", "UnmaskError", "generate", "load", "set_threads", "shipped", "__version__"]
