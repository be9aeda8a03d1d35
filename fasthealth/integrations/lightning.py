"""``HealthCallback``: the Monitor inside a Lightning 2.x ``Trainer`` (``import lightning``);
see ``HealthCallbackMixin`` for what it does. ``fasthealth.integrations.pytorch_lightning``
has the same callback for the ``pytorch_lightning`` package."""

from lightning.pytorch import Callback

from ._lightning import HealthCallbackMixin


class HealthCallback(HealthCallbackMixin, Callback):
    __doc__ = HealthCallbackMixin.__doc__
