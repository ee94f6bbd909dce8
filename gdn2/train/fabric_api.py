"""Lightning Fabric, from whichever of its two distributions is installed: ``lightning-fabric`` (what
gdn2 depends on: Fabric alone) or the ``lightning`` bundle, whose ``lightning.fabric`` is the same code.
Every Fabric name gdn2 uses comes from here, so all of them come from one of the two.

The bundle also depends on torchmetrics, which Fabric imports to read its version when it is
installed: about 6 s more at every process start (each rank, each command) on a small machine.
"""

import importlib.util

if importlib.util.find_spec("lightning_fabric") is not None:
    from lightning_fabric import Fabric
    from lightning_fabric.loggers import CSVLogger, Logger, TensorBoardLogger
    from lightning_fabric.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
    from lightning_fabric.wrappers import _unwrap_objects
else:  # only the bundle
    from lightning.fabric import Fabric
    from lightning.fabric.loggers import CSVLogger, Logger, TensorBoardLogger
    from lightning.fabric.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
    from lightning.fabric.wrappers import _unwrap_objects

__all__ = ["Fabric", "CSVLogger", "Logger", "TensorBoardLogger", "DDPStrategy", "FSDPStrategy",
           "ModelParallelStrategy", "unwrap"]

unwrap = _unwrap_objects  # the module or optimizer inside Fabric's wrapper
