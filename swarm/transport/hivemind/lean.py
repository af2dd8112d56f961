"""hivemind's packages without their own __init__ until something asks for what only it defines.

`import hivemind.dht` runs hivemind/__init__.py first, and that imports the whole library: the
averager (and with it scipy, for its load balancing), the optimizers (pydantic), the mixture of
experts. A peer uses none of them (it takes hivemind's P2P, DHT, serialization and all-reduce
runner), yet every peer process paid about 60 MiB of resident memory and a second or two of
imports for them (docs/bench/scale-lab.md, "Memory per peer").

`defer()` puts `hivemind` and `hivemind.averaging` in sys.modules as packages whose __init__ has
not run: their submodules import as usual (through the package's path), and the first attribute
a package lacks (`hivemind.DHT`, `hivemind.averaging.DecentralizedAverager`, `__version__`) runs
its __init__ then, so code that wants the whole library still gets it. Nothing changes when
hivemind was imported already.
"""

from __future__ import annotations

import importlib.util
import sys
import types

DEFERRED = ("hivemind", "hivemind.averaging")  # parents first


class _DeferredPackage(types.ModuleType):
    """A package module whose __init__ runs on the first attribute it lacks."""

    def __getattr__(self, name: str):
        if (submodule := sys.modules.get(f"{self.__name__}.{name}")) is not None:
            return submodule  # one still importing (`import hivemind.p2p.x as y` looks it up so)
        state = self.__dict__
        if state.get("_hivepipe_init_ran"):  # its __init__ ran (or is running) and did not define it
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        state["_hivepipe_init_ran"] = True
        self.__spec__.loader.exec_module(self)
        return getattr(self, name)


def defer() -> None:
    for name in DEFERRED:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.submodule_search_locations is None or spec.loader is None:
            return  # not an ordinary installed package: leave its import as it is
        module = _DeferredPackage(name)
        module.__spec__, module.__loader__, module.__file__ = spec, spec.loader, spec.origin
        module.__path__, module.__package__ = list(spec.submodule_search_locations), name
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)  # as the import system binds a submodule
