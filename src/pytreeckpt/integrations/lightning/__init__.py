"""Lightning's ``CheckpointIO`` plugins: a Lightning checkpoint saved as a pytreeckpt checkpoint.

``Trainer(plugins=[PytreeCheckpointIO()])`` and ``Fabric(plugins=[PytreeCheckpointIO()])``
write each checkpoint Lightning asks for (``.../epoch=0-step=10.ckpt``, ``last.ckpt``) as a
pytreeckpt checkpoint directory of that name; :class:`AsyncPytreeCheckpointIO` writes it
behind the training loop with :func:`pytreeckpt.async_save`. What a checkpoint's values
become is said in :mod:`~pytreeckpt.integrations.lightning._values`.
"""

from ._io import AsyncPytreeCheckpointIO as AsyncPytreeCheckpointIO
from ._io import PytreeCheckpointIO as PytreeCheckpointIO

__all__ = ["AsyncPytreeCheckpointIO", "PytreeCheckpointIO"]
