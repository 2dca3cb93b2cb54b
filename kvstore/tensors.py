"""Whether a value is a torch tensor, asked without importing torch.

Importing torch takes most of a second, most of what ``kvstore serve`` spent
starting, and the daemon never holds a tensor: its chunks arrive as bytes off
a socket. A caller that holds a tensor has imported torch already, so where
``torch`` is not in ``sys.modules`` (or is still being imported, its
``Tensor`` not yet defined) no value can be one. The format and the store
ask here, and import torch only where they make a tensor
(``KVChunk.tensor``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    import torch


def is_tensor(value: Any) -> TypeGuard[torch.Tensor]:
    """``isinstance(value, torch.Tensor)``, without importing torch."""
    tensor_type = getattr(sys.modules.get("torch"), "Tensor", None)
    return tensor_type is not None and isinstance(value, tensor_type)
