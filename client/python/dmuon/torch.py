"""Deprecated: the old name of dmuon.optim (kept so existing imports work).

    from dmuon.torch import DMuon      # still works: the same class
    from dmuon.optim import DMuon      # the name to use

This module is dmuon.optim itself (sys.modules maps both names to one
module object), so its classes, functions and any monkeypatching are
shared. It was renamed because a submodule called `torch` shadows the name
`torch` inside the package.
"""

import sys
import warnings

from . import optim

warnings.warn("dmuon.torch is deprecated; import dmuon.optim instead (the same module)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = optim
