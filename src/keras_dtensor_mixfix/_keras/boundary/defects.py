"""Whether the running torch or Keras has an upstream defect of the table (``_upstream.DEFECTS``): what each Keras-side
workaround asks before it is installed or takes its path.

Contract: :func:`running_release_has` answers for the defect's own upstream project (the running torch's release for a
torch defect, the running Keras' for a Keras one), as :meth:`_upstream.Defect.applies` decides for a release the
table does not list; an unknown name raises ``KeyError`` (a workaround names its entry exactly).
"""

from __future__ import annotations

from ..._torch.versions import has_defect, release_of, running_torch_version
from ..._upstream import BY_NAME
from . import keras_modules

__all__ = ["running_release_has"]


def running_release_has(name: str) -> bool:
    """Whether the running release of the defect ``name``'s upstream project has it."""
    defect = BY_NAME[name]
    if defect.upstream == "torch":
        return has_defect(name, running_torch_version())
    return defect.applies(release_of(keras_modules.running_keras_version()))
